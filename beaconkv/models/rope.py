"""Rotary position embedding (RoPE), rotate-half convention, with the scaled variants of HF configs.

One module, :class:`RotaryEmbedding`, owns the inverse frequencies and applies the rotation at any
absolute positions. It is injected into every attention layer *and* handed to eviction policies,
which use it to re-rotate stored pre-RoPE queries to the positions they want to score at.

Frequency variants: ``default``, ``linear`` (positions divided by ``factor``), ``llama3`` (Llama
3.1/3.2 band-wise scaling) and ``yarn`` (as Qwen3 configs use it, with its attention factor applied
to cos/sin). cos/sin are computed on the fly in float32 from the positions, so no table bounded by
``max_position_embeddings`` is kept in memory. The rotation itself, ``rotate_half``, is
:mod:`beaconkv.rotary`'s (imported here, so ``beaconkv.models.rope.rotate_half`` still works).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..rotary import rotate_half
from .config import RopeConfig, UnsupportedModelError


def rope_inverse_frequencies(rope: RopeConfig, head_dim: int) -> tuple[Tensor, float]:
    """Computes RoPE inverse frequencies and the cos/sin scale for a rotary configuration.

    Args:
        rope: The rotary settings.
        head_dim: Width of a head; frequencies cover ``head_dim // 2`` pairs.

    Returns:
        ``(inv_freq, attention_scaling)``: a float32 tensor of shape ``(head_dim // 2,)`` and the factor
        cos and sin are multiplied by (1.0 except for YaRN).

    Raises:
        UnsupportedModelError: A parameter the rope type needs is missing.
    """
    dim = head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (rope.theta**exponents)
    p = rope.params
    if rope.rope_type == "default":
        return inv_freq, 1.0
    if rope.rope_type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.rope_type == "llama3":
        try:
            low, high = float(p["low_freq_factor"]), float(p["high_freq_factor"])
            old_ctx = float(p["original_max_position_embeddings"])
        except KeyError as err:
            raise UnsupportedModelError(f"llama3 rope scaling needs {err.args[0]!r} in rope_scaling") from None
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / rope.factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return torch.where(medium, smoothed, scaled), 1.0
    if rope.rope_type == "yarn":
        return _yarn(rope, dim)
    raise UnsupportedModelError(f"rope_type={rope.rope_type!r} is unknown; use default, linear, llama3 or yarn.")


def _yarn(rope: RopeConfig, dim: int) -> tuple[Tensor, float]:
    """YaRN: blend interpolated and extrapolated frequencies over a ramp of dimensions."""
    p, factor, base = rope.params, rope.factor, rope.theta
    if "original_max_position_embeddings" not in p:
        raise UnsupportedModelError("yarn rope scaling needs 'original_max_position_embeddings' in rope_scaling")
    orig = float(p["original_max_position_embeddings"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention_factor = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast = p.get("beta_fast") or 32
    beta_slow = p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Applies RoPE at arbitrary absolute positions.

    Args:
        head_dim: Width of a head (even).
        rope: Rotary settings (theta, type, scaling parameters).

    Example:
        >>> rope = RotaryEmbedding(64, RopeConfig(theta=1e5))
        >>> q = torch.randn(1, 9, 5, 64)                 # (batch, heads, seq, head_dim)
        >>> pos = torch.arange(5)[None]                   # (batch, seq)
        >>> rope.rotate(q, pos).shape
        torch.Size([1, 9, 5, 64])
    """

    def __init__(self, head_dim: int, rope: RopeConfig | None = None) -> None:
        super().__init__()
        if head_dim % 2:
            raise UnsupportedModelError(f"head_dim={head_dim} must be even for rotary embeddings.")
        self.head_dim = head_dim
        self.config = rope or RopeConfig()
        inv_freq, scaling = rope_inverse_frequencies(self.config, head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_scaling = scaling

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Returns float32 ``cos, sin`` of shape ``positions.shape + (head_dim,)``."""
        freqs = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq.to(torch.float32)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling

    @staticmethod
    def apply(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Rotates ``x`` with precomputed ``cos``/``sin`` (broadcastable to ``x``), in ``x``'s dtype."""
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        return x * cos + rotate_half(x) * sin

    def rotate(self, x: Tensor, positions: Tensor) -> Tensor:
        """Rotates ``x`` of shape ``(batch, heads, seq, head_dim)`` to ``positions`` of shape ``(batch, seq)``.

        ``positions`` may also be ``(batch, heads, seq)`` to rotate every head to its own positions.
        """
        cos, sin = self.cos_sin(positions)
        if positions.dim() == 2:
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return self.apply(x, cos, sin)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.config.theta}, type={self.config.rope_type}"
