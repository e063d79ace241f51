"""The policy driver: runs one policy over one cache — rows, counters, when to evict, the eviction loop, telemetry.

A policy (:class:`~beaconkv.policies.base.EvictionPolicy`) is settings, a ``score`` and a few hooks named
for when they run; this driver does everything around them, the same for every policy:

* **rows**: :meth:`PolicyDriver.admit` starts rows (their counters, positions and the cache's ``active``
  mask), :meth:`PolicyDriver.release` ends them; the driver is the one writer of the rows' positions
  (the state's ``t``/``t_dev``) and of the ``active`` mask;
* **counting and scheduling**: after a prefill (:meth:`PolicyDriver.after_prefill`), a chunk
  (:meth:`PolicyDriver.after_chunk`) or a decode step (:meth:`PolicyDriver.after_decode_step`) it
  advances the host counters and asks the policy's schedule which rows are due;
* **evicting**: :meth:`PolicyDriver.evict` runs :func:`evict_layer` — score (the policy's), protect,
  select, compact — through the state's executor (eagerly or as compiled graphs), and records telemetry.

Calls flow one way: the session (or a :class:`~beaconkv.hf.PolicyCache`) calls the driver; the driver
calls the policy's hooks and ``score``; the policy never drives.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor

from ..cache import KVCache
from ..execution import Executor
from .observer import ObservedLayer
from .schedules import protected_scores
from .selection import ranking_key, select_keep
from .state import EvictionRecord, PolicyState

__all__ = ["PolicyDriver", "evict_all_layers", "evict_layer"]


def evict_layer(policy: Any, layer: ObservedLayer, rows: Tensor, t: Tensor, n_prefix: Tensor, keep_total: Tensor,
                K: int) -> Tensor:
    """Scores, selects and compacts some rows of one layer: a device function (compiled as one graph).

    Args:
        policy: The policy (its ``score``, schedule, allocation and ``n_recent``).
        layer: The layer as the policy observes it (its cache and the policy's observations).
        rows: ``(b,)`` row indices.
        t: ``(b,)`` newest positions.
        n_prefix: ``(b,)`` protected prefix lengths.
        keep_total: ``(b,)`` slots each row keeps.
        K: ``max(keep_total)``, known on the host.

    Returns:
        ``(b, kv_heads, K)`` the kept positions (``-1`` padding), for telemetry.
    """
    pos = layer.positions(rows)
    scores = protected_scores(policy.schedule, policy, policy.allocation.head_scores(policy.score(layer, rows, t)),
                              pos, t)
    key = None
    if policy.allocation.adaptive:  # the layer's total split between heads by score
        key = ranking_key(scores, pos, n_prefix, t, policy.n_recent)
        keep_each = policy.schedule.keep(policy, policy.budget, 0)  # a fixed count (the allocation checked)
        keep_total = policy.allocation.head_counts(policy, key, n_prefix, keep_each)  # (b, kv_heads)
    keep, keep_valid = select_keep(scores, pos, n_prefix, t, policy.n_recent, keep_total, K, key=key)
    kept = torch.where(keep_valid, torch.gather(pos, -1, keep), -1)
    layer.compact(rows, keep, keep_valid)
    return kept


def evict_all_layers(policy: Any, layers: list[ObservedLayer], rows: Tensor, t: Tensor, n_prefix: Tensor,
                     keep_total: Tensor, K: int) -> list[Tensor]:
    """:func:`evict_layer` over every layer, as one device function (one CUDA-graph replay)."""
    return [evict_layer(policy, layer, rows, t, n_prefix, keep_total, K) for layer in layers]


class PolicyDriver:
    """Drives ``policy`` over ``cache``: makes the policy's state, then runs its rows, schedule and evictions.

    Args:
        policy: The policy (settings; its hooks and ``score`` are called from here).
        cache: A freshly allocated cache (sized by the policy's ``capacity``).
        rope: The model's rotary module (policies re-rotate stored pre-RoPE queries with it).
        executor: Runs the device functions (default: eagerly).
        max_tokens: The longest sequence a row will hold (sizes the query ring).
        query_window: Keep at least this many pre-RoPE queries per head (measurement).

    Attributes:
        policy: The policy.
        state: Its :class:`~beaconkv.policies.state.PolicyState` (the observers attention reports to are
            ``state.observers``).
    """

    def __init__(self, policy: Any, cache: KVCache, rope: Any, executor: Executor | None = None, *,
                 max_tokens: int | None = None, query_window: int = 0) -> None:
        self.policy = policy
        self.state: PolicyState = policy.create_state(cache, rope, executor, max_tokens=max_tokens,
                                                      query_window=query_window)
        cache.active.fill_(False)  # no row decodes until admitted (the driver owns the mask from here)

    # ------------------------------------------------------------------------------- rows
    def admit(self, rows: list[int], prompt_lengths: list[int], written: list[int] | None = None) -> None:
        """Starts some rows before their prompts are written (their previous state is forgotten).

        Args:
            rows: Row indices.
            prompt_lengths: Real prompt length of each (the protected prefix is computed from it).
            written: Tokens of each prompt the first prefill writes (a prompt prefilled in chunks: its
                first chunk; the others come through :meth:`after_chunk`). None: the whole prompt.
        """
        state, policy = self.state, self.policy
        prefixes = policy.prefix_lengths(prompt_lengths)
        written = list(prompt_lengths) if written is None else list(written)
        for b, n, p in zip(rows, written, prefixes):
            state.count[b], state.t[b], state.prefix[b], state.live[b] = max(n - p, 0), n - 1, p, True
            state.settled[b] = 0
            state.stats.evictions[b] = 0
        rows_t = state.index(rows)
        state.t_dev[rows_t] = state.to_device([n - 1 for n in written])
        state.prefix_dev[rows_t] = state.to_device(prefixes)
        state.active[rows_t] = True
        state.peak_tokens = max(state.peak_tokens, max(written))
        policy.on_admit(state, rows)

    def release(self, rows: list[int]) -> None:
        """Ends some rows: they stop decoding, evicting and counting. Their cache keeps its last contents
        (for inspection) until the next :meth:`admit` and prefill overwrite them."""
        for b in rows:
            self.state.live[b] = False
        self.state.active[self.state.index(rows)] = False

    # ------------------------------------------------------------------------------- counting
    def after_prefill(self, rows: list[int]) -> None:
        """After the prompts of ``rows`` were written: the policy's hook, then the evictions due."""
        self.policy.on_prefill(self.state, rows)
        self.evict_due(rows)
        self.policy.on_count_change(self.state, rows)

    def after_chunk(self, rows: list[int], n_new: list[int]) -> None:
        """After a chunk wrote ``n_new[i]`` more tokens in row ``rows[i]`` (a prompt prefilled in chunks, a
        question asked on a compressed context): counters, the policy's hook, then the evictions due,
        so the next chunk finds room (the policy's ``capacity`` with ``prefill_chunk``).

        Args:
            rows: The rows the chunk wrote.
            n_new: Tokens written in each.
        """
        state = self.state
        for b, n in zip(rows, n_new):
            before = state.t[b] + 1
            state.count[b] += max(before + n - max(before, state.prefix[b]), 0)
            state.t[b] += n
            state.peak_tokens = max(state.peak_tokens, min(state.t[b] + 1, state.prefix[b]) + state.count[b])
        rows_t = state.index(rows)
        state.t_dev[rows_t] += state.to_device(n_new)
        self.policy.on_chunk(state, rows, n_new)
        self.evict_due(rows)
        self.policy.on_count_change(state, rows)

    def after_decode_step(self) -> None:
        """After one decode step wrote a token in every live row: counters and positions advance, the
        policy's hook, then the evictions due."""
        state = self.state
        rows = state.live_rows()
        state.step += 1
        for b in rows:
            state.count[b] += 1
            state.t[b] += 1
            state.peak_tokens = max(state.peak_tokens, state.prefix[b] + state.count[b])
        state.t_dev.add_(state.active)
        self.policy.on_decode_step(state, rows)
        self.evict_due(rows)
        self.policy.on_count_change(state, rows)

    # ------------------------------------------------------------------------------- evictions
    def evict_due(self, rows: list[int]) -> None:
        """Evicts the given rows whose evictable count reached their schedule's eviction point."""
        if not self.policy.evicts:
            return
        due = [b for b in rows if self.state.count[b] >= self.policy.evict_point(self.state, b)]
        if due:
            self.evict(due)

    def evict(self, rows: list[int]) -> None:
        """Scores and compacts the given rows in every layer, down to ``n_prefix`` + the schedule's keep count."""
        state, policy = self.state, self.policy
        t0 = time.perf_counter()
        policy.before_evict(state, rows)
        kept_counts = policy.keep_count(state, rows)
        totals = [state.prefix[b] + k for b, k in zip(rows, kept_counts)]
        # the fullest head's worst case under a head-adaptive allocation (0: every head keeps the same)
        extra = [policy.allocation.extra_slots(policy, k) for k in kept_counts]
        rows_t = state.index(rows)
        t, n_prefix = state.t_dev[rows_t], state.prefix_dev[rows_t]
        keep_total = state.to_device(totals)
        K = max(n + e for n, e in zip(totals, extra))
        run = state.executor.run
        if state.executor.layerwise:
            for i, layer in enumerate(state.observers):
                self._record(i, rows, rows_t, t, run(evict_layer, policy, layer, rows_t, t, n_prefix, keep_total, K))
        else:
            kept_all = run(evict_all_layers, policy, state.observers, rows_t, t, n_prefix, keep_total, K)
            for i, kept in enumerate(kept_all):
                self._record(i, rows, rows_t, t, kept)
        for b, kept_count, e in zip(rows, kept_counts, extra):
            state.count[b] = kept_count + e  # the slots the row's fullest head may hold
            state.settled[b] = policy.schedule.settled_after(policy, kept_count)
            state.stats.evictions[b] += 1
        state.stats.eviction_calls += 1
        policy.on_evict(state, rows)
        state.stats.eviction_seconds += time.perf_counter() - t0

    def _record(self, i: int, rows: list[int], rows_t: Tensor, t: Tensor, kept: Tensor) -> None:
        if self.policy.telemetry:
            state = self.state
            observed = self.policy.observed_positions(state.observers[i], rows_t, t)
            state.stats.telemetry.append(EvictionRecord(state.step, i, list(rows), kept.cpu(), observed))
