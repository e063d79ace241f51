"""Eviction under tensor parallelism, in one process: a head-adaptive split over the ranks' heads equals the
whole layer's split, replicas counted once; the policy each rank runs; the caches' row lengths."""

from __future__ import annotations

import pytest
import torch

from beaconkv import RPC, TOVA, BeaconKV, HeadAdaptive, KVCache, Shared, SnapKV
from beaconkv.distributed import RankHeads, ShardPlan, TensorParallelError, for_rank
from beaconkv.distributed.heads import attach
from beaconkv.models.config import ModelConfig
from beaconkv.policies.selection import EMPTY


def config(heads: int, kv: int) -> ModelConfig:
    return ModelConfig("llama", vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=heads, num_key_value_heads=kv, head_dim=16)


class OneRankOf:
    """Rank ``rank`` of a group whose ranks' tensors are all known here: a collective returns what the real
    one would, from every rank's part of a whole-layer tensor (so one process checks every rank's result)."""

    def __init__(self, plans: list[ShardPlan], rank: int, whole: torch.Tensor) -> None:
        self.plans, self.rank, self.size, self.whole = plans, rank, len(plans), whole

    def part(self, r: int, t: torch.Tensor) -> torch.Tensor:
        heads = self.plans[r].kv_heads
        return t[:, heads.start:heads.stop]

    def all_gather(self, x: torch.Tensor, dim: int, lengths: list[int] | None = None) -> torch.Tensor:
        assert dim == 1 and torch.equal(x, self.part(self.rank, self.whole))
        assert lengths is None or lengths == [len(p.kv_heads) for p in self.plans]
        return torch.cat([self.part(r, self.whole) for r in range(self.size)], dim)

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        assert op == "max"
        return torch.stack([self.part(r, self.whole).amax(-1) for r in range(self.size)]).amax(0)


def ranking_keys(b: int, kv: int, capacity: int, seed: int) -> torch.Tensor:
    """Scores with protected (+inf) and empty slots, as :func:`~beaconkv.policies.selection.ranking_key` gives."""
    g = torch.Generator().manual_seed(seed)
    key = torch.rand(b, kv, capacity, generator=g)
    key[..., :2] = float("inf")  # a protected prefix
    key[..., -3:] = EMPTY  # empty slots
    return key


@pytest.mark.parametrize(("heads", "kv", "size"), [(8, 4, 2), (8, 4, 4), (8, 2, 4), (4, 1, 2), (8, 8, 2), (9, 3, 2)])
def test_head_adaptive_split_over_ranks_equals_the_whole_layers(heads, kv, size):
    policy = SnapKV(16, allocation=HeadAdaptive())
    plans = [ShardPlan(config(heads, kv), size, r) for r in range(size)]
    n_prefix, keep = torch.tensor([2, 2, 2]), 14
    differs = False  # whether a rank splitting its own heads alone would have split otherwise (the exchange matters)
    for seed in range(5):
        key = ranking_keys(3, kv, 24, seed)
        whole = policy.allocation.head_counts(policy, key, n_prefix, keep)  # (b, kv)
        assert torch.equal(whole.sum(-1), (n_prefix + keep) * kv)  # the layer's total, split unevenly
        for r, plan in enumerate(plans):
            tp = OneRankOf(plans, r, key)
            mine = for_rank(policy, tp, plan)
            got = mine.allocation.head_counts(mine, tp.part(r, key), n_prefix, keep)
            assert torch.equal(got, tp.part(r, whole)), (seed, r)
            alone = policy.allocation.head_counts(policy, tp.part(r, key), n_prefix, keep)
            differs |= not torch.equal(alone, got)
    assert differs == (len(plans[0].kv_heads) < kv)


def test_for_rank_copies_only_a_policy_whose_allocation_exchanges_heads_and_refuses_all_heads_averages():
    plans = [ShardPlan(config(8, 4), 2, r) for r in range(2)]
    tp = OneRankOf(plans, 1, torch.zeros(1, 4, 1))
    uniform = BeaconKV(16)
    assert for_rank(uniform, tp, plans[1]) is uniform
    adaptive = BeaconKV(16, allocation=HeadAdaptive(floor=0.3))
    mine = for_rank(adaptive, tp, plans[1])
    assert mine is not adaptive and adaptive.allocation.heads is None  # the caller's policy is unchanged
    assert isinstance(mine.allocation.heads, RankHeads) and mine.allocation == adaptive.allocation
    assert repr(mine.allocation) == "HeadAdaptive(floor=0.3)"
    shared = TOVA(16, allocation=Shared())
    mine = for_rank(shared, tp, plans[1])
    assert isinstance(mine.allocation.heads, RankHeads) and shared.allocation.heads is None
    for policy in (TOVA(16, group_reduce="all_heads"), RPC(16, group_reduce="all_heads")):
        with pytest.raises(TensorParallelError, match="group_reduce='all_heads' averages scores over every head"
                           ".*allocation='shared'"):
            for_rank(policy, tp, plans[1])


def test_attach_gives_each_row_the_fullest_head_of_the_whole_layer():
    plans = [ShardPlan(config(8, 4), 2, r) for r in range(2)]
    counts = torch.tensor([[3, 5, 9, 2], [4, 4, 1, 1]])  # (rows, kv_heads): the whole layer's kept counts
    cache = KVCache.allocate(2, batch=2, n_kv_heads=2, n_heads=4, capacity=12, head_dim=16)
    attach(cache, BeaconKV(16), OneRankOf(plans, 0, counts), plans[0])
    assert cache[0].row_length is None  # a uniform split: every head keeps the same
    attach(cache, BeaconKV(16, allocation=HeadAdaptive()), OneRankOf(plans, 0, counts), plans[0])
    assert torch.equal(cache[1].row_length(counts[:, :2]), torch.tensor([9, 4]))  # rank 0 alone would say 5, 4
