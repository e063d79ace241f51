"""Int8 KV storage: one int8 per element and one float16 scale per (token, KV head).

Symmetric per-token quantisation: ``scale = max|x| / 127`` over the head dimension of one token's
key (or value) in one KV head, ``x ≈ round(x / scale) * scale``. Keys are quantised **after** RoPE,
as the attention hands them over, so stored keys are never re-rotated. Memory per token and KV head:
``2 * (head_dim + 2)`` bytes against ``2 * 2 * head_dim`` in bf16 (head_dim 64: 1.88x smaller) and
``2 * 4 * head_dim`` in float32 (3.8x).

Attention folds the scales in instead of dequantising the cache: ``logit_j = scale_j * (q · k_j)``
and ``out = Σ_j (w_j * vscale_j) * v_j``; the int8 tensors are cast on the fly, which a compiled step
fuses into the reductions.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..inplace import scatter_
from .base import KVStorage, gather_slots, put_front, token_index

#: Largest quantised magnitude (symmetric range, -128 unused).
QMAX = 127
#: Dtype of the per-token scales.
SCALE_DTYPE = torch.float16


def quantize(x: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric int8 quantisation of the last axis: ``(q int8 (..., D), scale float16 (...))``.

    The scale is rounded *up* to float16 first (never below ``amax / 127``, so the largest entry is
    not clipped — which matters where float16 is coarse: small, subnormal scales) and the division
    uses the rounded scale, so that ``q * scale`` is within half a step of ``x`` with the stored
    scale. An all-zero vector gets scale 0.
    """
    amax = x.detach().abs().amax(-1).float()
    exact = amax / QMAX
    scale = exact.to(SCALE_DTYPE)
    scale = torch.where(scale.float() < exact, torch.nextafter(scale, torch.full_like(scale, math.inf)), scale)
    inv = torch.where(scale > 0, 1.0 / scale.float().clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    q = torch.round(x.float() * inv[..., None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize(q: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """``q * scale`` in ``dtype`` (the inverse of :func:`quantize`, up to rounding)."""
    return (q.float() * scale.float()[..., None]).to(dtype)


class Int8KV(KVStorage):
    """Keys and values as int8 with per-token, per-KV-head float16 scales (see the module docstring).

    Args:
        batch: Sequences.
        n_kv_heads: Key/value heads.
        capacity: Slots per (sequence, KV head).
        head_dim: Width of a head.
        dtype: The compute dtype (what reads and attention return).
        device: Where the buffers live.
    """

    kind = "int8"

    def __init__(self, batch: int, n_kv_heads: int, capacity: int, head_dim: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        super().__init__(batch, n_kv_heads, capacity, head_dim, dtype, device)
        shape = (batch, n_kv_heads, capacity, head_dim)
        for name in ("k", "v"):
            self.register_buffer(f"{name}_q", torch.zeros(shape, dtype=torch.int8, device=device), persistent=False)
            self.register_buffer(f"{name}_scale", torch.zeros(shape[:3], dtype=SCALE_DTYPE, device=device),
                                 persistent=False)

    def write(self, rows: Tensor, slots: Tensor, k: Tensor, v: Tensor) -> None:
        index = token_index(rows, slots, self.n_kv_heads)
        for name, x in (("k", k), ("v", v)):
            q, scale = quantize(x)
            getattr(self, f"{name}_q")[index] = q
            getattr(self, f"{name}_scale")[index] = scale

    def append(self, slot: Tensor, k: Tensor, v: Tensor) -> None:
        B, H, _, D = k.shape
        idx = slot.view(B, 1, 1)
        for name, x in (("k", k), ("v", v)):
            q, scale = quantize(x)  # (B, H, 1, D), (B, H, 1)
            scatter_(getattr(self, f"{name}_q"), 2, idx[..., None].expand(B, H, 1, D), q)
            scatter_(getattr(self, f"{name}_scale"), 2, idx.expand(B, H, 1), scale)

    def _read(self, name: str, rows: Tensor | None) -> Tensor:
        q, scale = getattr(self, f"{name}_q"), getattr(self, f"{name}_scale")
        if rows is not None:
            q, scale = q[rows], scale[rows]
        return dequantize(q, scale, self.dtype)

    def keys(self, rows: Tensor | None = None) -> Tensor:
        return self._read("k", rows)

    def values(self, rows: Tensor | None = None) -> Tensor:
        return self._read("v", rows)

    def attend(self, q: Tensor, mask: Tensor, scale: float, need_weights: bool = False) -> tuple[Tensor, Tensor | None]:
        # logits (batch, kv_heads, group, capacity): the key scales multiply whole columns
        dots = torch.matmul(q.float(), self.k_q.float().transpose(-1, -2))
        logits = dots * (self.k_scale.float()[:, :, None, :] * scale)
        weights = logits.masked_fill(~mask, -math.inf).softmax(-1)
        # the value scales multiply whole rows of V: fold them into the weights
        out = torch.matmul(weights * self.v_scale.float()[:, :, None, :], self.v_q.float())
        return out.to(q.dtype), (weights if need_weights else None)

    def compact(self, rows: Tensor, keep: Tensor) -> None:
        for buf in (self.k_q, self.v_q, self.k_scale, self.v_scale):
            put_front(buf, rows, gather_slots(buf, rows, keep))
