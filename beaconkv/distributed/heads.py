"""Eviction under tensor parallelism: each rank evicts its own KV heads; only allocations across heads talk.

Every policy scores and keeps tokens per KV head, and a rank's model has only its KV heads
(:mod:`beaconkv.distributed.plan`), so a rank's cache, :class:`~beaconkv.policies.PolicyDriver` and
policy see exactly those heads and evict them as the single process evicts the same heads — with no
communication: the scores of a head depend only on that head's keys and its GQA group's queries, which
live on the rank (a replicated KV head's replicas hold the whole group). The schedule's decisions are
host integers counted from the tokens every rank is given (rank 0 broadcasts them), so every rank
evicts at the same steps, with the same keep counts, by construction.

Three things need the other ranks:

* :class:`~beaconkv.policies.HeadAdaptive` splits a layer's total between *all* its KV heads by score;
  :class:`RankHeads` (its ``heads`` exchange, :class:`~beaconkv.policies.allocation.HeadExchange`)
  all-gathers the ranking keys of every head — the only per-head scores the split reads — splits for the
  whole layer on every rank, and keeps the rank's own heads' counts. :func:`for_rank` installs it. Heads
  then keep different counts, and a row's next token goes after the *fullest head of the layer*
  (:class:`~beaconkv.cache.LayerKVCache`'s ``length``): the rank's cache learns that length from the
  other ranks (:meth:`RankHeads.row_length`, one all-reduce of ``(rows,)`` integers per layer and
  eviction; :func:`attach` installs it), so its slots match the single process's — a scorer that pools
  over neighbouring slots (SnapKV's ``kernel``) would otherwise see other neighbours;
* :class:`~beaconkv.policies.Shared` keeps the same positions in every head of a layer, ranked by the
  scores averaged over all of them: the same :class:`RankHeads` all-gathers every head's scores (one
  ``(b, kv_heads, C)`` gather per layer and eviction) and every rank averages them as one process does;
  counts stay uniform, so no row length is exchanged;
* a policy option that averages over all the heads of a layer inside its scorer (``TOVA``/``RPC`` with
  ``group_reduce="all_heads"``) reads query heads other ranks hold: :func:`for_rank` refuses it, naming
  the option and ``allocation="shared"``, which gives those policies the same kept sets under TP.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

from torch import Tensor

from ..cache import KVCache
from ..policies.allocation import HeadAdaptive, Shared
from ..policies.base import EvictionPolicy
from .group import TensorParallel, TensorParallelError
from .plan import ShardPlan

__all__ = ["RankHeads", "attach", "for_rank"]


@dataclass(frozen=True)
class RankHeads:
    """A rank's KV heads among the layer's: the :class:`~beaconkv.policies.allocation.HeadExchange` of a
    head-adaptive or shared allocation under tensor parallelism.

    Args:
        tp: The group.
        plan: The rank's plan (its KV heads; replicas of a KV head count once).
    """

    tp: TensorParallel
    plan: ShardPlan

    def gather(self, key: Tensor) -> Tensor:
        """``(b, local_kv, C)`` -> ``(b, kv_heads, C)``: every rank's heads in the model's order, a replicated
        head once (its first replica's copy; the replicas hold the same)."""
        every = self.tp.all_gather(key.contiguous(), 1, self.plan.kv_head_counts)  # (b, sum of the ranks' heads, C)
        if self.plan.replicas == 1:
            return every
        return every[:, ::self.plan.replicas]  # one head per rank: the first replica of each KV head

    def local(self, counts: Tensor) -> Tensor:
        """``(b, kv_heads)`` -> ``(b, local_kv)``: this rank's heads."""
        heads = self.plan.kv_heads
        return counts[:, heads.start:heads.stop]

    def row_length(self, counts: Tensor) -> Tensor:
        """``(b, local_kv)`` kept counts -> ``(b,)`` each row's fullest head over every rank (a compaction's
        new length: :attr:`~beaconkv.cache.LayerKVCache.row_length`)."""
        return self.tp.all_reduce(counts.amax(-1).contiguous(), "max")


def _cross_head_options(policy: EvictionPolicy) -> list[str]:
    """The settings of ``policy`` that reduce over every head of a layer (not supported under TP)."""
    if getattr(policy, "group_reduce", None) == "all_heads":
        return [f"group_reduce={policy.group_reduce!r}"]
    return []


def for_rank(policy: EvictionPolicy, tp: TensorParallel, plan: ShardPlan) -> EvictionPolicy:
    """The policy a rank runs: ``policy`` itself, or a copy whose head-adaptive or shared allocation gathers
    the heads of the other ranks (:class:`RankHeads`).

    Args:
        policy: The policy (settings; not changed).
        tp: The rank's group.
        plan: The rank's plan.

    Raises:
        TensorParallelError: A setting that averages scores over every head of a layer
            (``group_reduce="all_heads"``), which per-rank eviction cannot honour without exchanging
            every score at every eviction.
    """
    odd = _cross_head_options(policy)
    if odd and tp.size > 1:
        raise TensorParallelError(
            f"{type(policy).__name__} with {', '.join(odd)} averages scores over every head of a layer, which "
            "tensor parallelism splits between ranks; use group_reduce='mean' with allocation='shared' (every "
            "head keeps the positions the layer's average ranks first, the same kept sets), or "
            "tensor_parallel_size=1.")
    if not isinstance(getattr(policy, "allocation", None), (HeadAdaptive, Shared)) or tp.size == 1:
        return policy
    mine = copy.copy(policy)
    mine.allocation = dataclasses.replace(policy.allocation, heads=RankHeads(tp, plan))  # type: ignore[attr-defined]
    return mine


def _adaptive(policy: EvictionPolicy) -> bool:
    return isinstance(getattr(policy, "allocation", None), HeadAdaptive)


def attach(cache: KVCache, policy: EvictionPolicy, tp: TensorParallel, plan: ShardPlan) -> None:
    """Makes a rank's freshly allocated cache set each row's length after a compaction from the fullest head of
    the whole layer (:meth:`RankHeads.row_length`), when ``policy`` splits by head (otherwise every head keeps
    the same count and the rank's own heads say it). Call it before the first prefill."""
    if _adaptive(policy) and tp.size > 1:
        for i in range(len(cache)):
            cache[i].row_length = RankHeads(tp, plan).row_length
