"""Grouped-query self-attention with optional per-head q/k norms, over a fixed-capacity cache.

Three call modes share one module:

* plain causal forward (no cache) for full-sequence logits;
* prefill: the same attention over the prompt, then the keys (post-RoPE), values and pre-RoPE
  queries are written to the layer's :class:`~beaconkv.cache.LayerKVCache`;
* decode: one token per sequence, written into the cache in place, attending over every filled
  slot (validity mask), with static shapes.

Qwen3 applies ``q_norm``/``k_norm`` per head *before* RoPE; the pre-RoPE query handed to the
cache is taken after ``q_norm``, so eviction policies see what the model rotates.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..cache import LayerKVCache
from .rope import RotaryEmbedding


class Attention(nn.Module):
    """GQA attention wired from injected components (Hugging Face parameter names).

    Args:
        q_proj: ``hidden -> heads * head_dim`` projection.
        k_proj: ``hidden -> kv_heads * head_dim`` projection.
        v_proj: ``hidden -> kv_heads * head_dim`` projection.
        o_proj: ``heads * head_dim -> hidden`` projection.
        rope: The rotary module (shared with eviction policies).
        n_heads: Query heads.
        n_kv_heads: Key/value heads; divides ``n_heads``.
        head_dim: Width of a head.
        q_norm: Optional per-head norm of queries before RoPE (Qwen3).
        k_norm: Optional per-head norm of keys before RoPE (Qwen3).
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

    def _project(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Returns ``(q_pre, q, k, v)``, heads first: ``(batch, heads, seq, head_dim)``."""
        B, L, _ = x.shape
        q = self.q_proj(x).view(B, L, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, L, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, L, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q = self.q_norm(q)
        if self.k_norm is not None:
            k = self.k_norm(k)
        cos, sin = self.rope.cos_sin(positions)  # (batch, seq, head_dim)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return q, self.rope.apply(q, cos, sin), self.rope.apply(k, cos, sin), v

    def forward(
        self,
        x: Tensor,
        positions: Tensor,
        valid: Tensor | None = None,
        cache: LayerKVCache | None = None,
        decode: bool = False,
    ) -> Tensor:
        """Attends ``x`` of shape ``(batch, seq, hidden)``.

        Args:
            x: Normalised hidden states.
            positions: ``(batch, seq)`` absolute positions.
            valid: ``(batch, seq)`` bool, False on right padding (None: all valid).
            cache: The layer's cache; None for a plain forward.
            decode: ``seq == 1`` decode step against ``cache`` (else prefill/plain).

        Returns:
            ``(batch, seq, hidden)``.
        """
        B, L, _ = x.shape
        q_pre, q, k, v = self._project(x, positions)
        if decode:
            assert cache is not None, "decode needs a cache"
            out = self._decode(q, k, v, q_pre, positions[:, 0], cache)
        else:
            if valid is None:
                valid = torch.ones(B, L, dtype=torch.bool, device=x.device)
            if cache is not None:
                cache.write_prefill(k, v, q_pre, positions, valid)
            causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
            mask = causal[None, None] & valid[:, None, None, :]  # (batch, 1, L, L)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=self.n_heads != self.n_kv_heads
            )
        return self.o_proj(out.transpose(1, 2).reshape(B, L, self.n_heads * self.head_dim))

    def _decode(
        self, q: Tensor, k: Tensor, v: Tensor, q_pre: Tensor, positions: Tensor, cache: LayerKVCache
    ) -> Tensor:
        B = q.shape[0]
        G = self.n_heads // self.n_kv_heads
        keys, values, valid = cache.append(k, v, q_pre, positions)
        # the GQA group plays the role of the query length: no repeat of K/V needed
        qg = q.view(B, self.n_kv_heads, G, self.head_dim)  # (batch, kv_heads, group, head_dim)
        mask = valid.unsqueeze(2)  # (batch, kv_heads, 1, capacity)
        if cache.track_attention:
            logits = torch.matmul(qg, keys.transpose(-1, -2)).float() * self.scale
            weights = logits.masked_fill(~mask, float("-inf")).softmax(-1)  # (batch, kv_heads, group, capacity)
            cache.record_attention(weights)
            out = torch.matmul(weights.to(values.dtype), values)
        else:
            out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=self.scale)
        return out.reshape(B, self.n_heads, 1, self.head_dim)
