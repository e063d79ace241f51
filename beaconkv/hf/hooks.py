"""Forward hooks that let a :class:`~beaconkv.hf.PolicyCache` follow a transformers model's forwards.

Installed once per model (:func:`install_hooks`, idempotent), they act only when the forward's cache is a
``PolicyCache`` and do nothing otherwise:

* a **pre-hook on the model**: the cache starts a forward (the prefill admits the rows, with their lengths
  from the 2D ``attention_mask``; a decode step takes its positions from ``position_ids``);
* a **hook on the model**: the policy acts once every layer has run (``after_prefill`` /
  ``after_decode_step``: its schedule, its evictions);
* a **pre-hook on each policy layer's attention module**: hands the attention function a
  :class:`~beaconkv.hf.attention.PolicyTap` (the layer and its rotary tables) through the forward's
  keyword arguments, which transformers passes on to the attention function.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .attention import PolicyTap

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

    def model_pre(module: nn.Module, args: tuple, kwargs: dict) -> None:
        cache = forward_cache(kwargs)
        if isinstance(cache, host):
            ids = kwargs.get("input_ids", args[0] if args else None)
            tokens = ids if ids is not None else kwargs["inputs_embeds"]
            cache.begin_forward(tokens.shape[0], tokens.shape[1], tokens.device, kwargs.get("attention_mask"),
                                kwargs.get("position_ids"))

    def model_post(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        cache = forward_cache(kwargs)
        if isinstance(cache, host):
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
