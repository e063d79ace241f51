"""Eviction schedules (:mod:`beaconkv.policies.schedules`): the hand-checkable runs of R-KV's and RPC's own
schedules, any scorer under any schedule (property-tested through the real cache, and through generation on
the tiny llama), the cache sized to each schedule's exact peak, and the specs the command line passes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import beaconkv
from beaconkv.policies import (
    RKV,
    RPC,
    AtBudget,
    BeaconKV,
    Buffered,
    H2O,
    Periodic,
    PolicyConfigError,
    Schedule,
    SnapKV,
    StreamingLLM,
    make_policy,
    parse_schedule,
)

from .driver import drive, drive_hand, dull_keys, kept

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------- hand-checkable runs
def test_periodic_compacts_only_the_newest_period_or_reselects():
    # P=8, c=2 (keep 4 per period), R=max(window 2, n_recent 1)=2, prefix 2.
    # period 1 (t=9, positions 2..9): dull 3, 5, 6 -> keep 8, 9 + 4 of 2..7: the two oldest dull go.
    # period 2 (t=15, positions 8..15 are the newest period): dull 10, 12.
    dull = {3, 5, 6, 10, 12}
    results = {}
    for reselect in (False, True):
        policy = RPC(None, window=2, kernel=1, n_recent=1, schedule=Periodic(period=8, compression=2, reselect=reselect))
        cap = policy.capacity([2], 14)
        layer = drive_hand(policy, 2, dull_keys({0: dull, 1: dull}), steps=14)
        assert layer.state.stats.evictions == [2]
        assert int(layer.cache.length[0]) == 2 + 4 + 4 + 2 and cap == 2 + 4 + 8
        results[reselect] = kept(layer, 0)
    assert results[False] == [0, 1, 2, 4, 6, 7, 8, 9, 11, 13, 14, 15]
    assert results[True] == [0, 1, 2, 4, 7, 8, 9, 11, 12, 13, 14, 15]


@pytest.mark.parametrize("n_prefix", [None, 0])
@pytest.mark.parametrize("make", [
    lambda n_prefix: RPC(None, window=4, n_recent=2, n_prefix=n_prefix, schedule=Periodic(period=16, compression=4)),
    lambda n_prefix: SnapKV(None, window=4, n_recent=2, n_prefix=n_prefix, schedule=Periodic(period=16, compression=4)),
    lambda n_prefix: StreamingLLM(None, n_sink=1, n_recent=3, n_prefix=n_prefix,
                                  schedule=Periodic(period=12, compression=3)),
], ids=["rpc", "snapkv", "streaming"])
def test_periodic_capacity_is_the_peak_of_the_schedule(make, n_prefix):
    policy = make(n_prefix)
    for prompt, steps in [(3, 0), (3, 15), (3, 16), (3, 100), (40, 57), (16, 5)]:
        cap = policy.capacity([prompt], steps)
        layer = drive_hand(policy, prompt, lambda p, h: torch.randn(8), steps=steps)
        assert layer.state.peak_tokens == cap  # exact: the cache is never too small, nor larger than needed


@pytest.mark.parametrize("make", [
    lambda: RKV(8, window=2, n_recent=1, schedule=Buffered(buffer=4)),
    lambda: StreamingLLM(8, n_sink=1, n_recent=1, schedule=Buffered(buffer=4)),
], ids=["rkv", "streaming"])
def test_buffered_evicts_back_to_the_budget_every_buffer_tokens(make):
    policy = make()
    counts = []
    cap = policy.capacity([2], 30)
    policy.on_count_change = lambda state, rows: counts.append(state.count[0])  # an instance override
    layer = drive_hand(policy, 2, lambda p, h: torch.randn(8), steps=30)
    assert cap == layer.state.peak_tokens == 2 + 8 + 4
    assert layer.state.stats.evictions == [(30 - 12) // 4 + 1]
    assert counts[11:18] == [11, 8, 9, 10, 11, 8, 9]  # counts[s]: after the s-th write (0: the prefill)


def test_beacons_freeze_n_recent_tokens_before_the_schedules_next_eviction():
    """BeaconKV's step 3 follows the schedule: under Buffered the recent set starts ``n_recent`` tokens before
    ``budget + buffer``, not before ``budget``."""
    policy = BeaconKV(16, n_recent=2, n_beacon=2, schedule=Buffered(buffer=8))
    frozen = []
    original = policy.freeze

    def spy(state, rows):
        frozen.append(state.count[rows[0]])
        original(state, rows)

    policy.freeze = spy  # an instance override
    layer = drive_hand(policy, 2, lambda p, h: torch.randn(8), steps=40)
    assert layer.state.stats.evictions == [(40 - 24) // 8 + 1]
    assert frozen[:3] == [24 - 2, 24 - 2, 24 - 2]  # each time: budget + buffer - n_recent


# ------------------------------------------------------------------- any scorer under any schedule
SCORERS = ["beacon", "snapkv", "rpc", "rkv", "h2o", "streaming", "beacon_event", "beacon_memory", "expected_attention",
           "tova", "keydiff", "knorm", "lazy_eviction", "triattention"]


@st.composite
def schedule_cases(draw):
    """A schedule and a run in which every row evicts at least once, by construction."""
    n_recent = draw(st.integers(1, 8))
    n_prefix = draw(st.sampled_from([None, 0]))
    prompts = draw(st.lists(st.integers(1, 12), min_size=1, max_size=2))
    if draw(st.booleans()):
        budget, buffer = draw(st.integers(n_recent + 8, 64)), draw(st.integers(1, 24))
        schedule, first = Buffered(buffer=buffer), budget + buffer
    else:
        compression = draw(st.integers(2, 4))
        recent = max(n_recent, 8)  # the largest window below: SnapKV's/RPC's/R-KV's/ExpectedAttention's 8
        period = draw(st.integers(2 * recent + 4, 64))  # period - period // compression >= recent + 2
        budget, schedule, first = None, Periodic(period=period, compression=compression), period
    # an evictable prompt (n_prefix=0) counts towards the first eviction: the shortest one evicts last
    steps = max(first - (0 if n_prefix is None else min(prompts)), 1) + draw(st.integers(0, 40))
    return {"budget": budget, "n_recent": n_recent, "n_prefix": n_prefix, "prompts": prompts, "steps": steps,
            "schedule": schedule, "seed": draw(st.integers(0, 2**16))}


def _scorer(name: str, case: dict):
    kw = {"n_recent": case["n_recent"], "n_prefix": case["n_prefix"], "schedule": case["schedule"]}
    if name.startswith("beacon"):
        kw["n_beacon"] = 4
    if name in ("snapkv", "rpc", "rkv", "expected_attention"):
        kw["window"] = 8
    if name == "streaming":
        kw["n_sink"] = 1
    return make_policy(name, budget=case["budget"], **kw)


@pytest.mark.parametrize("name", SCORERS)
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=schedule_cases())
def test_every_scorer_keeps_the_invariants_under_every_schedule(name, case):
    """The driver checks, after the prefill and every step: the host count equals every layer's length, no
    row past its schedule's eviction point, the prefix and the last ``n_recent`` kept, K/V bit-identical in
    position order; the cache (sized by the schedule's peak) is never too small."""
    policy = _scorer(name, case)
    cache, state = drive(policy, case["prompts"], case["steps"], seed=case["seed"])
    assert min(state.stats.evictions) >= 1, (state.stats.evictions, case)
    assert state.peak_tokens <= cache.capacity


@pytest.mark.parametrize("make", [
    lambda: RPC(None, schedule=Periodic(period=64, compression=4)),
    lambda: RKV(128, schedule=Buffered(buffer=16)),
    lambda: BeaconKV(None, n_beacon=4, schedule=Periodic(period=64, compression=4)),
    lambda: SnapKV(128, schedule=Buffered(buffer=16)),
    lambda: H2O(None, schedule=Periodic(period=48, compression=2)),
], ids=["rpc-periodic", "rkv-buffered", "beacon-periodic", "snapkv-buffered", "h2o-periodic"])
def test_schedules_through_generation(llama, make):
    g = torch.Generator().manual_seed(12)
    prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (20, 9)]
    batch = beaconkv.generate(llama, None, prompts, max_new_tokens=160, eos_token_ids=[], policy=make())
    assert min(batch.stats.evictions) > 0
    assert batch.stats.peak_cache_tokens <= batch.stats.cache_capacity
    singles = [beaconkv.generate(llama, None, [p], max_new_tokens=160, eos_token_ids=[], policy=make()).token_ids[0]
               for p in prompts]
    assert batch.token_ids == singles


def test_the_default_schedule_is_the_budget_rule():
    policy = SnapKV(128)
    assert policy.schedule == AtBudget() and repr(policy.schedule) == "AtBudget()"
    assert policy.capacity([10], 1000) == 10 + 128 and policy.b_min == 112


# ------------------------------------------------------------------- specs and validation
def test_specs_parse_to_the_same_schedules():
    assert parse_schedule("budget") == AtBudget()
    assert parse_schedule("buffered:buffer=32") == Buffered(buffer=32)
    assert parse_schedule("periodic:period=256, compression=2,reselect=true") == Periodic(256, 2, True)
    assert parse_schedule(Buffered()) == Buffered()
    assert make_policy("rkv", budget=64, schedule="buffered:buffer=8").schedule == Buffered(buffer=8)
    assert RPC(None, schedule="periodic").schedule == Periodic()


@pytest.mark.parametrize("make, match", [
    (lambda: RPC(128, schedule=Periodic()), "budget=None"),
    (lambda: RPC(None, schedule=Periodic(period=32, compression=4)), "period=32"),
    (lambda: SnapKV(None), "schedule that sizes itself"),
    (lambda: Buffered(buffer=0), "buffer=0"),
    (lambda: Periodic(compression=0), "compression=0"),
    (lambda: Periodic(reselect="yes"), "reselect='yes'"),
    (lambda: SnapKV(8, n_recent=16, ratio=0.5, schedule=Buffered()), "budget=8"),
    (lambda: SnapKV(128, schedule="weekly"), "unknown schedule 'weekly'"),
    (lambda: SnapKV(128, schedule="buffered:size=3"), "'size=3'"),
    (lambda: SnapKV(128, schedule=3), "schedule=3"),
])
def test_bad_schedules_are_rejected_with_the_value(make, match):
    with pytest.raises(PolicyConfigError, match=match):
        make()


def test_a_schedule_of_ones_own_runs_any_scorer():
    """A user's schedule is a small subclass: every other eviction keeps half as many."""
    from dataclasses import dataclass

    @dataclass(frozen=True, repr=False)
    class Alternating(Schedule):
        name = "alternating"

        def evict_at(self, policy, settled):
            return policy.budget

        def keep(self, policy, count, settled):
            return policy.b_min if settled == 0 else policy.b_min // 2

        def settled_after(self, policy, kept):
            return 1 if kept == policy.b_min else 0

        def peak(self, policy, count, new_tokens):
            return policy.budget

    policy = SnapKV(32, n_recent=2, window=4, schedule=Alternating())
    layer = drive_hand(policy, 2, lambda p, h: torch.randn(8), steps=60)
    assert layer.state.stats.evictions[0] >= 3 and int(layer.cache.length[0]) <= 2 + 32
