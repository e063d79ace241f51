"""Per-step fidelity metrics: next-token KL, attention recall of held positions, global/local queries.

Each query is one (step, layer, query head). Two rules split them into *global* and *local*:

* :class:`GlobalQueryRule` — the paper's (SPEC §1): global when the mean distance ``t - position``
  over its top-K attended keys exceeds a fixed threshold (K = 150, threshold 200 tokens, chosen for
  32K-token traces). On contexts of a few thousand tokens it calls a third of all queries global:
  the diffuse attention of a short context.
* :class:`LengthAwareRule` — sparse at any length: global when the top-K mean distance exceeds a
  fraction of the context *and* most of the query's attention mass lies on generated tokens outside
  the recent window (not on the protected prompt, not on the last tokens): a query that revisits
  earlier reasoning.
"""

from __future__ import annotations

from collections.abc import Sequence
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

    def is_global(self, weights: Tensor, key_pos: Tensor, query_pos: Tensor, distance: Tensor | None = None) -> Tensor:
        """Bool mask of global queries, shaped like ``weights.shape[:-1]``.

        Args:
            weights: ``(..., group, C)`` attention weights.
            key_pos: ``(..., C)`` slot positions (``-1`` empty).
            query_pos: Query positions, broadcastable to ``key_pos.shape[:-1]``.
            distance: The queries' top-``top_k`` mean distance if already computed (e.g. shared
                with a :class:`LengthAwareRule` of the same K); None computes it.
        """
        dist = self.distance(weights, key_pos, query_pos) if distance is None else distance
        return dist > self.threshold


@dataclass(frozen=True)
class LengthAwareRule:
    """A global query at any length: it looks far back relative to the context, into generated text.

    A query at position ``t`` is global when both hold:

    * the mean distance of its ``top_k`` most attended keys exceeds ``fraction * (t + 1)``;
    * at least ``mass`` of its attention lies on positions in ``[prompt, t - recent]``: generated
      tokens outside the recent window (the protected prompt and the last ``recent`` tokens excluded).

    Attributes:
        top_k: K of the mean distance.
        fraction: Share of the context the mean distance must exceed.
        recent: The recent window, in tokens.
        mass: Share of the attention mass that must lie on the far generated tokens.
    """

    top_k: int = 150
    fraction: float = 0.25
    recent: int = 64
    mass: float = 0.5

    def __post_init__(self) -> None:
        if self.top_k < 1:
            raise FidelityError(f"top_k={self.top_k} must be >= 1.")
        if not 0 < self.fraction < 1:
            raise FidelityError(f"fraction={self.fraction} must lie in (0, 1) (default 0.25).")
        if self.recent < 0:
            raise FidelityError(f"recent={self.recent} must be >= 0 (default 64).")
        if not 0 < self.mass <= 1:
            raise FidelityError(f"mass={self.mass} must lie in (0, 1] (default 0.5).")

    def far_mass(self, weights: Tensor, key_pos: Tensor, query_pos: Tensor, prompt_len: Tensor) -> Tensor:
        """Share of each query's attention on generated positions outside the recent window.

        Args:
            weights: ``(..., group, C)`` attention weights.
            key_pos: ``(..., C)`` slot positions (``-1`` empty).
            query_pos: Query positions, broadcastable to ``key_pos.shape[:-1]``.
            prompt_len: Prompt lengths, broadcastable to ``key_pos.shape[:-1]``.
        """
        t, p = query_pos.unsqueeze(-1), prompt_len.unsqueeze(-1)
        far = (key_pos >= p) & (key_pos <= t - self.recent)
        return (weights * far.to(weights.dtype).unsqueeze(-2)).sum(-1)

    def is_global(
        self, weights: Tensor, key_pos: Tensor, query_pos: Tensor, prompt_len: Tensor, distance: Tensor | None = None
    ) -> Tensor:
        """Bool mask of global queries, shaped like ``weights.shape[:-1]``.

        Arguments as :meth:`far_mass`, plus ``distance``: the queries' top-``top_k`` mean distance
        if already computed (None computes it).
        """
        dist = attention_distance(weights, key_pos, query_pos, self.top_k) if distance is None else distance
        far_enough = dist > self.fraction * (query_pos.unsqueeze(-1) + 1).float()
        return far_enough & (self.far_mass(weights, key_pos, query_pos, prompt_len) >= self.mass)


def prompt_mass(weights: Tensor, key_pos: Tensor, prompt_len: Tensor) -> Tensor:
    """Share of each query's attention on the protected prompt (positions ``< prompt_len``).

    Args:
        weights: ``(..., group, C)`` attention weights.
        key_pos: ``(..., C)`` slot positions (``-1`` empty).
        prompt_len: Prompt lengths, broadcastable to ``key_pos.shape[:-1]``.
    """
    on = (key_pos >= 0) & (key_pos < prompt_len.unsqueeze(-1))
    return (weights * on.to(weights.dtype).unsqueeze(-2)).sum(-1)


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
    return held_attention_masses(weights, key_pos, [held_pos])[0]


def held_attention_masses(
    weights: Tensor, key_pos: Tensor, held_pos: Sequence[Tensor], n_positions: int | None = None
) -> Tensor:
    """:func:`held_attention_mass` for several compressed caches at once (one pass over the weights).

    Each cache's held positions are scattered into a presence table indexed by position, the
    reference slots look their positions up in it, and one batched matrix product sums every
    cache's held weights: no sort per cache, and the ``O(C)`` reference weights are read once for
    all of them.

    Args:
        weights: ``(..., group, C)`` reference attention weights.
        key_pos: ``(..., C)`` reference slot positions (``-1`` empty).
        held_pos: Per cache, ``(..., C_r)`` held positions (``-1`` empty; any order; ``C_r`` may differ).
        n_positions: An upper bound on every position plus one (default: read from the tensors,
            one host read).

    Returns:
        ``(len(held_pos), ..., group)`` the held mass of each cache.

    Raises:
        ValueError: No cache is given.
    """
    if not held_pos:
        raise ValueError("held_pos is empty: pass at least one cache's held positions.")
    if n_positions is None:
        n_positions = int(max([int(key_pos.max())] + [int(h.max()) for h in held_pos])) + 1
    P = max(n_positions, 1)
    lead = key_pos.shape[:-1]
    table = torch.zeros(len(held_pos), *lead, P + 1, dtype=torch.bool, device=key_pos.device)
    for r, h in enumerate(held_pos):  # column P collects the empty slots
        table[r].scatter_(-1, torch.where((h >= 0) & (h < P), h, P), True)
    table[..., P] = False
    slot = torch.where((key_pos >= 0) & (key_pos < P), key_pos, P)
    mask = torch.gather(table, -1, slot.unsqueeze(0).expand(len(held_pos), *slot.shape))  # (R, ..., C)
    G, C = weights.shape[-2], weights.shape[-1]
    w = weights.reshape(-1, G, C)
    m = mask.reshape(len(held_pos), -1, C).permute(1, 2, 0).to(weights.dtype)  # (N, C, R)
    return torch.bmm(w, m).permute(2, 0, 1).reshape(len(held_pos), *weights.shape[:-1])


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
