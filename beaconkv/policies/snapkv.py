"""SnapKV at decode time: the last ``window`` queries vote, with pooled attention, for the keys to keep."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import Tensor

from .observer import ObservedLayer
from .scoring import attention_probs, pool_slots, reduce_group, reduce_queries
from .state import PolicyState
from .window import RecentWindowPolicy


@dataclass
class SnapKV(RecentWindowPolicy):
    """Decode-time SnapKV (Li et al., 2024), SPEC §5.

    Recipe, per sequence and KV head, at each eviction:

    1. the last ``window`` pre-RoPE queries of the ring, each rotated to its *own* position;
    2. softmax over every cached key (prefix included), causal (a query sees keys at positions <= its own);
    3. mean over the queries;
    4. average pooling along the cache axis, kernel ``kernel``, stride 1 (at the ends of the cache
       the window averages only the slots that exist);
    5. mean over the query heads of the GQA group.

    Observes: the query ring, ``query_window = window``. A prompt prefilled in chunks (``prefill_chunk``) is
    scored after each chunk with that chunk's own last ``window`` queries, over every key still held.

    Args:
        budget: ``B_max`` (see :class:`~beaconkv.policies.base.EvictionPolicy`).
        window: Observed recent queries (default 32).
        kernel: Odd pooling kernel (default 5).

    Raises:
        PolicyConfigError: ``window < 1`` or ``kernel`` even or ``< 1``.
    """

    window: int = 32
    kernel: int = 5

    name: ClassVar[str] = "snapkv"

    def score(self, layer: ObservedLayer, rows: Tensor, t: Tensor) -> Tensor:
        state = layer.state
        q_rot, qpos, q_mask = self.window_queries(state, layer, rows, t)  # each query at its own position
        pos = layer.positions(rows)
        w = attention_probs(
            q_rot, q_mask, layer.keys(rows), pos >= 0, 1.0 / math.sqrt(layer.head_dim), q_pos=qpos, key_pos=pos
        )  # (b, kv_heads, group, n, capacity)
        per_head = reduce_queries(w, q_mask, "mean")  # (b, kv_heads, group, capacity)
        # the group mean and the average pooling are both linear: taking the mean first is the same
        return pool_slots(reduce_group(per_head, "mean"), self.kernel, "avg")
