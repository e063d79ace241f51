"""Scoring helpers shared by the policies: observation windows, attention of observed queries over
the cache, reductions over queries and GQA groups, and 1-D pooling along the cache.

All functions work on a subset of the batch (``rows``) and return float32 tensors; none of them
knows a particular policy.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ..cache import LayerKVCache
from .base import PolicyConfigError


def ring_queries(cache: LayerKVCache, rows: Tensor, lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Pre-RoPE queries of the cache's ring whose positions lie in ``(lo, hi]``.

    Args:
        cache: A layer cache with a query ring.
        rows: ``(b,)`` batch indices.
        lo: ``(b,)`` exclusive lower position bound.
        hi: ``(b,)`` inclusive upper position bound.

    Returns:
        ``(queries (b, heads, R, head_dim), positions (b, R), mask (b, R))``.
    """
    q = cache.queries[rows]
    qpos = cache.query_pos[rows]
    mask = (qpos >= 0) & (qpos > lo[:, None]) & (qpos <= hi[:, None])
    return q, qpos, mask


def last_queries(cache: LayerKVCache, rows: Tensor, t: Tensor, window: int) -> tuple[Tensor, Tensor, Tensor]:
    """The last ``window`` queries (positions ``t - window + 1 .. t``) from the ring; see :func:`ring_queries`."""
    return ring_queries(cache, rows, t - window, t)


def attention_probs(
    q_rot: Tensor,
    q_mask: Tensor,
    keys: Tensor,
    key_mask: Tensor,
    scale: float,
    q_pos: Tensor | None = None,
    key_pos: Tensor | None = None,
) -> Tensor:
    """Softmax attention of observed (already rotated) queries over cached keys.

    Args:
        q_rot: ``(b, heads, n, head_dim)`` queries, rotated to the positions they observe from.
        q_mask: ``(b, n)`` which queries exist.
        keys: ``(b, kv_heads, C, head_dim)`` cached keys (post-RoPE).
        key_mask: ``(b, kv_heads, C)`` keys the softmax runs over.
        scale: Logit scale, ``1 / sqrt(head_dim)``.
        q_pos: ``(b, n)`` query positions for causal masking (a query sees keys at positions <= its
            own); None: no causal mask.
        key_pos: ``(b, kv_heads, C)`` key positions (needed with ``q_pos``).

    Returns:
        ``(b, kv_heads, group, n, C)`` float32 weights; rows of missing queries are all zero.
    """
    b, H, n, D = q_rot.shape
    Hkv = keys.shape[1]
    qg = q_rot.float().view(b, Hkv, H // Hkv, n, D)  # (b, kv_heads, group, n, head_dim)
    logits = torch.einsum("bkgnd,bkcd->bkgnc", qg, keys.float()) * scale
    mask = key_mask[:, :, None, None, :]  # (b, kv_heads, 1, 1, C)
    if q_pos is not None:
        assert key_pos is not None
        mask = mask & (key_pos[:, :, None, None, :] <= q_pos[:, None, None, :, None])
    logits = logits.masked_fill(~mask, -math.inf)
    w = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # a query with no visible key -> zeros
    return w * q_mask[:, None, None, :, None]


def reduce_queries(weights: Tensor, q_mask: Tensor, how: str, temperature: float = 1.0) -> Tensor:
    """Reduces ``(b, kv_heads, group, n, C)`` over the query axis ``n`` -> ``(b, kv_heads, group, C)``.

    Args:
        weights: Attention weights (zero rows for missing queries).
        q_mask: ``(b, n)`` which queries exist.
        how: ``"max"``, ``"mean"``, ``"sum"`` or ``"logsumexp"`` (a smooth max with ``temperature``).
        temperature: Temperature of ``logsumexp``.
    """
    m = q_mask[:, None, None, :, None]
    if how == "max":
        return weights.masked_fill(~m, -math.inf).amax(3).clamp(min=0.0)
    if how == "sum":
        return weights.sum(3)
    if how == "mean":
        return weights.sum(3) / q_mask.sum(-1).clamp(min=1)[:, None, None, None]
    if how == "logsumexp":
        z = (weights / temperature).masked_fill(~m, -math.inf)
        return (temperature * torch.logsumexp(z, dim=3)).nan_to_num(0.0, neginf=0.0)
    raise ValueError(f"aggregation={how!r} is unknown; use max, mean, sum or logsumexp.")


def reduce_group(scores: Tensor, how: str, temperature: float = 1.0) -> Tensor:
    """Reduces ``(b, kv_heads, group, C)`` over the GQA group -> ``(b, kv_heads, C)``.

    Args:
        scores: Per-query-head scores.
        how: ``"max"``, ``"mean"``, ``"sum"`` or ``"logsumexp"``.
        temperature: Temperature of ``logsumexp``.
    """
    if how == "max":
        return scores.amax(2)
    if how == "mean":
        return scores.mean(2)
    if how == "sum":
        return scores.sum(2)
    if how == "logsumexp":
        return temperature * torch.logsumexp(scores / temperature, dim=2)
    raise ValueError(f"aggregation={how!r} is unknown; use max, mean, sum or logsumexp.")


def pool_slots(scores: Tensor, kernel: int, mode: str = "avg") -> Tensor:
    """1-D pooling along the cache axis with stride 1 and same-length output (SnapKV-style smoothing).

    Args:
        scores: ``(b, kv_heads, C)``.
        kernel: Odd window size (1 = identity).
        mode: ``"avg"`` or ``"max"``.
    """
    if kernel <= 1:
        return scores
    b, h, C = scores.shape
    x = scores.reshape(b * h, 1, C)
    if mode == "avg":
        y = F.avg_pool1d(x, kernel, stride=1, padding=kernel // 2, count_include_pad=False)
    elif mode == "max":
        y = F.max_pool1d(x, kernel, stride=1, padding=kernel // 2)
    else:
        raise ValueError(f"pool mode={mode!r} is unknown; use avg or max.")
    return y[..., :C].reshape(b, h, C)


def check_window_kernel(window: int, kernel: int) -> None:
    """Validates an observation window (``>= 1`` queries) and an odd pooling kernel (``>= 1``).

    Raises:
        PolicyConfigError: ``window < 1``, or ``kernel`` even or ``< 1``.
    """
    if window < 1:
        raise PolicyConfigError(f"window={window} must be >= 1 (the number of recent queries that score).")
    if kernel < 1 or kernel % 2 == 0:
        raise PolicyConfigError(f"kernel={kernel} must be an odd integer >= 1 (1 = no pooling).")
