"""LazyEviction: keep the tokens whose attention keeps coming back, judged by their recurrence intervals.

Reasoning traces revisit tokens: a token that drew attention, went quiet and drew attention again is
likely to be needed again after a similar gap. Every decode step's attention weights update two
per-slot records that move with the keys on compaction — when the slot was last *hit* (attended above
a threshold) and the longest gap it has shown between two hits (its maximum recurrence interval) — and
an eviction drops first the tokens that have stayed quiet longer than their own longest gap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from .base import EvictionPolicy
from .config import check_number
from .observer import ObservedLayer
from .state import PolicyState

#: Slot buffer: the position of the slot's last hit plus one (0: no hit since it was written).
SEEN = "lazy_seen"
#: Slot buffer: the slot's maximum recurrence interval (0 until it is hit twice).
MRI = "lazy_mri"


@dataclass
class LazyEviction(EvictionPolicy):
    """Recurrence-interval-aware eviction (Zhang et al., 2025, "LazyEviction"), SPEC §5.

    Recipe, per sequence and KV head:

    * **tracking**, at every decode step ``s`` (the new query at position ``s``): slot ``j`` is *hit*
      when ``max over the GQA group of w[j] >= threshold / n``, ``w`` the step's attention weights and
      ``n`` the filled slots (so ``threshold = 1`` means "more than a uniform share"). On a hit,
      ``mri[j] = max(mri[j], s - last[j])`` and ``last[j] = s``. A slot starts with ``last`` = its own
      position and ``mri = 0`` (a hit at its own step adds nothing).
    * **score** at an eviction at step ``t``: ``last[j] + mri[j] - t``, the slack before the slot's
      next hit is overdue. A token quiet for longer than its longest gap so far scores below zero and
      goes first, the longest-overdue first; tokens never hit twice fall back to recency of their last
      hit (LRU); ties keep the newer token.

    Lagged eviction: the paper evicts once per observation window rather than at every step; the
    shared SPEC §2 schedule does that (one eviction every ``budget - B_min`` tokens), and the base's
    ``n_recent`` newest tokens, not yet observed long, are never evicted.

    Observes: the decode attention weights ``(batch, kv_heads, group, capacity)``
    (``track_attention = True``); prompt attention is not observed (a prompt token's ``last`` is its
    position until a decode query hits it).

    State: two per-slot buffers on each layer's observer (:data:`SEEN`, :data:`MRI`, int64);
    ``state.layers[i]`` is layer ``i``'s observer.

    Args:
        budget: ``B_max`` (see :class:`~beaconkv.policies.base.EvictionPolicy`).
        threshold: A hit is attention of at least ``threshold`` times the uniform share ``1/n``,
            ``> 0`` (default 1.0).

    Raises:
        PolicyConfigError: ``threshold <= 0``, or inconsistent base settings.
    """

    threshold: float = 1.0

    name: ClassVar[str] = "lazy_eviction"
    track_attention: ClassVar[bool] = True

    def validate(self) -> None:
        super().validate()
        check_number("threshold", self.threshold, 0.0, open_low=True,
                     hint="(a multiple of the uniform attention share 1/n; default 1.0)")

    def init_state(self, state: PolicyState) -> None:
        for layer in state.observers:
            layer.register_slot_buffer(SEEN, torch.long)
            layer.register_slot_buffer(MRI, torch.long)
        state.layers = list(state.observers)

    def observe_attention(self, state: PolicyState, layer: ObservedLayer, weights: Tensor) -> None:
        seen, mri = layer.slot_buffers[SEEN], layer.slot_buffers[MRI]
        pos = layer.positions()  # (batch, kv_heads, capacity), -1 empty
        filled = pos >= 0
        n = filled.sum(-1, keepdim=True).clamp(min=1)  # (batch, kv_heads, 1)
        w = weights.amax(2).float()  # (batch, kv_heads, capacity): a hit from any head of the group
        hit = filled & (w * n >= self.threshold) & state.active[:, None, None]
        now = state.positions[:, None, None]  # the position of this step's query
        last = torch.where(seen > 0, seen - 1, pos)
        mri.copy_(torch.where(hit, torch.maximum(mri, now - last), mri))
        seen.copy_(torch.where(hit, now + 1, seen))

    def score(self, layer: ObservedLayer, rows: Tensor, t: Tensor) -> Tensor:
        pos = layer.positions(rows)
        seen, mri = layer.slot_buffers[SEEN][rows], layer.slot_buffers[MRI][rows]
        last = torch.where(seen > 0, seen - 1, pos)
        return (last + mri - t[:, None, None]).float()
