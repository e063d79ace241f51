"""RPC (Reasoning Path Compression): the last ``window`` queries score the generated tokens, summed.

Under the shared budget schedule by default; RPC's own periodic compression (every ``period`` new
tokens keep ``1/compression`` of them; the cache grows by ``period/compression`` per period) is the
:class:`~beaconkv.policies.schedules.Periodic` schedule, which any other scorer can use as well.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import Tensor

from .observer import ObservedLayer
from .config import check_choice
from .scoring import attention_probs, pool_slots, reduce_group, reduce_queries
from .state import PolicyState
from .window import RecentWindowPolicy

GROUP_REDUCES = ("mean", "all_heads")


@dataclass
class RPC(RecentWindowPolicy):
    """Reasoning Path Compression (Song et al., 2025), SPEC §5.

    Recipe, per sequence, at each eviction:

    1. the last ``window`` (R) pre-RoPE queries of the ring, each rotated to its *own* position;
    2. softmax over the *evictable region only* (filled slots with position ``>= n_prefix``), causal;
    3. **sum** over the queries;
    4. average pooling along the cache axis, kernel ``kernel`` (ends average only existing slots);
    5. ``group_reduce="mean"``: mean over the query heads of each KV head's GQA group;
       ``"all_heads"``: mean over every query head of the layer, the same score broadcast to every KV
       head (RPC's reference default): all KV heads then keep the same positions.

    Schedule: the shared SPEC §2 semantics by default (evict at ``budget``, down to ``B_min``); RPC's own
    is ``RPC(None, schedule=Periodic(period=1024, compression=4))`` (see
    :class:`~beaconkv.policies.schedules.Periodic`: the newest ``period`` tokens are compacted, their
    last ``max(window, n_recent)`` left uncompressed).

    Observes: the query ring, ``query_window = window``.

    Args:
        budget: ``B_max`` (None with a schedule that sizes itself, such as
            :class:`~beaconkv.policies.schedules.Periodic`).
        window: Observed recent queries R (default 32).
        kernel: Odd pooling kernel (default 7).
        group_reduce: ``"mean"`` (default) or ``"all_heads"``.

    Raises:
        PolicyConfigError: Bad ``window``/``kernel``/``group_reduce``, or a budget its schedule refuses.
    """

    window: int = 32
    kernel: int = 7
    group_reduce: str = "mean"

    name: ClassVar[str] = "rpc"

    def validate(self) -> None:
        super().validate()
        check_choice("group_reduce", self.group_reduce, GROUP_REDUCES)

    # ---------------------------------------------------------------- scoring
    def score(self, layer: ObservedLayer, rows: Tensor, t: Tensor) -> Tensor:
        state = layer.state
        q_rot, qpos, q_mask = self.window_queries(state, layer, rows, t)  # each query at its own position
        pos = layer.positions(rows)  # (b, kv_heads, capacity)
        n_prefix = state.prefix_dev[rows][:, None, None]
        evictable = (pos >= 0) & (pos >= n_prefix)
        w = attention_probs(
            q_rot, q_mask, layer.keys(rows), evictable, 1.0 / math.sqrt(layer.head_dim), q_pos=qpos, key_pos=pos
        )  # (b, kv_heads, group, n, capacity)
        summed = reduce_queries(w, q_mask, "sum")  # (b, kv_heads, group, capacity)
        if self.group_reduce == "all_heads":
            scores = summed.mean((1, 2), keepdim=True).squeeze(2).expand(-1, layer.n_kv_heads, -1)
        else:
            scores = reduce_group(summed, "mean")
        return pool_slots(scores.contiguous(), self.kernel, "avg")
