"""H2O (Heavy-Hitter Oracle): keep the tokens that have received the most attention, plus a recent window.

Observes every decode step's attention weights through the cache's attention hook and accumulates
them in a per-slot buffer that moves with the keys on compaction.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..cache import LayerKVCache
from .base import EvictionPolicy, PolicyConfigError

#: Name of the accumulated-attention slot buffer on each layer cache.
ACC = "h2o_acc"


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
    prompt evictable (**choice**; with the default prefix the prompt is never evicted).

    Args:
        budget: ``B_max`` (see :class:`~beaconkv.policies.base.EvictionPolicy`).
        recent_ratio: Share of ``B_min`` reserved for the most recent tokens, in ``[0, 1]`` (default
            0.5, H2O's even heavy/recent split).
        **kwargs: ``n_prefix``, ``n_recent``, ``ratio``, ``telemetry`` of the base class.

    Raises:
        PolicyConfigError: ``recent_ratio`` outside ``[0, 1]``.
    """

    name = "h2o"
    track_attention = True

    def __init__(self, budget: int | None, recent_ratio: float = 0.5, **kwargs) -> None:
        super().__init__(budget, **kwargs)
        if not 0.0 <= recent_ratio <= 1.0:
            raise PolicyConfigError(f"recent_ratio={recent_ratio} must lie in [0, 1] (default 0.5).")
        self.recent_ratio = recent_ratio

    @property
    def n_recent_h2o(self) -> int:
        """Recent tokens of the heavy/recent split: ``floor(recent_ratio * B_min)``."""
        return 0 if self.b_min is None else math.floor(self.recent_ratio * self.b_min)

    def init_layer(self, layer: int, cache: LayerKVCache) -> None:
        acc = cache.register_slot_buffer(ACC)

        def accumulate(weights: Tensor) -> None:
            # weights: (batch, kv_heads, group, capacity); empty slots carry 0
            acc.add_(weights.sum(2).to(acc.dtype))

        cache.attention_hook = accumulate

    def score(self, layer: int, cache: LayerKVCache, rows: Tensor, t: Tensor) -> Tensor:
        acc = cache.slot_buffers[ACC][rows]  # (b, kv_heads, capacity)
        recent = cache.pos[rows] > (t - self.n_recent_h2o)[:, None, None]
        return torch.where(recent, math.inf, acc)

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, recent_ratio={self.recent_ratio})"
