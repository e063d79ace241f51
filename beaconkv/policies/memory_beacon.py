"""Beacon scores with memory: a token important at one eviction keeps part of that importance.

BeaconKV scores the cache afresh at every eviction, with the beacons and recent queries of that
moment; a token the previous cycle's beacons rated highly may be dropped because the current set
happens to look elsewhere — and a global query that needs it may come later. Here each slot carries
its last score (a slot buffer that moves with the key on compaction), and the score of an eviction
is ``max(current score, memory * previous score)``: importance decays geometrically over eviction
cycles instead of vanishing, at no extra attention cost.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from .observer import ObservedLayer
from .beacon import BeaconKV, BeaconLayer
from .config import check_number
from .state import PolicyState

#: Name of the remembered-score slot buffer on each layer cache.
MEMORY = "beacon_memory"


@dataclass(eq=False)
class MemoryLayer(BeaconLayer):
    """One layer's views, with its remembered scores.

    Attributes:
        remembered: ``(batch, kv_heads, capacity)`` each slot's last score (moves with compaction).
    """

    remembered: Tensor | None = None


@dataclass
class MemoryBeaconKV(BeaconKV):
    """BeaconKV whose eviction scores decay over cycles instead of being recomputed from scratch.

    The other arguments are :class:`~beaconkv.policies.beacon.BeaconKV`'s.

    Args:
        memory: Decay per eviction cycle of a slot's remembered score, in ``[0, 1)`` (0 = BeaconKV).

    Raises:
        PolicyConfigError: ``memory`` outside ``[0, 1)``.
    """

    memory: float = 0.5

    name: ClassVar[str] = "beacon_memory"

    def validate(self) -> None:
        super().validate()
        check_number("memory", self.memory, 0, 1, open_high=True, hint="(default 0.5)")

    def init_state(self, state: PolicyState) -> None:
        super().init_state(state)
        state.layers = [MemoryLayer(lay.beacons, lay.obs, lay.cache, lay.cache.register_slot_buffer(MEMORY))
                        for lay in state.layers]

    def score(self, layer: ObservedLayer, rows: Tensor, t: Tensor) -> Tensor:
        """``max(BeaconKV's score, memory * the slot's last score)``; the result is remembered."""
        layer_state = layer.layer_state
        now = super().score(layer, rows, t)
        score = torch.maximum(now, self.memory * layer_state.remembered[rows])
        layer_state.remembered[rows] = score.to(layer_state.remembered.dtype)
        return score
