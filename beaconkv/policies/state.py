"""A policy's state for one cache, as explicit tensors (device) and integers (host schedule).

:meth:`EvictionPolicy.create_state <beaconkv.policies.base.EvictionPolicy.create_state>` makes one
per cache (a generation, a slot pool, a fidelity run). Everything a policy remembers between steps
lives here, never on the policy object, which holds only its settings — so one policy object can
serve many caches at once, and an execution strategy can hand the state to compiled graphs.

Two mirrors of the schedule, kept in step:

* **host** integers per row (evictable count, newest position, protected prefix, whether the row
  decodes): the schedule is decided from them, so *when* to evict never needs a device read;
* **device** tensors per row (newest position, prefix length...), updated by device ops only, so
  the values device functions need never cross from the host in the decode loop. Where a host
  value must reach the device (ragged rows, per-row keep counts), it goes through pinned memory
  with ``non_blocking=True`` (:meth:`PolicyState.to_device`): no stream synchronisation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..cache import KVCache
from ..execution import EagerExecutor, Executor


@dataclass
class EvictionRecord:
    """Telemetry of one eviction of one layer.

    Attributes:
        step: Decode step (0 = right after prefill).
        layer: Layer index.
        rows: Batch indices that were evicted.
        kept_positions: ``(len(rows), kv_heads, K)`` kept positions (``-1`` = padding), on CPU.
        observed_positions: Positions of the queries the policy scored with, ``(len(rows), n)`` (``-1`` = unused).
    """

    step: int
    layer: int
    rows: list[int]
    kept_positions: Tensor
    observed_positions: Tensor | None = None


@dataclass
class PolicyStats:
    """Counters of one policy state.

    Attributes:
        evictions: Evictions per row (reset when a row is admitted).
        eviction_calls: Evictions run (one may cover several rows).
        eviction_seconds: Host wall time spent inside eviction (scoring + compaction).
        telemetry: Per-eviction records when the policy's ``telemetry`` is on.
    """

    evictions: list[int] = field(default_factory=list)
    eviction_calls: int = 0
    eviction_seconds: float = 0.0
    telemetry: list[EvictionRecord] = field(default_factory=list)


@dataclass(eq=False)
class PolicyState:
    """The state of one policy over one cache (subclassed by policies that keep more).

    Attributes:
        cache: The cache the state belongs to.
        rope: The model's rotary module (re-rotates stored pre-RoPE queries).
        executor: Runs the policy's device functions (eagerly or compiled).
        count: Host, per row: evictable tokens held.
        settled: Host, per row: evictable tokens an earlier eviction compressed, which the schedule leaves
            alone (0 unless the schedule is periodic; see :meth:`~beaconkv.policies.schedules.Schedule.settled_after`).
        t: Host, per row: position of the newest token.
        prefix: Host, per row: protected prefix length.
        live: Host, per row: whether the row decodes (admitted and not released).
        t_dev: Device ``(batch,)``: position of the newest token.
        prefix_dev: Device ``(batch,)``: protected prefix length.
        all_rows: Device ``(batch,)``: ``arange(batch)``, the index of a full-batch operation.
        active: Device ``(batch,)`` bool: the rows that decode — the cache's own mask (the same tensor), which
            the state writes (:meth:`~beaconkv.policies.EvictionPolicy.admit`, ``release``) and device
            functions read here, never through the cache object.
        layers: Per-layer state of the policy (its own objects, e.g. views into stacked tensors; None
            for a policy without any); a device function receives ``layers[i]`` for layer ``i``.
        observers: One :class:`~beaconkv.policies.observer.ObservedLayer` per layer: what attention reports
            to (hand them to the model's prefill and decode steps) and what device functions receive as
            the layer (``observers[i]`` for layer ``i``).
        stats: Counters.
        step: Decode steps run.
        peak_tokens: Most tokens any row held.
    """

    cache: KVCache
    rope: Any
    executor: Executor
    count: list[int]
    t: list[int]
    prefix: list[int]
    live: list[bool]
    t_dev: Tensor
    prefix_dev: Tensor
    all_rows: Tensor
    active: Tensor
    layers: list[Any]
    stats: PolicyStats
    settled: list[int] = field(default_factory=list)
    observers: list[Any] = field(default_factory=list)
    step: int = 0
    peak_tokens: int = 0

    @classmethod
    def allocate(cls, cache: KVCache, rope: Any, executor: Executor | None = None, **fields: Any) -> PolicyState:
        """An empty state for every row of ``cache`` (no row admitted yet).

        Args:
            cache: The cache.
            rope: The model's rotary module.
            executor: Runs device functions (default: eagerly).
            **fields: Values of a subclass's own fields.
        """
        B, device = cache.batch, cache.device
        return cls(
            cache=cache, rope=rope, executor=executor or EagerExecutor(), count=[0] * B, settled=[0] * B, t=[-1] * B,
            prefix=[0] * B, live=[False] * B, t_dev=torch.full((B,), -1, dtype=torch.long, device=device),
            prefix_dev=torch.zeros(B, dtype=torch.long, device=device), all_rows=torch.arange(B, device=device), active=cache.active,
            layers=[None] * len(cache), stats=PolicyStats(evictions=[0] * B), **fields,
        )

    @property
    def positions(self) -> Tensor:
        """``(batch,)`` the position each row's next token takes (``t_dev + 1``): what a decode step writes.

        The state is the one owner of the rows' positions (host :attr:`t`, device :attr:`t_dev`, advanced by
        the policy after each step) and, through :meth:`~beaconkv.policies.EvictionPolicy.admit` and
        :meth:`~beaconkv.policies.EvictionPolicy.release`, of the cache's ``active`` mask; the session
        and the decode step read them."""
        return self.t_dev + 1

    @property
    def batch(self) -> int:
        """Rows of the cache."""
        return len(self.count)

    @property
    def device(self) -> torch.device:
        """Where the tensors live."""
        return self.all_rows.device

    def live_rows(self) -> list[int]:
        """The rows that decode, ascending."""
        return [b for b, on in enumerate(self.live) if on]

    def to_device(self, values: list[int]) -> Tensor:
        """A ``(len(values),)`` int64 device tensor, without blocking the host.

        Equal values become a device fill (no copy); others are copied from pinned memory with
        ``non_blocking=True`` on CUDA (no stream synchronisation).
        """
        if values and all(v == values[0] for v in values):
            return torch.full((len(values),), values[0], dtype=torch.long, device=self.device)
        pinned = self.device.type == "cuda"
        host = torch.tensor(values, dtype=torch.long, pin_memory=pinned)
        return host.to(self.device, non_blocking=pinned)

    def index(self, rows: list[int]) -> Tensor:
        """Device index of some rows: :attr:`all_rows` itself when they are all, in order."""
        if len(rows) == self.batch and rows == list(range(self.batch)):
            return self.all_rows
        return self.to_device(rows)

    def tensors(self) -> Iterator[Tensor]:
        """Every tensor the state holds (its own fields and its observers', through lists and dataclasses; not
        the cache's)."""
        skip = {"cache", "rope", "executor", "stats"}
        for f in dataclasses.fields(self):
            if f.name not in skip:
                yield from _walk(getattr(self, f.name))


def _walk(obj: Any) -> Iterator[Tensor]:
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _walk(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _walk(x)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _walk(getattr(obj, f.name))
    elif callable(getattr(obj, "tensors", None)):  # an observer: its ring and slot buffers
        yield from obj.tensors()
