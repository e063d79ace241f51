"""Scoring helpers shared by the policies: observation windows, attention of observed queries over
the cache, reductions over queries and GQA groups, and 1-D pooling along the cache.

All functions work on a subset of the batch (``rows``) and return float32 tensors; none of them
knows a particular policy. Shapes: ``b`` rows, ``kv`` KV heads, ``g`` query heads per KV head (the
GQA group), ``n`` observed queries, ``c`` cache slots, ``d`` head width.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from .config import PolicyConfigError
from .observer import ObservedLayer


def last_queries(cache: ObservedLayer, rows: Tensor, t: Tensor, window: int) -> tuple[Tensor, Tensor, Tensor]:
    """The last ``window`` queries (positions ``t - window + 1 .. t``) from the layer's query ring.

    Returns:
        ``(queries (b, heads, R, head_dim), positions (b, R), mask (b, R))``; see
        :meth:`~beaconkv.policies.observer.ObservedLayer.ring`.
    """
    return cache.ring(rows, t - window, t)


def group_queries(q: Tensor, n_kv_heads: int) -> Tensor:
    """``(b, heads, n, d)`` -> ``(b, kv, g, n, d)``: each KV head's GQA group of query heads."""
    return rearrange(q, "b (kv g) n d -> b kv g n d", kv=n_kv_heads)


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
    qg = group_queries(q_rot.float(), keys.shape[1])
    logits = torch.einsum("bkgnd,bkcd->bkgnc", qg, keys.float()) * scale
    mask = rearrange(key_mask, "b kv c -> b kv 1 1 c")
    if q_pos is not None:
        assert key_pos is not None
        sees = rearrange(key_pos, "b kv c -> b kv 1 1 c") <= rearrange(q_pos, "b n -> b 1 1 n 1")  # causal
        mask = mask & sees
    logits = logits.masked_fill(~mask, -math.inf)
    w = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # a query with no visible key -> zeros
    return w * rearrange(q_mask, "b n -> b 1 1 n 1")


def reduce_queries(weights: Tensor, q_mask: Tensor, how: str, temperature: float = 1.0) -> Tensor:
    """Reduces ``(b, kv_heads, group, n, C)`` over the query axis ``n`` -> ``(b, kv_heads, group, C)``.

    Args:
        weights: Attention weights (zero rows for missing queries).
        q_mask: ``(b, n)`` which queries exist.
        how: ``"max"``, ``"mean"``, ``"sum"`` or ``"logsumexp"`` (a smooth max with ``temperature``).
        temperature: Temperature of ``logsumexp``.
    """
    m = rearrange(q_mask, "b n -> b 1 1 n 1")
    if how == "max":
        return weights.masked_fill(~m, -math.inf).amax(3).clamp(min=0.0)
    if how == "sum":
        return weights.sum(3)
    if how == "mean":
        return weights.sum(3) / q_mask.sum(-1).clamp(min=1)[:, None, None, None]
    if how == "logsumexp":
        z = (weights / temperature).masked_fill(~m, -math.inf)
        return (temperature * torch.logsumexp(z, dim=3)).nan_to_num(0.0, neginf=0.0)
    raise PolicyConfigError(f"aggregation={how!r} is unknown; use max, mean, sum or logsumexp.")


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
    raise PolicyConfigError(f"aggregation={how!r} is unknown; use max, mean, sum or logsumexp.")


def pool_slots(scores: Tensor, kernel: int, mode: str = "avg") -> Tensor:
    """1-D pooling along the cache axis with stride 1 and same-length output (SnapKV-style smoothing).

    Args:
        scores: ``(b, kv_heads, C)``.
        kernel: Odd window size (1 = identity).
        mode: ``"avg"`` or ``"max"``.
    """
    if kernel <= 1:
        return scores
    C = scores.shape[-1]
    x = rearrange(scores, "b kv c -> (b kv) 1 c")
    if mode == "avg":
        y = F.avg_pool1d(x, kernel, stride=1, padding=kernel // 2, count_include_pad=False)
    elif mode == "max":
        y = F.max_pool1d(x, kernel, stride=1, padding=kernel // 2)
    else:
        raise PolicyConfigError(f"pool mode={mode!r} is unknown; use avg or max.")
    return rearrange(y[..., :C], "(b kv) 1 c -> b kv c", b=scores.shape[0])


def merge_near_ties(scores: Tensor, rtol: float) -> Tensor:
    """Scores within rounding of each other made equal, so the keep rule's tie-break (the newer slot)
    decides between them rather than the last bit of a rounding.

    Two keys that are equal in exact arithmetic (the same token's pre-RoPE key at two positions) can get
    scores one rounding step apart, in an order that depends on the CPU's kernels. Per ``(b, kv)``, the
    scores are sorted; each one within ``rtol * max(|s|, 1)`` of the next higher one joins its group,
    and every member of a group takes the group's highest score. A run of scores each within the
    tolerance of the next is one group (the tolerance chains), which only matters for scores packed
    tighter than the tolerance, where the order is rounding anyway. NaN and infinite scores stay alone.

    Args:
        scores: ``(b, kv_heads, C)`` higher = keep.
        rtol: Relative tolerance (at least absolute for ``|s| < 1``); 0 returns ``scores`` unchanged.

    Returns:
        ``(b, kv_heads, C)`` float32.
    """
    if rtol == 0:
        return scores.float()
    s, order = scores.float().sort(dim=-1, descending=True)
    gap = s[..., :-1] - s[..., 1:]
    # a NaN or infinite gap (a NaN, an infinity) starts a group: NaN and infinities never absorb a number
    joins = (gap <= rtol * s[..., :-1].abs().clamp(min=1.0)) & gap.isfinite()
    starts = torch.cat([torch.ones_like(s[..., :1], dtype=torch.bool), ~joins], dim=-1)
    index = torch.arange(s.shape[-1], device=s.device)
    first = torch.where(starts, index, 0).cummax(dim=-1).values  # each slot's group head, in sorted order
    return torch.empty_like(s).scatter_(-1, order, s.gather(-1, first))
