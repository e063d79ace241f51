"""RPC (Reasoning Path Compression): the last ``window`` queries score the generated tokens, summed.

Two cadences: the project's shared budget cadence (default), or RPC's own periodic compression
(every ``period`` new tokens keep ``1/compression`` of them; the cache grows by ``period/compression``
per period).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from ..cache import LayerKVCache
from .config import PolicyConfigError, check_choice, check_int
from .scoring import attention_probs, pool_slots, reduce_group, reduce_queries
from .state import PolicyState
from .window import RecentWindowPolicy

CADENCES = ("budget", "rpc")
GROUP_REDUCES = ("mean", "all_heads")


@dataclass(eq=False)
class RPCState(PolicyState):
    """RPC's state: the base schedule plus, per row, the evictable tokens older than the current period.

    Attributes:
        settled: Host, per row: evictable tokens already compressed (cadence ``"rpc"``).
    """

    settled: list[int] = field(default_factory=list)


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

    Cadence:

    * ``"budget"`` (default): the shared SPEC §2 semantics (evict at ``budget``, down to ``B_min``).
    * ``"rpc"``: RPC's own schedule; ``budget`` must be None. Whenever ``period`` tokens have arrived
      since the last compression (counting the ``R = max(window, n_recent)`` recent tokens it left
      uncompressed), the newest ``period`` tokens are compacted: their last ``R`` stay, and
      ``period // compression`` of the others are kept by score. Older (already compressed) tokens stay
      untouched, so the evictable count grows by ``period // compression`` per period and
      :meth:`capacity` sizes the cache for the whole generation. ``reselect=True`` instead re-selects
      among *all* evictable tokens but the last ``R`` (keeping as many as the period rule), as RPC's
      reference code does.

    Observes: the query ring, ``query_window = window``.

    Args:
        budget: ``B_max`` for ``cadence="budget"``; None for ``cadence="rpc"``.
        window: Observed recent queries R (default 32).
        kernel: Odd pooling kernel (default 7).
        group_reduce: ``"mean"`` (default) or ``"all_heads"``.
        cadence: ``"budget"`` (default) or ``"rpc"``.
        period: P, new tokens per compression under ``cadence="rpc"`` (default 1024; the paper also
            uses 4096).
        compression: c, the kept share ``1/c`` of a period (default 4).
        reselect: Under ``cadence="rpc"``, re-select over every evictable token (reference code) instead
            of the newest period only (default False).

    Raises:
        PolicyConfigError: Bad ``window``/``kernel``/``group_reduce``/``cadence``; under
            ``cadence="rpc"``: a budget given, ``compression < 1``, or ``period`` too short to keep
            ``R + period // compression`` tokens.
    """

    window: int = 32
    kernel: int = 7
    group_reduce: str = "mean"
    cadence: str = "budget"
    period: int = 1024
    compression: int = 4
    reselect: bool = False

    name: ClassVar[str] = "rpc"
    requires_budget: ClassVar[bool] = False  # cadence="rpc" sizes itself; validate() checks the rest
    state_class: ClassVar[type[PolicyState]] = RPCState

    def validate(self) -> None:
        super().validate()
        check_choice("group_reduce", self.group_reduce, GROUP_REDUCES)
        check_choice("cadence", self.cadence, CADENCES)
        if self.cadence == "budget" and self.budget is None:
            raise PolicyConfigError("cadence='budget' needs a budget (e.g. budget=1024), or use cadence='rpc'.")
        if self.cadence == "rpc":
            if self.budget is not None:
                raise PolicyConfigError(
                    f"cadence='rpc' sizes the cache from period={self.period} and compression={self.compression}; "
                    f"pass budget=None instead of budget={self.budget}."
                )
            check_int("compression", self.compression, 1, hint="(default 4)")
            check_int("period", self.period, 1, hint="(default 1024)")
            keep_recent, kept = max(self.window, self.n_recent), self.period // self.compression
            if kept < 1 or self.period < keep_recent + kept:
                raise PolicyConfigError(
                    f"period={self.period} must hold the {keep_recent} uncompressed recent tokens (max(window, "
                    f"n_recent)) plus at least period // compression={kept} >= 1 kept "
                    f"tokens; use period >= {keep_recent + max(1, kept)} or a smaller compression/window."
                )

    # ---------------------------------------------------------------- scoring
    def score(self, state: PolicyState, layer_state: Any, cache: LayerKVCache, rows: Tensor, t: Tensor) -> Tensor:
        q_rot, qpos, q_mask = self.window_queries(state, cache, rows, t)  # each query at its own position
        pos = cache.positions(rows)  # (b, kv_heads, capacity)
        n_prefix = state.prefix_dev[rows][:, None, None]
        evictable = (pos >= 0) & (pos >= n_prefix)
        w = attention_probs(
            q_rot, q_mask, cache.keys(rows), evictable, 1.0 / math.sqrt(cache.head_dim), q_pos=qpos, key_pos=pos
        )  # (b, kv_heads, group, n, capacity)
        summed = reduce_queries(w, q_mask, "sum")  # (b, kv_heads, group, capacity)
        if self.group_reduce == "all_heads":
            scores = summed.mean((1, 2), keepdim=True).squeeze(2).expand(-1, cache.n_kv_heads, -1)
        else:
            scores = reduce_group(summed, "mean")
        scores = pool_slots(scores.contiguous(), self.kernel, "avg")
        if self.cadence == "rpc":
            keep = pos > (t - self.keep_recent)[:, None, None]  # left uncompressed, as RPC's last R
            if not self.reselect:  # compact the newest period only
                keep |= pos <= (t - self.period)[:, None, None]
            scores = torch.where(keep, math.inf, scores)
        return scores

    # --------------------------------------------------------------- cadence
    @property
    def keep_recent(self) -> int:
        """Recent tokens RPC's cadence leaves uncompressed: ``max(window, n_recent)``."""
        return max(self.window, self.n_recent)

    @property
    def kept_per_period(self) -> int:
        """``period // compression``: tokens a compression keeps out of a period (besides the recent)."""
        return self.period // self.compression

    @property
    def evicts(self) -> bool:
        return True

    def init_state(self, state: PolicyState) -> None:
        assert isinstance(state, RPCState)
        state.settled = [0] * state.batch

    def admit(self, state: PolicyState, rows: list[int], prompt_lengths: list[int]) -> None:
        super().admit(state, rows, prompt_lengths)
        for b in rows:
            state.settled[b] = 0

    def evict_due(self, state: PolicyState, rows: list[int]) -> None:
        if self.cadence == "budget":
            return super().evict_due(state, rows)
        due = [b for b in rows if state.count[b] - state.settled[b] >= self.period]
        if due:
            self.evict(state, due)

    def keep_count(self, state: PolicyState, rows: list[int]) -> list[int]:
        if self.cadence == "budget":
            return super().keep_count(state, rows)
        return [state.count[b] - self.period + self.kept_per_period + self.keep_recent for b in rows]

    def after_evict(self, state: PolicyState, rows: list[int]) -> None:
        if self.cadence == "rpc":
            for b in rows:
                state.settled[b] = state.count[b] - self.keep_recent

    def peak_evictable(self, count: int, new_tokens: int) -> int:
        """Most evictable tokens a sequence holds (under the "rpc" cadence: host arithmetic, one loop
        iteration per compression)."""
        if self.cadence == "budget":
            return super().peak_evictable(count, new_tokens)
        P, T, R = self.period, self.kept_per_period, self.keep_recent
        settled, peak = 0, count
        if count >= P:  # the prompt alone fills a period: compressed right after the prefill
            settled, count = count - P + T, count - P + T + R
        while new_tokens > 0:
            step = min(new_tokens, settled + P - count)  # tokens until the next compression
            count, new_tokens = count + step, new_tokens - step
            peak = max(peak, count)
            if count - settled >= P:
                settled, count = count - P + T, count - P + T + R
        return peak
