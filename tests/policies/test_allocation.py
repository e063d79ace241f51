"""Allocations across the KV heads of a layer, an option of any scoring policy. Head-adaptive budgets (AdaKV's
rule): the layer's total is the uniform one at every eviction, every head keeps at least its floor and at most
its ceiling, memory is unchanged, and the split follows the scores (a hand-built cache where one head's scores
are all higher). Shared: every head keeps the same positions, the ones the layer's average score ranks first."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from beaconkv.policies import TOVA, HeadAdaptive, Shared, Uniform, make_policy, parse_allocation
from beaconkv.policies.config import PolicyConfigError
from beaconkv.policies.schedules import Buffered, Periodic

from .driver import drive, drive_hand

pytestmark = pytest.mark.usefixtures("one_thread")

SCORERS = ["beacon", "snapkv", "h2o", "tova", "expected_attention", "keydiff", "knorm", "lazy_eviction", "rkv",
           "triattention"]


@st.composite
def cases(draw):
    name = draw(st.sampled_from(SCORERS))
    n_recent = draw(st.integers(1, 4))
    budget = draw(st.integers(8 * n_recent + 8, 48))
    floor = draw(st.sampled_from([0.0, 0.2, 0.5, 1.0]))
    policy = make_policy(name, budget=budget, n_recent=n_recent, n_prefix=draw(st.sampled_from([None, 2])),
                         allocation=HeadAdaptive(floor=floor), **({"window": 4} if name in ("snapkv", "rkv", "expected_attention") else {}))
    prompts = draw(st.lists(st.integers(3, 20), min_size=1, max_size=3))
    return policy, prompts, draw(st.integers(budget, 2 * budget + 10)), draw(st.integers(1, 3)), draw(st.integers(0, 99))


@settings(max_examples=30, deadline=None, derandomize=True)
@given(cases())
def test_every_eviction_keeps_the_layer_total_and_each_heads_floor(case):
    # drive() checks at every step: filled slots first per head, below length; positions increasing;
    # K/V bit-identical; prefix and recent survive; and after each eviction: the layer's total is
    # kv_heads x (n_prefix + B_min), each head within [n_prefix + floor, n_prefix + B_min + headroom]
    policy, prompts, steps, n_kv, seed = case
    cache, state = drive(policy, prompts, steps, n_kv=n_kv, seed=seed)
    assert sum(state.stats.evictions) > 0
    uniform = make_policy(policy.name, budget=policy.budget, n_recent=policy.n_recent, n_prefix=policy.n_prefix,
                          **({"window": 4} if policy.name in ("snapkv", "rkv", "expected_attention") else {}))
    assert cache.capacity == uniform.capacity(prompts, steps), "memory is the uniform allocation's"


def test_the_split_follows_the_scores():
    # KNorm on two KV heads: head 0's keys are all short (high scores), head 1's long: head 0 takes the
    # headroom, head 1 drops to the average minus the headroom
    g = torch.Generator().manual_seed(0)
    policy = make_policy("knorm", budget=32, n_recent=2, allocation="head_adaptive:floor=0.2")
    B_min, room = policy.b_min, policy.allocation.extra_slots(policy, policy.b_min)
    assert (B_min, room) == (28, 2)

    def keys_at(p, h):
        return torch.randn(8, generator=g) * (0.1 if h == 0 else 10.0)

    layer = drive_hand(policy, 2, keys_at, steps=33)  # evicts at the 32nd token, then writes one more
    assert layer.state.stats.evictions == [1]
    per_head = (layer.cache.pos[0] >= 0).sum(-1).tolist()
    # 2 prefix + 28 kept per head on average; head 0 keeps `room` more, head 1 `room` fewer; then one new token
    assert per_head == [2 + 28 + room + 1, 2 + 28 - room + 1]
    assert int(layer.cache.length[0]) == 2 + 28 + room + 1
    hole = layer.cache.pos[0, 1, 2 + 28 - room: 2 + 28 + room].tolist()
    assert hole == [-1] * (2 * room), "head 1's unused slots lie below the row's length, empty"


def test_uniform_is_the_default_and_keeps_every_head_alike():
    assert make_policy("snapkv", budget=64, n_recent=8).allocation == Uniform()
    cache, state = drive(make_policy("snapkv", budget=32, n_recent=4, window=4), [5, 9], 60)
    filled = (cache.layers[0].pos >= 0).sum(-1)
    assert torch.equal(filled, filled[:, :1].expand_as(filled))


def test_evictions_come_sooner_by_the_headroom():
    steps = 200
    _, uniform = drive(make_policy("h2o", budget=32, n_recent=2), [4], steps)
    _, adaptive = drive(make_policy("h2o", budget=32, n_recent=2, allocation="head_adaptive"), [4], steps)
    # uniform: every 4 tokens after the first 28 (B_max 32 -> B_min 28); adaptive: every 2 (headroom 2)
    assert uniform.stats.evictions == [(steps + 4 - 4 - 32) // 4 + 1]
    assert adaptive.stats.evictions == [(steps + 4 - 4 - 32) // 2 + 1]


def test_buffered_schedule_takes_the_allocation():
    cache, state = drive(make_policy("snapkv", budget=24, n_recent=2, window=4, schedule=Buffered(buffer=8),
                                     allocation="head_adaptive"), [6], 80, keep=24)
    assert state.stats.evictions[0] > 0


@pytest.mark.parametrize("spec, match", [
    ("head_adaptive:floor=1.5", "floor=1.5"),
    ("head_adaptive:headroom=-1", "headroom=-1"),
    ("head_adaptive:headroom=4", "headroom=4 leaves no new token"),
    ("head_adaptive:alpha=0.2", "'alpha=0.2' is not key=value"),
    ("adakv", "unknown allocation 'adakv'"),
])
def test_bad_allocations_are_refused_with_the_value(spec, match):
    with pytest.raises(PolicyConfigError, match=match):
        make_policy("snapkv", budget=32, n_recent=2, allocation=spec)  # B_max - B_min = 4


def test_a_periodic_schedule_is_refused():
    with pytest.raises(PolicyConfigError, match="needs a budget and a schedule that keeps a fixed count"):
        make_policy("snapkv", budget=None, n_recent=2, window=4, schedule=Periodic(period=64, compression=4),
                    allocation="head_adaptive")


def test_parse_allocation_reads_names_and_settings():
    assert parse_allocation("uniform") == Uniform()
    assert parse_allocation("head-adaptive:floor=0.5,headroom=3") == HeadAdaptive(floor=0.5, headroom=3)
    assert parse_allocation("head_adaptive:headroom=none") == HeadAdaptive()
    assert parse_allocation("shared") == Shared() and repr(Shared()) == "Shared()"
    with pytest.raises(PolicyConfigError, match="heads=3 is not a setting"):
        Shared(heads=3)


def _window(name: str) -> dict:
    return {"window": 4} if name in ("snapkv", "rkv", "expected_attention") else {}


@settings(max_examples=20, deadline=None, derandomize=True)
@given(st.sampled_from(SCORERS), st.integers(1, 4), st.sampled_from([None, 2]), st.integers(0, 99))
def test_shared_keeps_the_same_positions_in_every_head_of_a_layer(name, n_recent, n_prefix, seed):
    # drive() checks the invariants of every step (budget, prefix, recent, K/V bit-identical) as for any policy
    budget = 8 * n_recent + 8
    policy = make_policy(name, budget=budget, n_recent=n_recent, n_prefix=n_prefix, allocation="shared",
                         **_window(name))
    cache, state = drive(policy, [5, 13], 3 * budget, n_kv=3, seed=seed)
    assert min(state.stats.evictions) > 0
    for layer in cache.layers:
        assert torch.equal(layer.pos, layer.pos[:, :1].expand_as(layer.pos)), name
    assert cache.capacity == make_policy(name, budget=budget, n_recent=n_recent, n_prefix=n_prefix,
                                         **_window(name)).capacity([5, 13], 3 * budget), "memory is uniform's"


# ------------------------------------------------------------------- through the model
def _prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 97, (n,), generator=g).tolist() for n in (5, 12)]


@pytest.mark.parametrize("name", ["beacon", "snapkv"])
def test_a_head_adaptive_policy_compiles_fullgraph_with_the_same_tokens_and_kept_positions(llama, name):
    import beaconkv
    from beaconkv.execution import CompileConfig

    def run(**kw):
        policy = make_policy(name, budget=64, n_recent=8, allocation="head_adaptive", telemetry=True)
        return beaconkv.generate(llama, None, _prompts(), policy=policy, max_new_tokens=90, eos_token_ids=[], **kw)

    eager, compiled = run(), run(compile=CompileConfig(backend="aot_eager"))
    assert compiled.token_ids == eager.token_ids
    assert eager.stats.evictions == compiled.stats.evictions and min(eager.stats.evictions) >= 3
    kept = [[(r.step, r.layer, r.rows, r.kept_positions.tolist()) for r in out.telemetry] for out in (eager, compiled)]
    assert kept[0] == kept[1]
    # the heads of a layer did keep different counts at some eviction (the split is not the uniform one)
    counts = {tuple((r.kept_positions >= 0).sum(-1).flatten().tolist()) for r in eager.telemetry}
    assert any(len(set(c)) > 1 for c in counts)


@pytest.mark.parametrize("name", ["beacon", "snapkv"])
def test_shared_sets_differ_from_per_head_ones_and_compile_to_the_same_kept_positions(llama, name):
    import beaconkv
    from beaconkv.execution import CompileConfig

    def run(allocation, **kw):
        policy = make_policy(name, budget=64, n_recent=8, allocation=allocation, telemetry=True)
        out = beaconkv.generate(llama, None, _prompts(), policy=policy, max_new_tokens=90, eos_token_ids=[], **kw)
        return out, [(r.step, r.layer, r.rows, r.kept_positions.tolist()) for r in out.telemetry]

    (_, uniform), (eager, shared) = run("uniform"), run("shared")
    _, compiled = run("shared", compile=CompileConfig(backend="aot_eager"))
    assert min(eager.stats.evictions) >= 3 and compiled == shared
    every_head_alike = [all(h == kept[r][0] for r in range(len(kept)) for h in kept[r]) for *_, kept in shared]
    assert all(every_head_alike)
    assert not all(all(h == kept[r][0] for r in range(len(kept)) for h in kept[r]) for *_, kept in uniform), \
        "per-head sets never differed: the shared check would prove nothing"


def test_shared_tova_keeps_what_tova_averaged_over_all_heads_keeps(llama):
    # TOVA's reference averages its scores over every head of a layer (group_reduce="all_heads"); the
    # shared allocation over TOVA's per-group mean is the same average, computed by the allocation
    import beaconkv

    def kept(policy):
        out = beaconkv.generate(llama, None, _prompts(), policy=policy, max_new_tokens=90, eos_token_ids=[])
        return out.token_ids, [(r.step, r.layer, r.kept_positions.tolist()) for r in out.telemetry]

    reference = kept(TOVA(64, n_recent=8, group_reduce="all_heads", telemetry=True))
    assert len(reference[1]) > 0
    assert kept(TOVA(64, n_recent=8, allocation=Shared(), telemetry=True)) == reference


def test_int8_storage_takes_a_head_adaptive_allocation():
    policy = make_policy("snapkv", budget=32, n_recent=4, window=4, allocation="head_adaptive")
    cache, state = drive(policy, [5, 9], 80, storage="int8", n_kv=3)
    assert min(state.stats.evictions) > 0
