"""The shared keep mechanism: which slots survive an eviction, given a policy's scores."""

from __future__ import annotations

import math

import torch
from torch import Tensor


#: The rank key of an empty slot (below any filled slot's, whatever its score).
EMPTY = torch.finfo(torch.float32).min


def ranking_key(scores: Tensor, pos: Tensor, n_prefix: Tensor, t: Tensor, n_recent: int) -> Tensor:
    """The key slots are ranked by: the scores, ``+inf`` on the protected prefix and ``n_recent`` newest
    positions, :data:`EMPTY` on empty slots (a NaN or ``-inf`` score ranks just above empty).

    Args:
        scores: ``(b, kv_heads, C)`` higher = keep.
        pos: ``(b, kv_heads, C)`` slot positions (``-1`` empty).
        n_prefix: ``(b,)`` protected prefix length per sequence.
        t: ``(b,)`` position of the newest token.
        n_recent: The last ``n_recent`` positions are protected.

    Returns:
        ``(b, kv_heads, C)`` float32.
    """
    filled = pos >= 0
    protected = filled & ((pos < n_prefix[:, None, None]) | (pos > (t - n_recent)[:, None, None]))
    key = torch.where(protected, math.inf, scores.float())
    key = torch.where(filled, key, -math.inf)
    return torch.nan_to_num(key, nan=-1e30, posinf=math.inf, neginf=EMPTY)


def select_keep(
    scores: Tensor,
    pos: Tensor,
    n_prefix: Tensor,
    t: Tensor,
    n_recent: int,
    keep_total: Tensor,
    keep_max: int | None = None,
    key: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Chooses the slots to keep: prefix and recent tokens, then the best-scored, in position order.

    Args:
        scores: ``(b, kv_heads, C)`` higher = keep; may be ``+inf`` to force a keep.
        pos: ``(b, kv_heads, C)`` slot positions (``-1`` empty).
        n_prefix: ``(b,)`` protected prefix length per sequence.
        t: ``(b,)`` position of the newest token.
        n_recent: The last ``n_recent`` positions are always kept.
        keep_total: ``(b,)`` slots to keep per sequence (every KV head alike), or ``(b, kv_heads)`` per
            head (a head-adaptive allocation, :mod:`beaconkv.policies.allocation`).
        keep_max: ``max(keep_total)`` when the caller knows it on the host; None reads it from the
            device (a sync and a data-dependent shape — always pass it inside compiled code).
        key: :func:`ranking_key` of these arguments when the caller already made it (a head-adaptive
            allocation ranks with it first); None makes it here.

    Returns:
        ``(keep, keep_valid)``, both ``(b, kv_heads, K)`` with ``K = max(keep_total)``: slot indices
        sorted by position, and whether each entry is real (False entries come last, per head).

    Ties in score break toward the more recent position, so the choice does not depend on the
    capacity or on the other sequences of the batch.
    """
    filled = pos >= 0
    if key is None:
        key = ranking_key(scores, pos, n_prefix, t, n_recent)
    # stable sort: first newest-first by position, then by score descending
    by_pos = torch.argsort(pos, dim=-1, descending=True, stable=True)
    order = torch.gather(
        by_pos, -1, torch.argsort(torch.gather(key, -1, by_pos), dim=-1, descending=True, stable=True)
    )
    K = int(keep_total.max()) if keep_max is None else keep_max
    top = order[..., :K]
    ranks = torch.arange(K, device=pos.device)
    per_head = keep_total if keep_total.dim() == 2 else keep_total[:, None]
    valid = (ranks[None, None, :] < per_head[:, :, None]) & torch.gather(filled, -1, top)
    top_pos = torch.where(valid, torch.gather(pos, -1, top), torch.iinfo(torch.long).max)
    resort = torch.argsort(top_pos, dim=-1, stable=True)
    return torch.gather(top, -1, resort), torch.gather(valid, -1, resort)
