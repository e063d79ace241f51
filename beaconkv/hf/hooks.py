"""Forward hooks that let a :class:`~beaconkv.hf.PolicyCache` follow a transformers model's forwards.

Installed once per model (:func:`install_hooks`, idempotent), they act only when the forward's cache is a
``PolicyCache`` and do nothing otherwise:

* a **pre-hook on the model**: the cache starts a forward (the prefill admits the rows, with their lengths
  from the 2D ``attention_mask``; a decode step takes its positions from ``position_ids``). When the cache
  cuts the forward into several model calls (``PolicyCache(..., prefill_chunk=N)`` and more than ``N``
  tokens in a row, see :mod:`beaconkv.hf.chunks`), the hook runs every call but the last through the model's
  decoder (no logits), the policy acting after each, and hands the model the last call's inputs: the forward
  then returns the logits of its last columns only (``generate`` reads the last one);
* a **hook on the model**: the policy acts once every layer has run (``after_prefill`` /
  ``after_decode_step`` / ``after_chunk``: its schedule, its evictions);
* a **pre-hook on each policy layer's attention module**: hands the attention function a
  :class:`~beaconkv.hf.attention.PolicyTap` (the layer and its rotary tables) through the forward's
  keyword arguments, which transformers passes on to the attention function.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from .attention import PolicyTap
from .errors import PolicyCacheError

_MARK = "_beaconkv_hooks"


def forward_cache(kwargs: dict[str, Any]) -> Any:
    """The cache a forward was called with (``cache``, or its older name ``past_key_values``)."""
    cache = kwargs.get("cache")
    return kwargs.get("past_key_values") if cache is None else cache


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers (``model.get_decoder().layers``)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    return list(decoder.layers)


def install_hooks(model: nn.Module, host: type) -> None:
    """Registers the hooks of the module docstring on ``model`` (once; later calls do nothing).

    Args:
        model: The transformers model.
        host: The cache class the hooks serve (:class:`~beaconkv.hf.PolicyCache`): a forward whose cache is
            not one passes untouched.
    """
    if getattr(model, _MARK, False):
        return

    def model_pre(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        cache = forward_cache(kwargs)
        if not isinstance(cache, host) or cache.splitting:
            return None
        ids = kwargs.get("input_ids", args[0] if args else None)
        tokens = ids if ids is not None else kwargs["inputs_embeds"]
        calls = cache.begin_forward(tokens.shape[0], tokens.shape[1], tokens.device, kwargs.get("attention_mask"),
                                    kwargs.get("position_ids"))
        if len(calls) == 1:
            cache.begin_piece(0)
            return None
        return run_calls(module, cache, args, kwargs, calls)

    def model_post(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        cache = forward_cache(kwargs)
        if isinstance(cache, host) and not cache.splitting:
            cache.end_forward()

    def attention_pre(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        cache = forward_cache(kwargs)
        if not isinstance(cache, host):
            return None
        index = cache.policy_index(module.layer_idx)
        if index is None:
            return None
        cos, sin = kwargs["position_embeddings"]
        return args, {**kwargs, "beaconkv_tap": PolicyTap(cache, index, cos, sin)}

    model.register_forward_pre_hook(model_pre, with_kwargs=True)
    model.register_forward_hook(model_post, with_kwargs=True)
    for layer in decoder_layers(model):
        layer.self_attn.register_forward_pre_hook(attention_pre, with_kwargs=True)
    setattr(model, _MARK, True)


def call_inputs(kwargs: dict[str, Any], n_tokens: int, begin: int, end: int) -> dict[str, Any]:
    """The inputs of a forward's model call over its columns ``begin .. end - 1``: the tokens (or embeddings) and
    positions of those columns, the 2D attention mask up to the call's last column (it covers every column seen
    before the forward too)."""
    out: dict[str, Any] = {}
    for name in ("input_ids", "inputs_embeds", "position_ids"):
        value = kwargs.get(name)
        if value is not None:
            out[name] = value[:, begin:end] if name != "position_ids" else value[..., begin:end]
    mask: Tensor | None = kwargs.get("attention_mask")
    if mask is not None:
        out["attention_mask"] = mask[:, : mask.shape[1] - n_tokens + end]
    return out


def run_calls(model: nn.Module, cache: Any, args: tuple, kwargs: dict[str, Any],
              calls: list[tuple[int, int]]) -> tuple[tuple, dict[str, Any]]:
    """Runs a forward's model calls but the last through ``model``'s decoder (the policy acting after each);
    returns the model's arguments for the last call.

    Raises:
        PolicyCacheError: Inputs passed by position beyond ``input_ids``, or an attention mask that is not 2D.
    """
    if len(args) > 1:
        raise PolicyCacheError("a forward a PolicyCache cuts into chunks takes its inputs by keyword "
                               "(model(input_ids=..., attention_mask=..., cache=...)), as generate passes them.")
    kwargs = {**kwargs, "input_ids": args[0]} if args else dict(kwargs)
    mask = kwargs.get("attention_mask")
    if mask is not None and mask.dim() != 2:
        raise PolicyCacheError(f"a forward a PolicyCache cuts into chunks takes a 2D attention_mask (batch, columns); "
                               f"got one of shape {tuple(mask.shape)}.")
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    key = "cache" if kwargs.get("cache") is not None else "past_key_values"
    n_tokens = calls[-1][1]
    cache.splitting = True
    try:
        for k, (begin, end) in enumerate(calls[:-1]):
            cache.begin_piece(k)
            decoder(**call_inputs(kwargs, n_tokens, begin, end), **{key: cache}, use_cache=True)
            cache.end_piece()
    finally:
        cache.splitting = False
    cache.begin_piece(len(calls) - 1)
    begin, end = calls[-1]
    return (), {**kwargs, **call_inputs(kwargs, n_tokens, begin, end)}
