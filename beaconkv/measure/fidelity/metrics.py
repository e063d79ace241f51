"""Per-step fidelity metrics: next-token KL, attention recall of held positions, global/local queries.

Each query — one (step, layer, query head) — is *global* when the mean distance ``t - position``
over its top-K attended keys exceeds a threshold (SPEC §1: K = 150, threshold 200), else *local*.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .errors import FidelityError


@dataclass(frozen=True)
class GlobalQueryRule:
    """SPEC §1: a query is *global* when the mean distance to its top-K attended keys exceeds a threshold.

    Attributes:
        top_k: K, attended keys averaged over (150 in the paper; fewer when fewer keys exist).
        threshold: Mean distance (tokens) above which a query is global (200 in the paper).
    """

    top_k: int = 150
    threshold: float = 200.0

    def __post_init__(self) -> None:
        if self.top_k < 1:
            raise FidelityError(f"top_k={self.top_k} must be >= 1 (paper: 150).")
        if not self.threshold >= 0:
            raise FidelityError(f"global threshold={self.threshold} must be >= 0 (paper: 200).")

    def distance(self, weights: Tensor, key_pos: Tensor, query_pos: Tensor) -> Tensor:
        """Mean attention distance of each query (see :func:`attention_distance`)."""
        return attention_distance(weights, key_pos, query_pos, self.top_k)

    def is_global(self, weights: Tensor, key_pos: Tensor, query_pos: Tensor) -> Tensor:
        """Bool mask of global queries, shaped like ``weights.shape[:-1]``."""
        return self.distance(weights, key_pos, query_pos) > self.threshold


def kl_divergence(ref_logits: Tensor, logits: Tensor) -> Tensor:
    """``KL(softmax(ref) ‖ softmax(logits))`` per row, in nats.

    Args:
        ref_logits: ``(..., vocab)`` reference (FullKV) logits.
        logits: ``(..., vocab)`` compared logits.

    Returns:
        ``(...)`` float32, >= 0 (up to rounding).
    """
    ref = ref_logits.float().log_softmax(-1)
    other = logits.float().log_softmax(-1)
    return (ref.exp() * (ref - other)).sum(-1)


def held_attention_mass(weights: Tensor, key_pos: Tensor, held_pos: Tensor) -> Tensor:
    """Share of each query's attention mass that lies on positions another cache still holds.

    Args:
        weights: ``(..., group, C)`` reference attention weights over the reference cache's slots.
        key_pos: ``(..., C)`` position of each reference slot (``-1`` empty; its weight is ignored).
        held_pos: ``(..., C')`` positions the compressed cache holds (``-1`` empty).

    Returns:
        ``(..., group)``: ``sum(weights over held positions)``; 1 when everything is held and the
        weights sum to 1.
    """
    size = int(max(int(key_pos.max()), int(held_pos.max()), 0)) + 2
    dump = size - 1  # empty slots scatter here, and it is cleared
    held = torch.zeros(*held_pos.shape[:-1], size, dtype=weights.dtype, device=weights.device)
    held.scatter_(-1, torch.where(held_pos >= 0, held_pos, dump), 1.0)
    held[..., dump] = 0
    on = torch.gather(held, -1, torch.where(key_pos >= 0, key_pos, dump))  # (..., C)
    return (weights * on.unsqueeze(-2)).sum(-1)


def attention_distance(weights: Tensor, key_pos: Tensor, query_pos: Tensor, top_k: int = 150) -> Tensor:
    """Mean ``query_pos - key_pos`` over each query's ``top_k`` most attended keys.

    Args:
        weights: ``(..., group, C)`` attention weights.
        key_pos: ``(..., C)`` slot positions (``-1`` empty; never counted).
        query_pos: Query positions, broadcastable to ``key_pos.shape[:-1]``.
        top_k: Keys averaged over (fewer if fewer filled slots exist).

    Returns:
        ``(..., group)`` float32 mean distances (0 for a query with no key).
    """
    k = min(top_k, weights.shape[-1])
    masked = weights.float().masked_fill((key_pos < 0).unsqueeze(-2), -1.0)  # empties rank last
    _, idx = masked.topk(k, dim=-1)  # (..., group, k)
    kp = torch.gather(key_pos.unsqueeze(-2).expand(*weights.shape), -1, idx)
    ok = kp >= 0
    dist = (query_pos.unsqueeze(-1).unsqueeze(-1) - kp).float().masked_fill(~ok, 0.0)
    return dist.sum(-1) / ok.sum(-1).clamp(min=1)
