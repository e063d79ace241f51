"""The attention ↔ observer contract: what an attention layer hands to whoever observes it.

An eviction policy decides from what the model does: the pre-RoPE queries of the prompt and of every
decode step (BeaconKV, SnapKV, RPC, R-KV), the decode attention weights (H2O). None of that is the
cache's business — the cache (:mod:`beaconkv.cache`) only stores keys and values. Attention calls the
layer's observer explicitly, right after its cache call, and the observer belongs to whoever watches:
a policy (:class:`~beaconkv.policies.observer.ObservedLayer`, created with the policy's state), a
measurement that records the weights, or a stack of them (:class:`~beaconkv.measure.fidelity.cache_stack.CacheStack`).

The calls, made by :class:`~beaconkv.models.attention.Attention` (a replacement attention makes the
same ones):

1. prefill: :meth:`LayerObserver.prefill` with the prompt's pre-RoPE queries, after the cache's
   ``write_prefill`` (and :meth:`ChunkedLayerObserver.chunk` for each chunk that continues it, after the
   cache's ``write_chunk``);
2. decode: the cache's ``attend`` computes weights only when :attr:`LayerObserver.needs_weights`; then
   :meth:`LayerObserver.decode` with the step's pre-RoPE query, positions and those weights.

Calls flow downward: the model hands each layer its observer; nothing installs callbacks on a cache.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import Tensor


@runtime_checkable
class LayerObserver(Protocol):
    """What an attention layer tells its observer (see the module docstring).

    Attributes:
        needs_weights: Whether :meth:`decode` needs the decode attention weights (the cache's ``attend``
            then computes them; otherwise it may run a fused kernel and :meth:`decode` gets None).
    """

    needs_weights: bool

    def prefill(self, q_pre: Tensor, positions: Tensor, valid: Tensor) -> None:
        """Sees right-padded prompts: pre-RoPE queries ``(b, heads, L, head_dim)`` (after Qwen3's
        ``q_norm``), positions ``(b, L)`` and ``valid`` ``(b, L)`` (False on padding)."""

    def decode(self, q_pre: Tensor, positions: Tensor, weights: Tensor | None) -> None:
        """Sees one decode step, after the cache's ``append`` and ``attend``: the pre-RoPE query
        ``(batch, heads, 1, head_dim)``, positions ``(batch,)`` and the attention weights
        ``(batch, kv_heads, group, capacity)`` (None unless :attr:`needs_weights`). Inside the decode
        step: device ops only, static shapes, no host reads."""


@runtime_checkable
class ChunkedLayerObserver(LayerObserver, Protocol):
    """A :class:`LayerObserver` that also sees chunks (what a ``chunk=True`` forward calls; see
    :class:`~beaconkv.cache.ChunkedLayerCache`)."""

    def chunk(self, q_pre: Tensor, positions: Tensor, valid: Tensor) -> None:
        """Sees a chunk that continues what the cache holds (a prompt prefilled in chunks, a question on a
        compressed context): pre-RoPE queries ``(b, heads, L, head_dim)``, positions ``(b, L)`` and
        ``valid`` ``(b, L)``, after the cache's ``write_chunk``."""


@runtime_checkable
class ModelObserver(Protocol):
    """What the decoder takes to observe a model: one :class:`LayerObserver` (or None) per decoder layer."""

    def __getitem__(self, i: int) -> LayerObserver | None:
        """The observer of decoder layer ``i`` (None: nobody observes it)."""

    def __len__(self) -> int:
        """The number of layers."""
