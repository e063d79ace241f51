"""TOVA: the newest query's attention, averaged over heads, decides which tokens stay.

Reads the one most recent pre-RoPE query per head from the query ring (``query_window = 1``),
rotates it to its own position and scores every cached key with its softmax attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import Tensor

from .base import EvictionPolicy
from .config import check_choice
from .observer import ObservedLayer
from .scoring import attention_probs, last_queries, reduce_group
from .state import PolicyState

GROUP_REDUCES = ("mean", "all_heads")


@dataclass
class TOVA(EvictionPolicy):
    """Token Omission Via Attention (Oren et al., 2024), SPEC §5.

    Recipe, per sequence, at each eviction at step ``t``:

    1. the query of step ``t`` (the ring's newest), rotated to ``t``;
    2. its softmax attention over every filled slot (prefix included), per query head;
    3. ``group_reduce="mean"``: the mean over the query heads of each KV head's GQA group, so each KV
       head keeps its own set; ``"all_heads"``: the mean over every query head of the layer, broadcast
       to every KV head (TOVA's reference averages over all heads: every KV head keeps the same
       positions).

    TOVA's own cadence drops the lowest-scoring token at every step once the cache is full; that is
    ``TOVA(budget, schedule=Buffered(buffer=1))`` (see :class:`~beaconkv.policies.schedules.Buffered`).
    By default it evicts on the shared SPEC §2 schedule, down to ``B_min``, like every other policy.

    Observes: the query ring, ``query_window = 1``.

    Args:
        budget: ``B_max`` (see :class:`~beaconkv.policies.base.EvictionPolicy`).
        group_reduce: ``"mean"`` (default) or ``"all_heads"``.

    Raises:
        PolicyConfigError: Unknown ``group_reduce``, or inconsistent base settings.
    """

    group_reduce: str = "mean"

    name: ClassVar[str] = "tova"

    def validate(self) -> None:
        super().validate()
        check_choice("group_reduce", self.group_reduce, GROUP_REDUCES)

    def query_window(self, max_tokens: int) -> int:
        return 1

    def observed_positions(self, layer: ObservedLayer, rows: Tensor, t: Tensor) -> Tensor:
        _, qpos, mask = last_queries(layer, rows, t, 1)
        return qpos.masked_fill(~mask, -1).cpu()

    def score(self, layer: ObservedLayer, rows: Tensor, t: Tensor) -> Tensor:
        state = layer.state
        qpos = t[:, None]  # (b, 1)
        q, held = layer.ring_at(rows, qpos)  # (b, heads, 1, d): the query of step t
        q_rot = state.rope.rotate(q, qpos)
        pos = layer.positions(rows)
        w = attention_probs(q_rot, held, layer.keys(rows), pos >= 0, 1.0 / math.sqrt(layer.head_dim))
        per_head = w[:, :, :, 0]  # (b, kv_heads, group, capacity)
        if self.group_reduce == "all_heads":
            return per_head.mean((1, 2), keepdim=True).squeeze(2).expand(-1, layer.n_kv_heads, -1).contiguous()
        return reduce_group(per_head, "mean")
