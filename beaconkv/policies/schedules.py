"""Eviction schedules: when a policy evicts, how much an eviction keeps, and the most a sequence holds.

A policy's scorer decides *which* tokens stay; its schedule decides *when* it runs and *how many*
evictable tokens survive. The two are independent, so every scorer runs under every schedule:

.. code-block:: python

    SnapKV(1024)                                           # AtBudget (the default, SPEC §2)
    SnapKV(1024, schedule=Buffered(buffer=128))            # R-KV's schedule: back to 1024 every 128 tokens
    BeaconKV(None, schedule=Periodic(period=1024, compression=4))   # RPC's periodic compression

A schedule works on host integers per row — the evictable count (tokens past the protected prefix)
and the ``settled`` count (evictable tokens an earlier eviction already compressed, which a periodic
schedule leaves alone) — so knowing when to evict never reads the device. Its one device-side say is
:meth:`Schedule.protect`: slots it keeps whatever their score (a periodic schedule's older periods).

A schedule of one's own subclasses :class:`Schedule` (a frozen dataclass of settings, as the built-in
ones) and implements :meth:`~Schedule.evict_at`, :meth:`~Schedule.keep` and :meth:`~Schedule.peak`;
:meth:`~Schedule.check` refuses the policies it cannot serve.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch
from torch import Tensor

from .config import PolicyConfigError, check_int, parse_settings, settings_repr



class ScheduledPolicy(Protocol):
    """What a schedule reads of its policy (an :class:`~beaconkv.policies.EvictionPolicy`)."""

    budget: int | None
    n_recent: int
    ratio: float

    @property
    def b_min(self) -> int | None:
        """``floor(ratio * budget)``."""

    @property
    def uncompressed_recent(self) -> int:
        """Newest tokens a periodic schedule leaves uncompressed."""

__all__ = ["AtBudget", "Buffered", "Periodic", "Schedule", "ScheduledPolicy", "parse_schedule", "schedule_names"]


class Schedule(ABC):
    """When a policy evicts and how many evictable tokens (past the protected prefix) an eviction keeps.

    Methods take the policy (its ``budget``, ``b_min``, ``n_recent`` and
    :attr:`~beaconkv.policies.EvictionPolicy.uncompressed_recent`) and host integers per row; none
    reads the device but :meth:`protect`, which runs inside the eviction's device function.

    Attributes:
        name: The name :func:`parse_schedule` knows the schedule by.
        sizes_itself: Whether the schedule bounds the cache without a budget (the policy's ``budget``
            must then be None); False: the policy needs a budget.
    """

    name: ClassVar[str] = "schedule"
    sizes_itself: ClassVar[bool] = False

    def check(self, policy: ScheduledPolicy) -> None:
        """Refuses a policy this schedule cannot serve (called when the policy is made). Default: a
        schedule that does not size itself needs a budget (the policy checks that).

        Raises:
            PolicyConfigError: Naming the setting and the fix.
        """

    @abstractmethod
    def evict_at(self, policy: ScheduledPolicy, settled: int) -> int:
        """The evictable count at which a row evicts, given the tokens an earlier eviction settled."""

    @abstractmethod
    def keep(self, policy: ScheduledPolicy, count: int, settled: int) -> int:
        """Evictable tokens a row keeps when it evicts holding ``count`` of them."""

    def settled_after(self, policy: ScheduledPolicy, kept: int) -> int:
        """Evictable tokens an eviction that kept ``kept`` leaves settled. Default: 0 (every later
        eviction re-selects among all evictable tokens)."""
        return 0

    @abstractmethod
    def peak(self, policy: ScheduledPolicy, count: int, new_tokens: int) -> int:
        """Most evictable tokens a row holds at once, from ``count`` after its prompt and ``new_tokens`` more
        (sizes the cache)."""

    def protect(self, policy: ScheduledPolicy, pos: Tensor, t: Tensor) -> Tensor | None:
        """Slots kept whatever their score, ``(b, kv_heads, capacity)`` bool, from the slots' positions ``pos``
        and each row's newest position ``t`` ``(b,)``; a device function. Default: None (the scores decide)."""
        return None

    def __repr__(self) -> str:
        return settings_repr(self)


@dataclass(frozen=True, repr=False)
class AtBudget(Schedule):
    """SPEC §2, the default: when the evictable count reaches ``budget`` (``B_max``), evict down to
    ``B_min = floor(ratio * budget)``; the cache never holds more than ``n_prefix + budget`` tokens."""

    name: ClassVar[str] = "budget"

    def check(self, policy: ScheduledPolicy) -> None:
        if policy.budget is None:
            return
        b_min = policy.b_min
        if policy.budget - b_min < policy.n_recent or b_min < policy.n_recent:
            ratio, n_recent = policy.ratio, policy.n_recent
            need = max(math.ceil(n_recent / (1 - ratio)), math.ceil(n_recent / ratio))
            raise PolicyConfigError(
                f"budget={policy.budget} with ratio={ratio:.4g} evicts down to B_min={b_min}, which leaves "
                f"{policy.budget - b_min} < n_recent={n_recent} slots per eviction; use budget >= {need} "
                f"or a smaller n_recent."
            )

    def evict_at(self, policy: ScheduledPolicy, settled: int) -> int:
        return policy.budget

    def keep(self, policy: ScheduledPolicy, count: int, settled: int) -> int:
        return policy.b_min

    def peak(self, policy: ScheduledPolicy, count: int, new_tokens: int) -> int:
        return policy.budget


@dataclass(frozen=True, repr=False)
class Buffered(Schedule):
    """R-KV's schedule: each time the evictable count reaches ``budget + buffer``, evict back to ``budget``
    (so an eviction every ``buffer`` new tokens; the budget is the size *after* an eviction, as in the R-KV
    paper, and the cache holds up to ``n_prefix + budget + buffer``).

    Args:
        buffer: New tokens between evictions (default 128).
    """

    buffer: int = 128

    name: ClassVar[str] = "buffered"

    def __post_init__(self) -> None:
        check_int("buffer", self.buffer, 1, hint="(new tokens between evictions; default 128)")

    def check(self, policy: ScheduledPolicy) -> None:
        if policy.budget is not None and policy.budget < policy.n_recent:
            raise PolicyConfigError(f"Buffered keeps budget={policy.budget} evictable tokens, fewer than "
                                    f"n_recent={policy.n_recent}; use budget >= {policy.n_recent}.")

    def evict_at(self, policy: ScheduledPolicy, settled: int) -> int:
        return policy.budget + self.buffer

    def keep(self, policy: ScheduledPolicy, count: int, settled: int) -> int:
        return policy.budget

    def peak(self, policy: ScheduledPolicy, count: int, new_tokens: int) -> int:
        return policy.budget + self.buffer


@dataclass(frozen=True, repr=False)
class Periodic(Schedule):
    """RPC's periodic compression: whenever ``period`` tokens have arrived since the last compression
    (counting the ``R`` recent tokens it left uncompressed, ``R =`` the policy's
    :attr:`~beaconkv.policies.EvictionPolicy.uncompressed_recent`), the newest ``period`` tokens are
    compacted: their last ``R`` stay, and ``period // compression`` of the others are kept by score.
    Older, already compressed tokens stay untouched, so the cache grows by ``period // compression``
    per period; the policy's ``budget`` must be None (the schedule sizes the cache for the whole
    generation). ``reselect=True`` instead re-selects among *all* evictable tokens but the last ``R``
    (keeping as many as the period rule), as RPC's reference code does.

    Args:
        period: P, new tokens per compression (default 1024; RPC's paper also uses 4096).
        compression: c, the kept share ``1/c`` of a period (default 4).
        reselect: Re-select over every evictable token instead of the newest period only (default False).
    """

    period: int = 1024
    compression: int = 4
    reselect: bool = False

    name: ClassVar[str] = "periodic"
    sizes_itself: ClassVar[bool] = True

    def __post_init__(self) -> None:
        check_int("period", self.period, 1, hint="(default 1024)")
        check_int("compression", self.compression, 1, hint="(default 4)")
        if not isinstance(self.reselect, bool):
            raise PolicyConfigError(f"reselect={self.reselect!r} must be True or False.")

    @property
    def kept_per_period(self) -> int:
        """``period // compression``: tokens a compression keeps out of a period (besides the recent)."""
        return self.period // self.compression

    def check(self, policy: ScheduledPolicy) -> None:
        if policy.budget is not None:
            raise PolicyConfigError(
                f"Periodic sizes the cache from period={self.period} and compression={self.compression}; "
                f"pass budget=None instead of budget={policy.budget}."
            )
        recent, kept = policy.uncompressed_recent, self.kept_per_period
        if kept < 1 or self.period < recent + kept:
            raise PolicyConfigError(
                f"period={self.period} must hold the {recent} uncompressed recent tokens (the policy's "
                f"uncompressed_recent) plus at least period // compression={kept} >= 1 kept tokens; use "
                f"period >= {recent + max(1, kept)} or a smaller compression/window."
            )

    def evict_at(self, policy: ScheduledPolicy, settled: int) -> int:
        return settled + self.period

    def keep(self, policy: ScheduledPolicy, count: int, settled: int) -> int:
        return count - self.period + self.kept_per_period + policy.uncompressed_recent

    def settled_after(self, policy: ScheduledPolicy, kept: int) -> int:
        return kept - policy.uncompressed_recent

    def peak(self, policy: ScheduledPolicy, count: int, new_tokens: int) -> int:
        """Host arithmetic, one loop iteration per compression."""
        P, T, R = self.period, self.kept_per_period, policy.uncompressed_recent
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

    def protect(self, policy: ScheduledPolicy, pos: Tensor, t: Tensor) -> Tensor:
        keep = pos > (t - policy.uncompressed_recent)[:, None, None]  # left uncompressed, as RPC's last R
        if not self.reselect:  # compact the newest period only
            keep |= pos <= (t - self.period)[:, None, None]
        return keep


_SCHEDULES: dict[str, type[Schedule]] = {cls.name: cls for cls in (AtBudget, Buffered, Periodic)}


def schedule_names() -> list[str]:
    """The names :func:`parse_schedule` knows."""
    return sorted(_SCHEDULES)


def parse_schedule(spec: str | Schedule) -> Schedule:
    """A schedule from its name and settings, as the command line's ``--policy-arg schedule=...`` gives it:
    ``"budget"``, ``"buffered:buffer=128"``, ``"periodic:period=1024,compression=4,reselect=true"``.

    Args:
        spec: ``name[:key=value,...]`` (values are ints, or ``true``/``false``), or a schedule (returned);
            see :func:`~beaconkv.policies.config.parse_settings`.

    Raises:
        PolicyConfigError: An unknown name or setting, or a value the schedule refuses.
    """
    return parse_settings("schedule", spec, Schedule, _SCHEDULES, "periodic:period=1024,compression=4")


def protected_scores(schedule: Schedule, policy: ScheduledPolicy, scores: Tensor, pos: Tensor, t: Tensor) -> Tensor:
    """``scores`` with the slots the schedule protects raised to ``+inf`` (a device function's step)."""
    keep = schedule.protect(policy, pos, t)
    return scores if keep is None else torch.where(keep, torch.inf, scores)
