"""The eviction-policy base class: budget semantics, schedule and the shared keep/compact mechanism.

A policy decides *what* to keep; the cache (:meth:`beaconkv.cache.LayerKVCache.compact`) does the
moving. A new scoring policy is a small subclass that implements :meth:`EvictionPolicy.score`,
returning one score per cached slot, shape ``(b, kv_heads, capacity)``; the base class protects the
prefix and the recent tokens, takes the top-k, and compacts in position order.

A policy object holds **settings only** (a dataclass: parameters, validation and ``repr`` in one
place). Everything it remembers while decoding lives in a :class:`~beaconkv.policies.state.PolicyState`
it creates for a cache (:meth:`EvictionPolicy.create_state`), so one policy object serves any number
of caches — a generation, every slot of a pool, every run of a fidelity study.

Budget semantics (SPEC §2), per sequence and KV head:

* ``n_prefix`` protected tokens at the start (default: the whole prompt) are never evicted;
* ``budget`` (``B_max``) is the most *evictable* tokens the cache may hold; when the evictable count
  reaches it, the policy evicts down to ``B_min = floor(ratio * budget)`` (ratio 7/8);
* the last ``n_recent`` tokens always survive;
* so the cache never holds more than ``n_prefix + budget`` tokens, and its memory is allocated once.

That is the default :class:`~beaconkv.policies.schedules.AtBudget` schedule. When to evict and how many
survive come from the policy's ``schedule`` (:mod:`beaconkv.policies.schedules`), so any scorer runs
under R-KV's :class:`~beaconkv.policies.schedules.Buffered` or RPC's
:class:`~beaconkv.policies.schedules.Periodic` schedule too; the scorer and the protection rules do not
change.

A prompt may also come in chunks (``prefill_chunk``): the policy then evicts after each chunk as after
a decode step, so the cache never holds the whole prompt; what each policy scores with there is in the
specification (SPEC §5, "Prefill in chunks").

A policy is settings, a :meth:`EvictionPolicy.score` and a few hooks named for when they run; the
:class:`~beaconkv.policies.driver.PolicyDriver` does the rest, for every policy alike (driven by
:class:`beaconkv.session.Session` for :func:`beaconkv.generate`, the engine and the fidelity study, and by
:class:`beaconkv.hf.PolicyCache` in transformers):

1. :meth:`EvictionPolicy.capacity` sizes the cache from the prompt lengths;
2. :meth:`EvictionPolicy.create_state` allocates the policy's state for the cache: per-layer tensors, and
   one :class:`~beaconkv.policies.observer.ObservedLayer` per layer (the query ring, per-slot buffers),
   the observers the session hands the model (the driver makes it);
3. the driver admits rows (:meth:`on_admit`); the prefill writes their prompts and attention hands each
   layer's prompt queries to its observer (which runs :meth:`observe_prefill` through the state's
   executor); then :meth:`on_prefill` runs and the driver evicts a prompt already over the budget (a
   prompt in chunks: :meth:`observe_chunk` and :meth:`on_chunk` for each later chunk);
4. each decode step writes one key per row into the cache and one pre-RoPE query per row into the
   observers' rings, in place (static shapes; :meth:`observe_attention` sees the weights); then the
   driver advances the host counters, runs :meth:`on_decode_step` and evicts the rows the schedule says
   are due (:meth:`before_evict`, the score, :meth:`on_evict`); :meth:`on_count_change` follows every
   change of the counts;
5. the driver releases rows (a finished request leaves its slot).

The device work — an eviction's score, select and compact (:func:`~beaconkv.policies.driver.evict_layer`),
and any policy's own device functions — runs through the state's :class:`~beaconkv.execution.Executor`,
eagerly or as compiled graphs: the same functions on the same state either way.
"""

from __future__ import annotations

import math
import inspect
import warnings
from dataclasses import KW_ONLY, dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from ..cache import KVCache
from ..execution import Executor
from .config import PolicyConfigError, auto_n_recent, check_int, check_number
from .allocation import Allocation, Uniform, parse_allocation
from .observer import ObservedLayer, QueryRing
from .schedules import AtBudget, Schedule, parse_schedule
from .selection import select_keep
from .state import EvictionRecord, PolicyState, PolicyStats

__all__ = ["EvictionPolicy", "EvictionRecord", "FullKV", "PolicyConfigError", "PolicyState", "PolicyStats",
           "select_keep"]


#: Hooks renamed for when they run: old name -> new name.
_RENAMED_HOOKS = {"on_prefill_done": "on_prefill", "on_chunk_done": "on_chunk", "on_decode": "on_decode_step",
                  "after_evict": "on_evict", "after_count_change": "on_count_change"}
#: What moved to the driver -> the hook a subclass overrides instead.
_DRIVER_METHODS = {
    "admit": "on_admit(state, rows)", "after_prefill": "on_prefill(state, rows)",
    "after_chunk": "on_chunk(state, rows, n_new)", "after_decode_step": "on_decode_step(state, rows)",
    "release": "nothing (rows end in the driver)", "evict_due": "the schedule (schedule=...)",
    "evict": "before_evict(state, rows) or on_evict(state, rows)", "evict_layer": "score(layer, rows, t)",
    "evict_all_layers": "score(layer, rows, t)",
}


def _old_signature(method: Any) -> bool:
    """Whether a ``score``-like method takes the older ``(state, layer_state, cache, rows, t)``."""
    try:
        params = list(inspect.signature(method).parameters)
    except (TypeError, ValueError):
        return False
    return len(params) == 6


def _adapt_old_signature(method: Any) -> Any:
    def adapted(self: Any, layer: ObservedLayer, rows: Tensor, t: Tensor) -> Any:
        return method(self, layer.state, layer.layer_state, layer, rows, t)

    adapted.__name__, adapted.__doc__ = method.__name__, method.__doc__
    return adapted


@dataclass
class EvictionPolicy:
    """Base class of every KV-cache eviction policy (a dataclass of settings).

    Subclasses implement :meth:`score` (and optionally :meth:`init_state`, the device hooks
    :meth:`observe_prefill`, :meth:`observe_chunk`, :meth:`observe_attention`, and the host hooks
    :meth:`on_admit`, :meth:`on_prefill`, :meth:`on_chunk`, :meth:`on_decode_step`, :meth:`before_evict`,
    :meth:`on_evict`, :meth:`on_count_change`). Budgets, protection, scheduling and compaction are the
    driver's (:class:`~beaconkv.policies.driver.PolicyDriver`), the same for every policy. A subclass declared ``@dataclass`` adds its parameters as fields (after ``budget``,
    before the keyword-only ones) and validates them in :meth:`validate`; every policy takes the
    keyword-only ``n_prefix``, ``n_recent``, ``ratio``, ``schedule``, ``allocation`` and ``telemetry``
    documented here.

    Args:
        budget: ``B_max``, evictable tokens per sequence and KV head; None = never evict.
        n_prefix: Protected leading tokens; None = the whole prompt of each sequence.
        n_recent: The last ``n_recent`` tokens are never evicted. ``"auto"`` (the default): 16, or
            ``budget // 8`` where the eviction step ``budget - B_min`` leaves fewer than 16 slots (budget 64:
            8), as the command line's ``--n-recent auto``.
        ratio: ``B_min = floor(ratio * budget)``, in (0, 1).
        schedule: When to evict and how many evictable tokens survive (a
            :class:`~beaconkv.policies.schedules.Schedule`, or its spec for
            :func:`~beaconkv.policies.schedules.parse_schedule` such as ``"buffered:buffer=128"``);
            default :class:`~beaconkv.policies.schedules.AtBudget` (evict at ``budget`` down to ``B_min``).
        allocation: How an eviction's keep count is split between the KV heads of a layer (an
            :class:`~beaconkv.policies.allocation.Allocation`, or its spec for
            :func:`~beaconkv.policies.allocation.parse_allocation` such as ``"head_adaptive"``); default
            :class:`~beaconkv.policies.allocation.Uniform` (every head keeps ``B_min``).
        telemetry: Record kept positions and observation sets of every eviction.

    Invariants (property-tested, under the default schedule):
        * the cache holds at most ``n_prefix + budget`` tokens per (sequence, KV head);
        * each eviction leaves exactly ``n_prefix + B_min``;
        * prefix and the last ``n_recent`` positions survive every eviction;
        * kept K/V are bit-identical to what was written, positions strictly increasing.

    Raises:
        PolicyConfigError: A non-int budget or ``budget < 1``, ratio outside (0, 1),
            ``budget - B_min < n_recent``, or a schedule that cannot serve these settings.
    """

    budget: int | None = None
    _: KW_ONLY
    n_prefix: int | None = None
    n_recent: int | str = "auto"
    ratio: float = 7 / 8
    schedule: Schedule = AtBudget()
    allocation: Allocation = Uniform()
    telemetry: bool = False

    #: Short registry name.
    name: ClassVar[str] = "base"
    #: ``n_recent`` when the budget allows it (``n_recent="auto"``, the default, lowers it for small budgets).
    default_n_recent: ClassVar[int] = 16
    #: Whether attention layers must report decode attention weights (to :meth:`observe_attention`).
    track_attention: ClassVar[bool] = False
    #: The class of :meth:`create_state`'s result.
    state_class: ClassVar[type[PolicyState]] = PolicyState
    #: Whether ``budget=None`` is an error (False for FullKV; a schedule that sizes itself needs none).
    requires_budget: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Keeps a subclass written for the older policy interface working, or says what to change.

        Hooks that were renamed (``on_prefill_done``, ``on_chunk_done``, ``on_decode``, ``after_evict``,
        ``after_count_change``) run under their new names with a ``DeprecationWarning``; a ``score`` (or
        ``observed_positions``) taking ``(state, layer_state, cache, rows, t)`` is adapted to the new
        ``(layer, rows, t)`` with a warning. A subclass overriding what moved to
        :class:`~beaconkv.policies.driver.PolicyDriver` (``admit``, ``evict`` ...) is refused, naming the
        hook to override instead: that code would no longer run.
        """
        super().__init_subclass__(**kwargs)
        for old, new in _RENAMED_HOOKS.items():
            if old in cls.__dict__:
                warnings.warn(f"{cls.__name__}.{old} is now called {new} (policies/base.py, CHANGELOG.md); it runs "
                              f"as {new} for now: rename it.", DeprecationWarning, stacklevel=2)
                if new not in cls.__dict__:
                    setattr(cls, new, cls.__dict__[old])
        for old, hint in _DRIVER_METHODS.items():
            if old in cls.__dict__:
                raise TypeError(f"{cls.__name__} overrides {old}(), which moved from the policy to "
                                f"beaconkv.policies.PolicyDriver (it drives rows and evictions for every policy); "
                                f"override {hint} instead (CHANGELOG.md, docs/guides/custom-policy.md).")
        for name in ("score", "observed_positions"):
            method = cls.__dict__.get(name)
            if method is not None and _old_signature(method):
                warnings.warn(f"{cls.__name__}.{name}(self, state, layer_state, cache, rows, t) is now "
                              f"{name}(self, layer, rows, t), with layer.state and layer.layer_state "
                              "(CHANGELOG.md); adapted for now.", DeprecationWarning, stacklevel=2)
                setattr(cls, name, _adapt_old_signature(method))

    def __post_init__(self) -> None:
        if self.n_recent == "auto":  # the command line's --n-recent auto, the same in Python
            ratio_ok = isinstance(self.ratio, (int, float)) and 0 < self.ratio < 1
            budget_ok = isinstance(self.budget, int) and not isinstance(self.budget, bool) and self.budget >= 1
            self.n_recent = (auto_n_recent(self.budget, self.default_n_recent, self.ratio) if budget_ok and ratio_ok
                             else self.default_n_recent)
        self.schedule = parse_schedule(self.schedule)
        self.allocation = parse_allocation(self.allocation)
        self.validate()
        self.schedule.check(self)
        self.allocation.check(self)

    def validate(self) -> None:
        """Checks the settings (subclasses extend it; called on construction).

        Raises:
            PolicyConfigError: Naming the bad value and the fix.
        """
        check_number("ratio", self.ratio, 0, 1, open_low=True, open_high=True, hint="(default 7/8)")
        check_int("n_recent", self.n_recent, 0)
        check_int("n_prefix", self.n_prefix, 0, optional=True, hint="Use None for the whole prompt.")
        if not isinstance(self.telemetry, bool):
            raise PolicyConfigError(f"telemetry={self.telemetry!r} must be True or False.")
        check_int("budget", self.budget, 1, optional=True, hint="Use FullKV (budget=None) to keep everything.")
        if self.budget is None and self.requires_budget and not self.schedule.sizes_itself:
            raise PolicyConfigError(f"{type(self).__name__} needs a budget (e.g. budget=1024), or a schedule that "
                                    "sizes itself (schedule=Periodic(...)); use FullKV to keep everything.")

    # ------------------------------------------------------------------------------- sizing
    @property
    def b_min(self) -> int | None:
        """``floor(ratio * budget)``: evictable tokens left after an eviction."""
        return None if self.budget is None else math.floor(self.ratio * self.budget)

    @property
    def evicts(self) -> bool:
        """Whether the policy ever evicts (False for FullKV: the cache holds every token)."""
        return self.budget is not None or self.schedule.sizes_itself

    @property
    def uncompressed_recent(self) -> int:
        """Newest tokens a periodic schedule leaves uncompressed (``n_recent``; a policy that observes a
        window of recent queries leaves the window too)."""
        return self.n_recent

    @property
    def observes_prefill(self) -> bool:
        """Whether the policy overrides :meth:`observe_prefill` (its observers then run it at every prefill)."""
        return type(self).observe_prefill is not EvictionPolicy.observe_prefill

    @property
    def observes_chunk(self) -> bool:
        """Whether the policy overrides :meth:`observe_chunk` (its observers then run it at every chunk)."""
        return type(self).observe_chunk is not EvictionPolicy.observe_chunk

    def query_window(self, max_tokens: int) -> int:
        """How many recent pre-RoPE queries per head each layer's observer keeps in its ring (0: none).

        Args:
            max_tokens: The longest sequence (prompt + new tokens) the cache will see.
        """
        return 0

    def prefix_lengths(self, prompt_lengths: list[int]) -> list[int]:
        """Protected prefix length of each sequence.

        Raises:
            PolicyConfigError: An int ``n_prefix`` exceeds a prompt.
        """
        if self.n_prefix is None:
            return list(prompt_lengths)
        too_long = [L for L in prompt_lengths if self.n_prefix > L]
        if too_long:
            raise PolicyConfigError(
                f"n_prefix={self.n_prefix} is longer than a prompt of {min(too_long)} tokens; "
                "use n_prefix=None (the whole prompt) or a smaller int."
            )
        return [self.n_prefix] * len(prompt_lengths)

    def peak_evictable(self, count: int, new_tokens: int) -> int:
        """Most evictable tokens a sequence holds at once, from ``count`` after its prompt and
        ``new_tokens`` more: the schedule's peak (``budget`` under the default schedule)."""
        return self.schedule.peak(self, count, new_tokens)

    def capacity(self, prompt_lengths: list[int], new_tokens: int, prefill_chunk: int | None = None) -> int:
        """Cache slots needed per (sequence, KV head) for prompts of these lengths and ``new_tokens``.

        A policy that never evicts needs every token; others the most a sequence ever holds:
        its prefix plus :meth:`peak_evictable`, never more than the whole sequence. With
        ``prefill_chunk=N`` a longer prompt is prefilled ``N`` tokens at a time with evictions in between
        (:meth:`~beaconkv.policies.driver.PolicyDriver.after_chunk`), so the cache need not hold the whole prompt: at most ``n_prefix + budget +
        N`` slots under the default schedule (the evictable count stays below the budget before each
        chunk). Without it the cache holds at least the longest prompt.

        Args:
            prompt_lengths: Prompt length of each sequence.
            new_tokens: Tokens each may add.
            prefill_chunk: Tokens per prefill chunk (None: whole prompts).
        """
        longest = max(L + new_tokens for L in prompt_lengths)
        if not self.evicts:
            return longest
        prefixes = self.prefix_lengths(prompt_lengths)
        if prefill_chunk is None:
            peak = max(p + self.peak_evictable(L - p, new_tokens) for L, p in zip(prompt_lengths, prefixes))
            return max(min(peak, longest), max(prompt_lengths))
        peak = max(self._chunked_peak(L, p, prefill_chunk, new_tokens) for L, p in zip(prompt_lengths, prefixes))
        return min(peak, longest)

    def _chunked_peak(self, length: int, prefix: int, chunk: int, new_tokens: int) -> int:
        """Most slots a sequence holds when its prompt of ``length`` tokens (``prefix`` protected) comes in
        chunks of ``chunk`` tokens with an eviction check after each chunk, then ``new_tokens`` decode steps
        with a check after each: host arithmetic through the schedule, as the session runs it."""
        count = settled = peak = start = 0
        for end in [*range(chunk, length, chunk), length]:
            count += max(end - max(start, prefix), 0)  # the chunk's tokens past the prefix
            peak = max(peak, min(end, prefix) + count)
            count, settled = self._after_check(count, settled)
            start = end
        return max(peak, prefix + self._simulated_peak(count, settled, new_tokens))

    def _after_check(self, count: int, settled: int) -> tuple[int, int]:
        """``(count, settled)`` after an eviction check: evicted when ``count`` reached the evict point."""
        if count < self.schedule.evict_at(self, settled):
            return count, settled
        kept = self.schedule.keep(self, count, settled)
        return kept + self.allocation.extra_slots(self, kept), self.schedule.settled_after(self, kept)

    def _simulated_peak(self, count: int, settled: int, new_tokens: int) -> int:
        """The most evictable tokens held from ``count`` (``settled`` of them settled) over ``new_tokens``
        decode steps, stepped from one eviction to the next."""
        peak = count
        while new_tokens > 0:
            step = min(new_tokens, max(self.schedule.evict_at(self, settled) - count, 1))
            count, new_tokens = count + step, new_tokens - step
            peak = max(peak, count)
            count, settled = self._after_check(count, settled)
        return peak

    # ------------------------------------------------------------------------------- state
    def create_state(self, cache: KVCache, rope: Any, executor: Executor | None = None, *,
                     max_tokens: int | None = None, query_window: int = 0) -> PolicyState:
        """Allocates this policy's state for ``cache``, with one observer per layer.

        Args:
            cache: A freshly allocated cache (sized by :meth:`capacity`).
            rope: The model's rotary module.
            executor: Runs the device functions (default: eagerly).
            max_tokens: The longest sequence a row will hold (sizes the query ring through
                :meth:`query_window`; default: the cache's capacity).
            query_window: Keep at least this many pre-RoPE queries per head (measurement); the policy's
                own need is always met.

        Returns:
            The state; no row is admitted yet (see :meth:`admit`). Its
            :attr:`~beaconkv.policies.state.PolicyState.observers` are what the model's prefill and
            decode steps report to.
        """
        state = self.state_class.allocate(cache, rope, executor)
        window = max(self.query_window(max_tokens or cache.capacity), query_window)
        state.observers = [
            ObservedLayer(self, state, layer, QueryRing(layer.batch, layer.n_heads, window, layer.head_dim,
                                                         layer.dtype, cache.device) if window else None)
            for layer in cache.layers
        ]
        self.init_state(state)
        for observer, layer_state in zip(state.observers, state.layers):
            observer.layer_state = layer_state
        return state

    def init_state(self, state: PolicyState) -> None:
        """Allocates the policy's own state (per-layer objects in ``state.layers``; per-slot tensors through
        each observer's :meth:`~beaconkv.policies.observer.ObservedLayer.register_slot_buffer`). Default: nothing."""

    # ------------------------------------------------------------------------------- the schedule's numbers
    def evict_point(self, state: PolicyState, b: int) -> int:
        """The evictable count at which row ``b`` next evicts (``budget`` under the default schedule)."""
        return self.schedule.evict_at(self, state.settled[b])

    def keep_count(self, state: PolicyState, rows: list[int]) -> list[int]:
        """Evictable tokens each of the given rows keeps at this eviction: the schedule's
        :meth:`~beaconkv.policies.schedules.Schedule.keep` (``B_min`` under the default schedule)."""
        return [self.schedule.keep(self, state.count[b], state.settled[b]) for b in rows]

    # ------------------------------------------------------------------------------- device hooks
    def observe_prefill(self, state: PolicyState, layer_state: Any, q_pre: Tensor, positions: Tensor, valid: Tensor,
                        rows: Tensor) -> None:
        """Sees one layer's prompt queries at prefill. Default: nothing.

        A device function: the layer's observer runs it through the state's executor (compiled with the
        policy's evictions), after the cache and the query ring took the prompts.

        Args:
            state: The state.
            layer_state: ``state.layers[i]`` of the layer.
            q_pre: ``(b, heads, L, head_dim)`` pre-RoPE queries.
            positions: ``(b, L)`` their positions.
            valid: ``(b, L)`` False on padding.
            rows: ``(b,)`` the rows being prefilled.
        """

    def observe_chunk(self, state: PolicyState, layer_state: Any, q_pre: Tensor, positions: Tensor, valid: Tensor,
                      rows: Tensor) -> None:
        """Sees one layer's queries of a chunk that continues the rows' tokens (a prompt prefilled in
        chunks, a question on a compressed context). Default: nothing (the query ring takes them).

        A device function, like :meth:`observe_prefill`; the arguments are the same, ``positions``
        starting one past each row's newest.
        """

    def observe_attention(self, state: PolicyState, layer_state: Any, weights: Tensor) -> None:
        """Sees one layer's decode attention weights ``(batch, kv_heads, group, capacity)`` (with
        ``track_attention = True``), from the layer's observer after this step's query went into its ring;
        runs inside the decode step, so device ops only. Default: nothing."""

    # ------------------------------------------------------------------------------- host hooks (the driver calls them)
    def on_admit(self, state: PolicyState, rows: list[int]) -> None:
        """When rows start, after the driver reset their counters and positions. Default: nothing."""

    def on_prefill(self, state: PolicyState, rows: list[int]) -> None:
        """When the prompts of ``rows`` are written, before any eviction. Default: nothing."""

    def on_chunk(self, state: PolicyState, rows: list[int], n_new: list[int]) -> None:
        """When a chunk wrote ``n_new`` tokens in ``rows``, before any eviction. Default: nothing."""

    def on_decode_step(self, state: PolicyState, rows: list[int]) -> None:
        """When a decode step wrote a token in ``rows`` (counters advanced), before the eviction check.
        Default: nothing."""

    def before_evict(self, state: PolicyState, rows: list[int]) -> None:
        """When ``rows`` are about to be evicted, before they are scored. Default: nothing."""

    def on_evict(self, state: PolicyState, rows: list[int]) -> None:
        """When ``rows`` were evicted. Default: nothing."""

    def on_count_change(self, state: PolicyState, rows: list[int]) -> None:
        """After every change of the evictable counts (a prefill, a chunk, a decode step and its evictions).
        Default: nothing."""

    # ------------------------------------------------------------------------------- scoring
    def observed_positions(self, layer: ObservedLayer, rows: Tensor, t: Tensor) -> Tensor | None:
        """Positions of the queries used for scoring (telemetry). Default: None."""
        return None

    def score(self, layer: ObservedLayer, rows: Tensor, t: Tensor) -> Tensor:
        """Scores every cached slot of the given rows; higher = keep. A device function: read tensors only.

        Args:
            layer: The layer as the policy observes it: its cache's reads
                (:meth:`~beaconkv.policies.observer.ObservedLayer.keys`,
                :meth:`~beaconkv.policies.observer.ObservedLayer.positions`, ...), the query ring
                (:meth:`~beaconkv.policies.observer.ObservedLayer.ring`), the policy's state
                (``layer.state``) and this layer's part of it (``layer.layer_state``).
            rows: ``(b,)`` row indices being evicted.
            t: ``(b,)`` position of the newest token of each.

        Returns:
            ``(b, kv_heads, capacity)`` scores. Empty, prefix and recent slots are handled by the
            driver whatever their score.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement score()")


class FullKV(EvictionPolicy):
    """Keeps every token (the reference). The cache is sized to prompt + ``max_new_tokens``.

    Args:
        telemetry: Accepted for symmetry with the other policies (FullKV never evicts).
    """

    name: ClassVar[str] = "full"
    requires_budget: ClassVar[bool] = False

    def __init__(self, telemetry: bool = False) -> None:
        super().__init__(None, telemetry=telemetry)

    def __repr__(self) -> str:
        return "FullKV()"

    def score(self, layer: ObservedLayer, rows: Tensor, t: Tensor) -> Tensor:  # pragma: no cover
        raise RuntimeError("FullKV never evicts")
