"""H2O (Heavy-Hitter Oracle): keep the tokens that have received the most attention, plus a recent window.

Observes every decode step's attention weights (:meth:`H2O.observe_attention`, inside the decode
step) and accumulates them in a per-slot buffer of each layer's cache, which moves with the keys on
compaction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from .observer import ObservedLayer
from .base import EvictionPolicy
from .config import check_number
from .state import PolicyState

#: Name of the accumulated-attention slot buffer on each layer cache.
ACC = "h2o_acc"


@dataclass
class H2O(EvictionPolicy):
    """Heavy hitters + recent tokens (Zhang et al., 2023).

    Recipe: every decode step adds, to each cached slot, the attention weight the new query gave it,
    summed over the query heads of the slot's GQA group (per KV head, per sequence). At eviction the
    kept evictable set ``B_min`` splits into a *recent* part — the last ``floor(recent_ratio * B_min)``
    positions (score ``+inf``; the base's ``n_recent`` protection applies as well) — and a *heavy* part:
    the remaining slots with the largest accumulated attention.

    Observes: the decode attention weights ``(batch, kv_heads, group, capacity)`` (so the attention
    layers take the explicit-softmax path, ``track_attention = True``). Prompt queries are not
    accumulated: prompt slots start at 0, which matters only when ``n_prefix`` leaves part of the
    prompt evictable (**choice**; with the default prefix the prompt is never evicted). A prompt prefilled
    in chunks is therefore compressed to its newest tokens between chunks (ties keep the newer slot).

    State: ``state.layers[i]`` is layer ``i``'s accumulated-attention slot buffer ``(batch, kv_heads,
    capacity)``.

    Args:
        budget: ``B_max`` (see :class:`~beaconkv.policies.base.EvictionPolicy`).
        recent_ratio: Share of ``B_min`` reserved for the most recent tokens, in ``[0, 1]`` (default
            0.5, H2O's even heavy/recent split).

    Raises:
        PolicyConfigError: ``recent_ratio`` outside ``[0, 1]``.
    """

    recent_ratio: float = 0.5

    name: ClassVar[str] = "h2o"
    track_attention: ClassVar[bool] = True

    def validate(self) -> None:
        super().validate()
        check_number("recent_ratio", self.recent_ratio, 0.0, 1.0, hint="(default 0.5)")

    @property
    def n_recent_h2o(self) -> int:
        """Recent tokens of the heavy/recent split: ``floor(recent_ratio * B_min)``."""
        return 0 if self.b_min is None else math.floor(self.recent_ratio * self.b_min)

    def init_state(self, state: PolicyState) -> None:
        state.layers = [layer.register_slot_buffer(ACC) for layer in state.observers]

    def observe_attention(self, state: PolicyState, acc: Tensor, weights: Tensor) -> None:
        # weights: (batch, kv_heads, group, capacity); empty slots carry 0
        acc.add_(weights.sum(2).to(acc.dtype))

    def score(self, layer: ObservedLayer, rows: Tensor, t: Tensor) -> Tensor:
        acc = layer.layer_state
        recent = layer.positions(rows) > (t - self.n_recent_h2o)[:, None, None]
        return torch.where(recent, math.inf, acc[rows])
