"""The attention function a :class:`~beaconkv.hf.PolicyCache` runs through: transformers' attention registry.

transformers looks every layer's attention function up by name (``config._attn_implementation``) in its
:class:`~transformers.AttentionInterface`; a name registered there is a supported way to run one's own
attention without touching a model's files. :func:`use_policy_attention` registers
``"beaconkv:<name>"`` next to the model's own implementation (``sdpa`` or ``eager``), with the same mask
function, and switches the model to it. The function delegates to the model's own implementation in every
call except those of a layer a :class:`~beaconkv.hf.PolicyCache` runs (a forward pre-hook of that layer's
attention hands it a :class:`PolicyTap`), so a model switched once computes exactly what it did before
with any other cache.

For a layer the policy runs:

* **prefill**: the model's own attention over the prompt (transformers' mask, left padding and all); then
  the policy's observer sees the prompt's pre-RoPE queries (the rotation undone with the layer's own
  ``(cos, sin)``);
* **chunk** (several tokens per row after the prefill, or a prompt cut into chunks): attention over the
  store, each query seeing the held slots at or before its position, and the observer sees the queries
  (:mod:`beaconkv.hf.chunk_forward`);
* **decode**: attention over the layer's fixed-capacity store, whose slots hold positions in any order of
  eviction, masked by the slots themselves (``position >= 0``) — transformers' mask describes logical
  positions and is ignored; then the observer sees the step's pre-RoPE query and, when the policy asks,
  the attention weights. gpt-oss's attention sinks (``s_aux``) and logit soft-capping (``softcap``) are
  applied as the model's eager attention applies them, in chunks as in decode steps.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import BeaconKVError

from .host import PolicyHost

PREFIX = "beaconkv:"
#: The implementations a PolicyCache can run next to (others fuse the mask away or page the cache).
SUPPORTED = ("sdpa", "eager")


class AttentionImplementationError(BeaconKVError, ValueError):
    """The model runs an attention implementation the policy cache cannot run beside."""


@dataclass
class PolicyTap:
    """What a policy layer's attention pre-hook hands the attention function (as the ``beaconkv_tap`` kwarg).

    Attributes:
        cache: The policy cache.
        index: The layer's index among the policy's layers.
        cos: The layer's rotary ``cos`` table ``(batch, seq, width)``.
        sin: Its ``sin`` table.
    """

    cache: PolicyHost
    index: int
    cos: Tensor
    sin: Tensor


def model_attention(module: nn.Module, base: str) -> Callable[..., tuple[Tensor, Tensor | None]]:
    """The model's own attention function for implementation ``base``: the registry's, or for ``eager`` the
    ``eager_attention_forward`` of the module's modeling file (gpt-oss's applies its sinks there)."""
    if base != "eager":
        from transformers import AttentionInterface

        return AttentionInterface()[base]
    own = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if own is None:
        from transformers.models.llama.modeling_llama import eager_attention_forward as own
    return own


def policy_attention(base: str) -> Callable[..., tuple[Tensor, Tensor | None]]:
    """The attention function registered as ``beaconkv:<base>`` (see the module docstring)."""

    def attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                  **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        tap: PolicyTap | None = kwargs.pop("beaconkv_tap", None)
        phase = None if tap is None else tap.cache.phase
        if phase not in ("chunk", "decode"):
            out = model_attention(module, base)(module, query, key, value, attention_mask, **kwargs)
            if tap is not None:
                tap.cache.observe_prefill(tap.index, query, tap.cos, tap.sin)
            return out
        scaling = kwargs.get("scaling")
        scaling = module.head_dim ** -0.5 if scaling is None else scaling
        attend = tap.cache.chunk_attention if phase == "chunk" else tap.cache.decode_attention
        out = attend(tap.index, query, tap.cos, tap.sin, scaling, sinks=kwargs.get("s_aux"),
                     softcap=kwargs.get("softcap"))
        return out, None

    attention.__name__ = attention.__qualname__ = f"beaconkv_{base}_attention"
    return attention


def use_policy_attention(model: nn.Module) -> str:
    """Switches ``model`` to ``beaconkv:<its implementation>`` (registered on first use); idempotent.

    Args:
        model: A transformers ``PreTrainedModel``.

    Returns:
        The implementation's name.

    Raises:
        AttentionImplementationError: The model runs neither ``sdpa`` nor ``eager`` attention.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    current = model.config._attn_implementation
    if current.startswith(PREFIX):
        return current
    if current not in SUPPORTED:
        raise AttentionImplementationError(
            f"the model runs attn_implementation={current!r}; a PolicyCache runs beside "
            f"{' or '.join(SUPPORTED)}: load it with attn_implementation='sdpa' or call "
            "model.set_attn_implementation('sdpa') first.")
    name = PREFIX + current
    AttentionInterface.register(name, policy_attention(current))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[current])
    model.set_attn_implementation(name)
    return name


def attend_with_sinks(q: Tensor, keys: Tensor, values: Tensor, filled: Tensor, scale: float,
                      sinks: Tensor | None, softcap: float | None) -> tuple[Tensor, Tensor]:
    """One decode step's attention over a store, as transformers' eager attention computes it with attention
    sinks (gpt-oss) and logit soft-capping.

    Args:
        q: ``(batch, kv_heads, group, head_dim)`` post-RoPE queries, the GQA group as the query axis.
        keys: ``(batch, kv_heads, capacity, head_dim)``.
        values: Same shape.
        filled: ``(batch, kv_heads, capacity)`` slots that hold a token.
        scale: Logit scale.
        sinks: ``(heads,)`` per-head sink logits (None: no sink).
        softcap: ``tanh`` soft-cap of the logits (None: none).

    Returns:
        ``(out (batch, kv_heads, group, head_dim), weights (batch, kv_heads, group, capacity))``; the sink's
        share of the softmax is in neither.
    """
    logits = torch.matmul(q, keys.transpose(-1, -2)) * scale  # (batch, kv_heads, group, capacity)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.masked_fill(~filled.unsqueeze(2), torch.finfo(logits.dtype).min)
    if sinks is not None:
        B, kv, g, _ = logits.shape
        sink = sinks.to(logits.dtype).view(1, kv, g, 1).expand(B, kv, g, 1)
        logits = torch.cat([logits, sink], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        weights = logits.softmax(-1)[..., :-1]
    else:
        weights = logits.softmax(-1)
    return torch.matmul(weights.to(values.dtype), values), weights
