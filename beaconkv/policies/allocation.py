"""Budget allocation across the KV heads of a layer: every head the same share (its own positions, or the layer's
shared ones), or shares that follow the scores.

A policy's scorer decides *which* tokens stay and its schedule *when* and *how many* per sequence; its
allocation decides how that many are split between the KV heads of a layer. Like a schedule, it is an
object any scoring policy takes:

.. code-block:: python

    SnapKV(128)                                             # Uniform (the default): every head keeps B_min
    SnapKV(128, allocation=Shared())                        # every head keeps the same positions
    SnapKV(128, allocation=HeadAdaptive())                  # AdaKV's rule: the layer's total, split by score
    make_policy("beacon", budget=128, allocation="head_adaptive:floor=0.2,headroom=8")

**Memory is unchanged.** The cache stays one dense block of ``n_prefix + budget`` slots per (sequence, KV
head). Under :class:`HeadAdaptive` a head may keep up to ``headroom`` evictable tokens more than the
average ``B_min`` (and others fewer); every eviction keeps exactly the layer's uniform total,
``kv_heads x (n_prefix + B_min)``, and the host counts the fullest head's worst case, so the next
eviction comes ``headroom`` tokens sooner (``budget - B_min - headroom`` new tokens apart instead of
``budget - B_min``). A head that kept fewer than the fullest leaves empty slots (position ``-1``)
below the row's length; attention masks them like any empty slot. The price of adaptivity is paid in
eviction frequency, never in memory.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import torch
from torch import Tensor

from .config import PolicyConfigError, check_int, check_number, parse_settings, settings_repr
from .schedules import Schedule
from .selection import EMPTY

__all__ = ["Allocation", "HeadAdaptive", "HeadExchange", "Shared", "Uniform", "allocation_names", "parse_allocation"]


class AllocatedPolicy(Protocol):
    """What an allocation reads of its policy (an :class:`~beaconkv.policies.EvictionPolicy`)."""

    budget: int | None
    n_recent: int
    schedule: Schedule


class HeadExchange(Protocol):
    """How a layer's KV heads meet when they are spread over processes (tensor parallelism: each rank holds
    some heads; :class:`beaconkv.distributed.heads.RankHeads`). An allocation that compares heads gathers
    what it needs of every head, decides for all of them, and keeps its own heads' part."""

    def gather(self, key: Tensor) -> Tensor:
        """``(b, local_kv_heads, C)`` -> ``(b, kv_heads, C)``: every head of the layer, in the model's order."""

    def local(self, counts: Tensor) -> Tensor:
        """``(b, kv_heads)`` -> ``(b, local_kv_heads)``: this process's heads."""


class Allocation(ABC):
    """How an eviction's per-sequence keep count is split between the KV heads of a layer.

    Attributes:
        name: The name :func:`parse_allocation` knows the allocation by.
        adaptive: Whether heads may keep different counts (False: every head keeps the same, and the
            eviction's device function is the uniform one).
    """

    name: ClassVar[str] = "allocation"
    adaptive: ClassVar[bool] = False

    def check(self, policy: AllocatedPolicy) -> None:
        """Refuses a policy this allocation cannot serve (called when the policy is made). Default: any.

        Raises:
            PolicyConfigError: Naming the setting and the fix.
        """

    def extra_slots(self, policy: AllocatedPolicy, keep: int) -> int:
        """Evictable slots the fullest head may hold above ``keep``, the per-head average (host-known, so the
        schedule needs no device read). Default: 0."""
        return 0

    def head_scores(self, scores: Tensor) -> Tensor:
        """The scores each KV head ranks its slots by; a device function. Default: the head's own.

        Args:
            scores: ``(b, kv_heads, C)`` the policy's scores, one row of slots per KV head.
        """
        return scores

    @abstractmethod
    def head_counts(self, policy: AllocatedPolicy, key: Tensor, n_prefix: Tensor, keep: int) -> Tensor:
        """Slots each KV head keeps at this eviction; a device function (static shapes, no host read).

        Args:
            policy: The policy.
            key: ``(b, kv_heads, C)`` the ranking key of :func:`~beaconkv.policies.selection.ranking_key`
                (``+inf`` protected, :data:`~beaconkv.policies.selection.EMPTY` empty).
            n_prefix: ``(b,)`` protected prefix lengths.
            keep: Evictable tokens a head keeps on average (``B_min`` under the default schedule).

        Returns:
            ``(b, kv_heads)`` long: slots (prefix included) each head keeps.
        """

    def __repr__(self) -> str:
        return settings_repr(self)


@dataclass(frozen=True, repr=False)
class Uniform(Allocation):
    """Every KV head keeps the same count (SPEC §2; the default)."""

    name: ClassVar[str] = "uniform"

    def head_counts(self, policy: AllocatedPolicy, key: Tensor, n_prefix: Tensor, keep: int) -> Tensor:
        return (n_prefix + keep)[:, None].expand(-1, key.shape[1])


@dataclass(frozen=True, repr=False)
class Shared(Uniform):
    """Every KV head of a layer keeps the same positions: the slots ranked by the policy's scores averaged over
    the layer's KV heads (beyond SPEC, which keeps one set per KV head).

    What TOVA's reference does with ``group_reduce="all_heads"``, made a setting of every scoring policy.
    A fact a few heads attend to (a number, a name) then stays in every head, so heads that read it later
    (the copy of its next token) still find it: in the accuracy suite's passkey at 4x, TOVA keeps the number in
    8 of 10 cases with a shared set and 1 of 10 with per-head sets (docs/benchmarks.md, "Outcomes"). Memory
    and counts are the uniform allocation's (its ``head_counts``): each head keeps ``n_prefix + B_min``; the
    slots of all heads hold the same positions from the prefill on, so the scores of one slot index, averaged,
    are one position's.

    Args:
        heads: Where the layer's other KV heads are (tensor parallelism: their scores are gathered before the
            average, so every rank keeps what one process would); None (default): every head is here. Not a
            setting: not shown, not compared, and refused from a text spec.

    Raises:
        PolicyConfigError: ``heads`` that is not an exchange.
    """

    heads: HeadExchange | None = field(default=None, repr=False, compare=False)

    name: ClassVar[str] = "shared"

    def __post_init__(self) -> None:
        _check_exchange(self.heads)

    def head_scores(self, scores: Tensor) -> Tensor:
        whole = scores if self.heads is None else self.heads.gather(scores)
        return whole.mean(1, keepdim=True).expand_as(scores)


def _check_exchange(heads: object) -> None:
    if heads is not None and not (hasattr(heads, "gather") and hasattr(heads, "local")):
        raise PolicyConfigError(f"heads={heads!r} is not a setting: it is the exchange tensor parallelism "
                                "installs (an object with gather and local); leave it out.")


@dataclass(frozen=True, repr=False)
class HeadAdaptive(Allocation):
    """AdaKV's rule (Feng et al., 2024): the layer's total keep count is fixed, its split between KV heads
    follows the scores.

    At each eviction, per sequence and layer, with ``keep`` the per-head average (``B_min``):

    1. every head first keeps its ``max(n_recent, ceil(floor * keep))`` best evictable slots and its
       protected ones (the safeguard: no head starves);
    2. the rest of the layer's total, ``kv_heads x keep`` evictable slots, goes to the best remaining
       slots of *all* heads together, ranked by score, a head taking at most ``keep + headroom``
       evictable slots in all (equal scores: the lower head first);
    3. each head then keeps its slots as usual (prefix, recent, best-scored, in position order).

    Scores are compared across heads, so the rule suits scorers whose scores share a scale across heads
    (attention shares: SnapKV, BeaconKV, H2O, TOVA, ExpectedAttention); KNorm's raw norms, for one, give
    the split to the head with the smallest keys.

    Args:
        floor: Share of the average a head keeps whatever the scores, in [0, 1] (default 0.2, AdaKV's
            safeguard).
        headroom: Evictable slots a head may keep above the average; None (default): half the schedule's
            gap between evictions (``(budget - B_min) // 2``: 8 at budget 128), so evictions come at most
            twice as often. Must leave at least one new token between evictions.
        heads: Where the layer's other KV heads are (tensor parallelism: the ranks' heads, gathered before
            the split and cut back after it, so every rank splits exactly as one process would); None (default):
            every head is here. Not a setting: not shown, not compared, and refused from a text spec.

    Raises:
        PolicyConfigError: A floor outside [0, 1], a negative headroom, one that leaves no room for new
            tokens, or a schedule whose keep count varies (``Periodic``).
    """

    floor: float = 0.2
    headroom: int | None = None
    heads: HeadExchange | None = field(default=None, repr=False, compare=False)

    name: ClassVar[str] = "head_adaptive"
    adaptive: ClassVar[bool] = True

    def __post_init__(self) -> None:
        check_number("floor", self.floor, 0.0, 1.0, hint="(the share of the average every head keeps; default 0.2)")
        check_int("headroom", self.headroom, 0, optional=True,
                  hint="(evictable slots a head may keep above the average; None: half the eviction gap)")
        _check_exchange(self.heads)

    def check(self, policy: AllocatedPolicy) -> None:
        if policy.schedule.sizes_itself or policy.budget is None:
            raise PolicyConfigError(
                f"allocation=head_adaptive needs a budget and a schedule that keeps a fixed count "
                f"(AtBudget or Buffered), not schedule={policy.schedule!r} with budget={policy.budget}; "
                "use allocation='uniform' there."
            )
        keep = policy.schedule.keep(policy, policy.budget, 0)  # type: ignore[arg-type]
        gap = policy.schedule.evict_at(policy, 0) - keep  # type: ignore[arg-type]
        room = self.slots_above(gap)
        if room >= gap:
            raise PolicyConfigError(
                f"headroom={self.headroom} leaves no new token between evictions (the schedule evicts "
                f"{gap} tokens after keeping {keep}); use headroom <= {gap - 1}."
            )

    def slots_above(self, gap: int) -> int:
        """The headroom for a schedule that evicts ``gap`` new tokens after each eviction."""
        return gap // 2 if self.headroom is None else self.headroom

    def extra_slots(self, policy: AllocatedPolicy, keep: int) -> int:
        return self.slots_above(policy.schedule.evict_at(policy, 0) - keep)  # type: ignore[arg-type]

    def floor_count(self, policy: AllocatedPolicy, keep: int) -> int:
        """Evictable slots every head keeps whatever the scores: ``min(keep, max(n_recent, ceil(floor * keep)))``."""
        return min(keep, max(policy.n_recent, math.ceil(self.floor * keep)))

    def head_counts(self, policy: AllocatedPolicy, key: Tensor, n_prefix: Tensor, keep: int) -> Tensor:
        if self.heads is not None:  # the layer's heads live on several processes
            return self.heads.local(self._split(policy, self.heads.gather(key), n_prefix, keep))
        return self._split(policy, key, n_prefix, keep)

    def _split(self, policy: AllocatedPolicy, key: Tensor, n_prefix: Tensor, keep: int) -> Tensor:
        B, H, C = key.shape
        ranked = torch.sort(key, dim=-1, descending=True, stable=True).values  # (b, kv, C), best first
        ranks = torch.arange(C, device=key.device)[None, None, :]
        first = ranks < (n_prefix + self.floor_count(policy, keep))[:, None, None]
        ceiling = ranks < (n_prefix + keep + self.extra_slots(policy, keep))[:, None, None]
        base = (first & (ranked > EMPTY)).sum(-1)  # (b, kv): the safeguard's slots
        rest = (n_prefix + keep) * H - base.sum(-1)  # (b,): the layer's remaining slots
        pool = torch.where(~first & ceiling, ranked, EMPTY).flatten(1)  # (b, kv * C)
        order = torch.argsort(pool, dim=-1, descending=True, stable=True)
        chosen = torch.arange(H * C, device=key.device)[None, :] < rest[:, None]
        taken = torch.zeros_like(pool, dtype=torch.bool).scatter(-1, order, chosen.expand_as(pool)) & (pool > EMPTY)
        return base + taken.view(B, H, C).sum(-1)


_ALLOCATIONS: dict[str, type[Allocation]] = {cls.name: cls for cls in (Uniform, Shared, HeadAdaptive)}


def allocation_names() -> list[str]:
    """The names :func:`parse_allocation` knows."""
    return sorted(_ALLOCATIONS)


def parse_allocation(spec: str | Allocation) -> Allocation:
    """An allocation from its name and settings, as ``--policy-arg allocation=...`` gives it: ``"uniform"``,
    ``"head_adaptive"``, ``"head_adaptive:floor=0.2,headroom=8"``.

    Args:
        spec: ``name[:key=value,...]`` (numbers), or an allocation (returned).

    Raises:
        PolicyConfigError: An unknown name or setting, or a value the allocation refuses.
    """
    return parse_settings("allocation", spec, Allocation, _ALLOCATIONS, "head_adaptive:floor=0.2")
