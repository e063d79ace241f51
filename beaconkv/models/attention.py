"""Grouped-query self-attention with optional per-head q/k norms, over a fixed-capacity cache.

Three call modes share one module:

* plain causal forward (no cache) for full-sequence logits;
* prefill: the same attention over the prompt, then the keys (post-RoPE) and values are written to
  the layer's cache (:meth:`~beaconkv.cache.LayerKVCache.write_prefill`) and the pre-RoPE queries
  handed to the layer's observer (:meth:`~beaconkv.observation.LayerObserver.prefill`);
* chunk (``chunk=True``): several tokens per row after what the cache holds — a prompt prefilled in
  chunks, or a question on a compressed context: written after the row's filled slots
  (:meth:`~beaconkv.cache.LayerKVCache.write_chunk`), attended causally over every filled slot
  (:meth:`~beaconkv.cache.LayerKVCache.attend_chunk`), the pre-RoPE queries handed to the observer
  (:meth:`~beaconkv.observation.ChunkedLayerObserver.chunk`);
* decode: one token per sequence, appended to the cache in place
  (:meth:`~beaconkv.cache.LayerKVCache.append`), attention over every filled slot
  (:meth:`~beaconkv.cache.LayerKVCache.attend`, with its weights when the observer needs them), then
  the step's pre-RoPE query and weights to the observer (:meth:`~beaconkv.observation.LayerObserver.decode`);
  static shapes throughout.

That is the whole attention ↔ cache ↔ observer contract: a replacement attention that makes the same
calls keeps every eviction policy and every storage (dense, int8) working.

Qwen3 applies ``q_norm``/``k_norm`` per head *before* RoPE; the pre-RoPE query handed to the
observer is taken after ``q_norm``, so eviction policies see what the model rotates. The rotary
tables (``cos``, ``sin``) come from the decoder, computed once per forward for all layers.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..cache import LayerCache
from ..observation import LayerObserver
from .rope import RotaryEmbedding

#: ``(cos, sin)``, each ``(batch, seq, head_dim)`` float32: the rotary tables of one forward.
Rotary = tuple[Tensor, Tensor]


class Attention(nn.Module):
    """GQA attention wired from injected components (Hugging Face parameter names).

    Args:
        q_proj: ``hidden -> heads * head_dim`` projection.
        k_proj: ``hidden -> kv_heads * head_dim`` projection.
        v_proj: ``hidden -> kv_heads * head_dim`` projection.
        o_proj: ``heads * head_dim -> hidden`` projection.
        rope: The rotary module; its ``apply(x, cos, sin)`` rotates queries and keys.
        n_heads: Query heads.
        n_kv_heads: Key/value heads; divides ``n_heads``.
        head_dim: Width of a head.
        q_norm: Optional per-head norm of queries before RoPE (Qwen3).
        k_norm: Optional per-head norm of keys before RoPE (Qwen3).

    Attributes:
        scale: Logit scale, ``1 / sqrt(head_dim)``; a subclass may change it.
    """

    def __init__(
        self,
        q_proj: nn.Module,
        k_proj: nn.Module,
        v_proj: nn.Module,
        o_proj: nn.Module,
        rope: RotaryEmbedding,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        q_norm: nn.Module | None = None,
        k_norm: nn.Module | None = None,
    ) -> None:
        super().__init__()
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads={n_heads} is not a multiple of n_kv_heads={n_kv_heads}.")
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = q_proj, k_proj, v_proj, o_proj
        self.rope = rope
        self.q_norm, self.k_norm = q_norm, k_norm
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.scale = 1.0 / math.sqrt(head_dim)

    def project(self, x: Tensor, rotary: Rotary) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Projects ``x`` and rotates: ``(q_pre, q, k, v)``, heads first, ``(batch, heads, seq, head_dim)``.

        ``q_pre`` is the query after ``q_norm`` and before RoPE; ``q`` and ``k`` are rotated.
        """
        q, k, v = self._heads(self.q_proj(x)), self._heads(self.k_proj(x)), self._heads(self.v_proj(x))
        if self.q_norm is not None:
            q = self.q_norm(q)
        if self.k_norm is not None:
            k = self.k_norm(k)
        cos, sin = (t.unsqueeze(1) for t in rotary)  # (batch, 1, seq, head_dim): every head alike
        return q, self.rope.apply(q, cos, sin), self.rope.apply(k, cos, sin), v

    def forward(
        self,
        x: Tensor,
        positions: Tensor,
        rotary: Rotary,
        valid: Tensor | None = None,
        cache: LayerCache | None = None,
        decode: bool = False,
        observer: LayerObserver | None = None,
        chunk: bool = False,
    ) -> Tensor:
        """Attends ``x`` of shape ``(batch, seq, hidden)``.

        Args:
            x: Normalised hidden states.
            positions: ``(batch, seq)`` absolute positions.
            rotary: ``(cos, sin)`` at those positions (see :meth:`RotaryEmbedding.cos_sin`).
            valid: ``(batch, seq)`` bool, False on right padding (None: all valid).
            cache: The layer's cache (any :class:`~beaconkv.cache.LayerCache`); None for a plain forward.
            decode: ``seq == 1`` decode step against ``cache`` (else prefill/plain).
            observer: Who observes this layer (a policy; see :mod:`beaconkv.observation`); None: nobody.
            chunk: ``x`` continues what ``cache`` holds (a :class:`~beaconkv.cache.ChunkedLayerCache`):
                written after its slots and attended over all of them.

        Returns:
            ``(batch, seq, hidden)``.

        Raises:
            TypeError: ``chunk`` with a cache that takes no chunks.
        """
        B, L, _ = x.shape
        q_pre, q, k, v = self.project(x, rotary)
        if chunk:
            if not hasattr(cache, "write_chunk"):
                raise TypeError(f"a chunk needs a cache with write_chunk/attend_chunk (a ChunkedLayerCache); "
                                f"{type(cache).__name__} takes whole prompts only: prefill without prefill_chunk.")
            if valid is None:
                valid = torch.ones(B, L, dtype=torch.bool, device=x.device)
            cache.write_chunk(k, v, positions, valid)
            if observer is not None:
                observer.chunk(q_pre, positions, valid)
            out = cache.attend_chunk(q, positions, self.scale)
        elif decode:
            assert cache is not None, "decode needs a cache"
            cache.append(k, v, positions[:, 0])
            out, weights = cache.attend(q, self.scale, need_weights=observer is not None and observer.needs_weights)
            if observer is not None:
                observer.decode(q_pre, positions[:, 0], weights)
        else:
            if valid is None:
                valid = torch.ones(B, L, dtype=torch.bool, device=x.device)
            if cache is not None:
                cache.write_prefill(k, v, positions, valid)
            if observer is not None:
                observer.prefill(q_pre, positions, valid)
            causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
            mask = causal[None, None] & valid[:, None, None, :]  # (batch, 1, L, L)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=self.n_heads != self.n_kv_heads
            )
        return self.o_proj(out.transpose(1, 2).flatten(2))  # (batch, heads, seq, head_dim) -> (batch, seq, hidden)

    def _heads(self, t: Tensor) -> Tensor:
        """``(batch, seq, heads * head_dim) -> (batch, heads, seq, head_dim)``, as plain views: not einops,
        whose parsing and caches dynamo traces and guards on at every call of a compiled layer."""
        return t.unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
