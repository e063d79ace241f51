"""Base class of the policies that observe the last ``window`` queries at their own positions.

SnapKV, RPC and R-KV all score the cache with the most recent decode queries, each rotated to the
position it was produced at; they differ only in how they turn those queries' attention into
scores. This class holds what they share: the observation window, its pooling kernel, the ring
size it needs and the rotated window queries.
"""

from __future__ import annotations

from torch import Tensor

from ..cache import LayerKVCache
from .base import EvictionPolicy
from .scoring import check_window_kernel, last_queries


class RecentWindowPolicy(EvictionPolicy):
    """An eviction policy that scores with the last ``window`` queries (SPEC §5's recent-query family).

    Args:
        budget: ``B_max`` (see :class:`~beaconkv.policies.base.EvictionPolicy`).
        window: Observed recent queries.
        kernel: Odd pooling kernel along the cache axis (1 = no pooling).
        **kwargs: ``n_prefix``, ``n_recent``, ``ratio``, ``telemetry`` of the base class.

    Raises:
        PolicyConfigError: ``window < 1`` or ``kernel`` even or ``< 1``.
    """

    def __init__(self, budget: int | None, window: int, kernel: int, **kwargs) -> None:
        super().__init__(budget, **kwargs)
        check_window_kernel(window, kernel)
        self.window, self.kernel = window, kernel

    @property
    def query_window(self) -> int:
        return self.window

    def observed_positions(self, layer: int, rows: Tensor, t: Tensor) -> Tensor:
        _, qpos, mask = last_queries(self.cache[layer], rows, t, self.window)
        return qpos.masked_fill(~mask, -1).cpu()

    def window_queries(self, cache: LayerKVCache, rows: Tensor, t: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The last ``window`` queries, each rotated to its own position.

        Returns:
            ``(q_rot (b, heads, R, head_dim), positions (b, R), mask (b, R))``.
        """
        q, qpos, q_mask = last_queries(cache, rows, t, self.window)
        return self.rope.rotate(q, qpos.clamp(min=0)), qpos, q_mask
