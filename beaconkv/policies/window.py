"""Base class of the policies that observe the last ``window`` queries at their own positions.

SnapKV, RPC and R-KV all score the cache with the most recent decode queries, each rotated to the
position it was produced at; they differ only in how they turn those queries' attention into
scores. This class holds what they share: the observation window, its pooling kernel, the ring
size it needs and the rotated window queries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from .observer import ObservedLayer
from .base import EvictionPolicy
from .config import PolicyConfigError, check_int
from .scoring import last_queries
from .state import PolicyState


@dataclass
class RecentWindowPolicy(EvictionPolicy):
    """An eviction policy that scores with the last ``window`` queries (SPEC §5's recent-query family).

    Args:
        budget: ``B_max`` (see :class:`~beaconkv.policies.base.EvictionPolicy`).
        window: Observed recent queries.
        kernel: Odd pooling kernel along the cache axis (1 = no pooling).

    Raises:
        PolicyConfigError: ``window < 1`` or ``kernel`` even or ``< 1``.
    """

    window: int = 32
    kernel: int = 5

    def validate(self) -> None:
        super().validate()
        check_int("window", self.window, 1, hint="(the number of recent queries that score)")
        check_int("kernel", self.kernel, 1)
        if self.kernel % 2 == 0:
            raise PolicyConfigError(f"kernel={self.kernel} must be an odd integer >= 1 (1 = no pooling).")

    def query_window(self, max_tokens: int) -> int:
        return self.window

    @property
    def uncompressed_recent(self) -> int:
        """``max(window, n_recent)``: a periodic schedule leaves the observation window uncompressed too."""
        return max(self.window, self.n_recent)

    def observed_positions(self, layer: ObservedLayer, rows: Tensor, t: Tensor) -> Tensor:
        _, qpos, mask = last_queries(layer, rows, t, self.window)
        return qpos.masked_fill(~mask, -1).cpu()

    def window_queries(self, state: PolicyState, cache: ObservedLayer, rows: Tensor, t: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The last ``window`` queries, each rotated to its own position.

        Returns:
            ``(q_rot (b, heads, R, head_dim), positions (b, R), mask (b, R))``.
        """
        q, qpos, q_mask = last_queries(cache, rows, t, self.window)
        return state.rope.rotate(q, qpos.clamp(min=0)), qpos, q_mask
