"""Which transformers decoders a :class:`~beaconkv.hf.PolicyCache` serves, checked from their structure before
anything decodes.

A policy bounds a layer by evicting slots of **per-head keys and values** ``(batch, kv_heads, tokens, head_dim)``,
the keys stored post-RoPE, and re-rotates stored queries with the model's rotary module. A decoder whose layers
cache something else cannot be bounded that way; a ``PolicyCache`` (and so ``--backend hf`` of ``generate``,
``eval`` and ``fidelity``) refuses it when it is made, in one line that names the architecture, what its layers
cache instead, and what is supported:

* **recurrent layers**: linear attention, state-space or convolution mixers (Qwen3-Next, Qwen3.5, Jamba,
  Falcon-H1...), read off the layer types transformers builds its own cache from: a type whose cache layer is a
  ``LinearAttentionCacheLayerMixin`` keeps a recurrent state, not per-token keys and values;
* **a latent KV cache**: multi-head latent attention (DeepSeek-V2/V3, Kimi K2...), whose config sets
  ``kv_lora_rank``: every layer caches one compressed latent shared by all heads;
* **shared keys and values**: layers that attend over keys and values another layer cached (Gemma 3n,
  Gemma 4), which the policy's store would not hand them;
* **other cache layers** transformers builds for a layer type (an indexer's keys beside the keys and values,
  compressed attention...), and a decoder with **no rotary module**.

Those are what the configs say. Beyond them :func:`check_model` asks every full-attention layer what it caches:
it runs the layer's attention module on a few zero tokens with a cache whose ``update`` records the keys and
values it is handed and stops the forward there (no attention is computed), and compares them with per-head
keys and values. A future latent-KV or hybrid model whose config fields are new is refused too. A forward the
probe cannot call (an attention module wanting arguments beyond transformers' usual ones) proves nothing
either way; the cache's own check of every write (:meth:`~beaconkv.hf.PolicyCache.write`) still refuses such a
model in one line, at its prefill.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any, NoReturn

import torch
from torch import nn
from transformers.cache_utils import (DYNAMIC_LAYER_TYPE_MAPPING, DynamicCache, LinearAttentionCacheLayerMixin,
                                      get_layer_types_and_kwargs)

from ..errors import BeaconKVError
from .errors import UnsupportedArchitectureError
from .hooks import decoder_layers
from .rotary import HFRotary

#: What a PolicyCache serves, as every refusal says it.
SUPPORTED = ("A PolicyCache serves decoders whose full-attention layers cache per-head keys and values with RoPE "
             "(Llama, Qwen2, Qwen3, Qwen3-MoE, Mistral, Gemma 3, gpt-oss, Phi-3, OLMo 2, ...)")
#: What still runs a refused model, as every refusal says it.
ALTERNATIVE = "transformers' own cache (DynamicCache) runs this model without eviction"
#: Layer types whose layers cache per-head keys and values: the policy bounds the full ones, transformers'
#: own layer the windowed ones.
PER_HEAD_KV = ("full_attention", "sliding_attention", "chunked_attention")
#: Tokens the probe runs through each attention module (three: not to be mistaken for a head count of 1 or 2).
PROBE_TOKENS = 3

_CHECKED = "_beaconkv_architecture_checked"


def architecture_name(model_or_config: Any) -> str:
    """How a refusal names a model: its class (or the config's ``architectures``) and its ``model_type``.

    Args:
        model_or_config: A transformers model, or its config.
    """
    config = getattr(model_or_config, "config", model_or_config)
    model_type = getattr(config, "model_type", None)
    if isinstance(model_or_config, nn.Module):
        name = type(model_or_config).__name__
    else:
        name = (getattr(config, "architectures", None) or [None])[0] or type(config).__name__
    return f"{name} (model_type {model_type!r})" if model_type else name


def head_dim(config: Any) -> int:
    """The width of a key (and value) head a PolicyCache stores: ``head_dim``, else hidden size / heads.

    Args:
        config: The decoder's text config.
    """
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def check_config(config: Any, name: str | None = None) -> None:
    """Refuses, from its config alone (before any weight loads), a decoder a PolicyCache cannot serve: recurrent
    layers, a latent KV cache, shared keys and values, other cache layers, or no full-attention layer.

    Args:
        config: A transformers model config (its text config is read).
        name: How to name the model (default: :func:`architecture_name` of the config).

    Raises:
        UnsupportedArchitectureError: One of those, named with the layers concerned.
    """
    text = config.get_text_config(decoder=True)
    name = name or architecture_name(config)
    layer_types, _ = get_layer_types_and_kwargs(text)
    n = len(layer_types)
    recurrent: dict[str, list[int]] = {}
    other: dict[str, list[int]] = {}
    for i, kind in enumerate(layer_types):
        cls = DYNAMIC_LAYER_TYPE_MAPPING.get(kind)
        if cls is not None and issubclass(cls, LinearAttentionCacheLayerMixin):
            recurrent.setdefault(kind, []).append(i)
        elif kind not in PER_HEAD_KV and kind != "dummy":
            other.setdefault(kind, []).append(i)
    if recurrent:
        kinds = " and ".join(f"{_layers_are(idx, n)} of type {kind!r}" for kind, idx in recurrent.items())
        _refuse(name, f"it is a linear-attention (recurrent) hybrid: {kinds}, whose cache holds a recurrent state, "
                      "not only per-token keys and values a policy can evict")
    shared = _shared_layers(text, n)
    if shared:
        _refuse(name, f"{_layers_are(shared, n)} fed keys and values another layer cached (KV sharing), which the "
                      "policy's store does not hand them")
    latent = getattr(text, "kv_lora_rank", None)
    if latent:
        _refuse(name, f"its attention is multi-head latent attention (kv_lora_rank={latent}): each layer caches one "
                      "compressed latent shared by every head, not per-head keys and values")
    if other:
        kinds = "; ".join(f"{_layers_are(idx, n)} of type {kind!r} ({_cache_class(kind)})"
                          for kind, idx in other.items())
        _refuse(name, f"{kinds}, not per-head keys and values alone")
    if "full_attention" not in layer_types:
        _refuse(name, f"it has no full-attention layer (layer types {sorted(set(layer_types))}), so a policy has "
                      "nothing to bound")


def check_model(model: nn.Module) -> None:
    """Refuses a decoder a PolicyCache cannot serve: :func:`check_config`, then its modules: a rotary module, a
    ``self_attn`` in every layer, and per-head keys and values written by every full-attention layer (the probe
    of the module docstring). Passes once per model (later calls return at once).

    Args:
        model: A transformers causal LM.

    Raises:
        UnsupportedArchitectureError: What is unsupported, naming the architecture and the layer.
        RotaryLayoutError: Rotary tables of a layout the integration cannot apply.
    """
    if getattr(model, _CHECKED, False):
        return
    name = architecture_name(model)
    check_config(model.config, name)
    config = model.config.get_text_config(decoder=True)
    decoder = model.get_decoder()
    rotary = getattr(decoder, "rotary_emb", None)
    if rotary is None:
        _refuse(name, f"its decoder ({type(decoder).__name__}) has no rotary module (rotary_emb), and the policies "
                      "re-rotate stored queries with the model's RoPE")
    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        if not isinstance(getattr(layer, "self_attn", None), nn.Module):
            parts = ", ".join(child for child, _ in layer.named_children())
            _refuse(name, f"layer {i} ({type(layer).__name__}) has no self_attn attention module (its modules: "
                          f"{parts}), so it caches no per-head keys and values")
    layer_types, _ = get_layer_types_and_kwargs(config)
    D, kv_heads = head_dim(config), config.num_key_value_heads
    rope = HFRotary(rotary, D)
    want = (1, kv_heads, PROBE_TOKENS, D)
    for i, kind in enumerate(layer_types):
        if kind != "full_attention":
            continue
        attention = layers[i].self_attn
        written = _first_write(attention, rope, config.hidden_size)
        if written is _UNKNOWN:
            continue
        what = f"layer {i} ({type(attention).__name__})"
        if written is None:
            _refuse(name, f"{what} writes no keys and values to its cache")
        keys, values = written
        if keys != want or values != want:
            latent = (" (one tensor shared by every head: a latent KV cache, as multi-head latent attention keeps)"
                      if keys[1] == 1 and kv_heads > 1 else "")
            _refuse(name, f"{what} caches keys {keys} and values {values} for {PROBE_TOKENS} tokens{latent}, where "
                          f"per-head keys and values are (1, num_key_value_heads={kv_heads}, {PROBE_TOKENS}, "
                          f"head_dim={D}) each")
    setattr(model, _CHECKED, True)


# ------------------------------------------------------------------------------------------- internals
class _Written(BeaconKVError):
    """Ends a probe's forward at its first cache write, carrying the shapes written."""

    def __init__(self, keys: tuple[int, ...], values: tuple[int, ...]) -> None:
        super().__init__(keys, values)
        self.keys, self.values = keys, values


class _FirstWrite(DynamicCache):
    """A cache whose first ``update`` stops the forward: the probe wants only what a layer writes."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> NoReturn:
        raise _Written(tuple(key_states.shape), tuple(value_states.shape))


_UNKNOWN = object()


def _first_write(attention: nn.Module, rope: HFRotary, hidden_size: int) -> Any:
    """``(keys shape, values shape)`` the attention module writes for :data:`PROBE_TOKENS` zero tokens at
    positions ``0, 1, ...``; None if it writes nothing; ``_UNKNOWN`` if its forward cannot be called so."""
    param = next(attention.parameters(), None)
    dtype, device = (param.dtype, param.device) if param is not None else (torch.float32, torch.device("cpu"))
    x = torch.zeros(1, PROBE_TOKENS, hidden_size, dtype=dtype, device=device)
    positions = torch.arange(PROBE_TOKENS, device=device)[None]
    cache_arg = "cache" if "cache" in inspect.signature(attention.forward).parameters else "past_key_values"
    try:
        with torch.no_grad():
            cos, sin = rope.cos_sin(x, positions)
            attention(hidden_states=x, position_embeddings=(cos, sin), attention_mask=None,
                      **{cache_arg: _FirstWrite()})
    except _Written as written:
        return written.keys, written.values
    except Exception:  # noqa: BLE001 - a forward wanting more than the probe gives: the write check decides
        return _UNKNOWN
    return None


def _shared_layers(config: Any, n: int) -> list[int]:
    """Layers that reuse keys and values another layer cached: ``kv_sharing_modes`` ``"reuse"`` (Gemma 4), or
    the last ``num_kv_shared_layers`` (Gemma 3n)."""
    modes = getattr(config, "kv_sharing_modes", None)
    if modes:
        return [i for i, mode in enumerate(modes) if mode == "reuse"]
    shared = getattr(config, "num_kv_shared_layers", None) or 0
    return list(range(n - shared, n)) if isinstance(shared, int) and shared > 0 else []


def _cache_class(kind: str) -> str:
    """What transformers caches a layer type in, for a message."""
    cls = DYNAMIC_LAYER_TYPE_MAPPING.get(kind)
    return f"transformers caches them in {cls.__name__}" if cls is not None else "a type transformers' cache lacks"


def _layers_are(indices: Sequence[int], n: int) -> str:
    """``"layer 3 of 4 is"``, ``"layers 0, 1, 2 of 4 are"`` or ``"36 of 48 layers (0, 1, 2, 4, 5, 6, ...) are"``."""
    if len(indices) == 1:
        return f"layer {indices[0]} of {n} is"
    shown = ", ".join(map(str, indices[:6]))
    if len(indices) <= 6:
        return f"layers {shown} of {n} are"
    return f"{len(indices)} of {n} layers ({shown}, ...) are"


def _refuse(name: str, problem: str) -> NoReturn:
    raise UnsupportedArchitectureError(f"{name} is not supported by a PolicyCache: {problem}. {SUPPORTED}; "
                                       f"{ALTERNATIVE}.")
