"""KNorm: keys with a small L2 norm draw the most attention, so keep the lowest-norm keys.

Observes nothing: the score of a slot is read off its key alone. RoPE rotates a key without changing
its length, so the cached (post-RoPE) keys give the same norms as the pre-RoPE ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from torch import Tensor

from .base import EvictionPolicy
from .observer import ObservedLayer
from .state import PolicyState


@dataclass
class KNorm(EvictionPolicy):
    """L2-norm-based eviction (Devoto et al., 2024), SPEC §5.

    The paper finds that the keys with the *lowest* L2 norm are the ones later queries attend to most,
    so it keeps those and drops the high-norm ones.

    Recipe, per sequence and KV head, at each eviction: score ``-||k_j||_2`` for every cached key
    (float32); the base keeps the prefix, the ``n_recent`` newest and the best ``B_min`` of the rest
    (ties: the newer key). Every KV head chooses its own set; queries play no part.

    Observes: nothing (no query ring, no attention weights).

    Args:
        budget: ``B_max`` (see :class:`~beaconkv.policies.base.EvictionPolicy`).

    Raises:
        PolicyConfigError: The base settings are inconsistent (see
            :class:`~beaconkv.policies.base.EvictionPolicy`).
    """

    name: ClassVar[str] = "knorm"

    def score(self, state: PolicyState, layer_state: Any, cache: ObservedLayer, rows: Tensor, t: Tensor) -> Tensor:
        return -cache.keys(rows).float().norm(dim=-1)  # (b, kv_heads, capacity)
