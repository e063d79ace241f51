"""Property tests: every policy, driven with random tensors through the real cache, keeps the budget
semantics of SPEC §2 (bounded cache, evictions down to ``floor(ratio * budget)``, prefix/recent
retention, kept K/V bit-identical in position order), and every sampler keeps BeaconKV's query
memory where it should.

The cases have teeth: budgets up to 512, ``n_recent`` up to 32, ``ratio`` anywhere in (0.5, 0.95),
runs drawn so that every row of every example evicts (asserted; a second test draws runs that end
just before the first eviction and asserts none happened), every policy and every sampler a
parametrized case of its own, and the count an eviction must leave computed here, not read from the
policy.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from beaconkv.policies import make_policy
from beaconkv.policies.beacon import BeaconKV
from beaconkv.policies.query_selection import FPS, KMeans

from .driver import drive

POLICIES = ["beacon", "initial_recent", "snapkv", "rpc", "rkv", "h2o", "streaming", "beacon_group", "beacon_event",
            "beacon_lse", "beacon_evictable", "beacon_memory", "beacon_lse_memory", "beacon_mean",
            "expected_attention", "tova", "keydiff", "knorm", "lazy_eviction", "triattention", "beacon_pool"]
BEACONS = {"beacon", "initial_recent", "beacon_group", "beacon_event", "beacon_lse", "beacon_evictable", "beacon_memory",
           "beacon_lse_memory", "beacon_mean", "beacon_pool"}


@st.composite
def budget_cases(draw, max_budget: int = 512, max_recent: int = 32, evicts: bool = True):
    """A valid (budget, n_recent, ratio) and a run that evicts in every row (``evicts``), or one that
    ends short of the first eviction in every row (``evicts=False``) — by construction, not by chance."""
    n_recent = draw(st.integers(1, max_recent))
    # a ratio that leaves room for n_recent within max_budget (a budget needs budget - B_min >= n_recent)
    top = min(0.95, 1 - (n_recent + 1) / max_budget)
    ratio = draw(st.floats(0.5, top, exclude_min=True, exclude_max=True))
    # the smallest budget with budget - floor(ratio * budget) >= n_recent and floor(ratio * budget) >= n_recent
    smallest = next((b for b in range(8, max_budget + 1) if b - math.floor(ratio * b) >= n_recent
                     and math.floor(ratio * b) >= n_recent), None)
    assume(smallest is not None)
    budget = draw(st.integers(smallest, max_budget))
    b_min = math.floor(ratio * budget)
    n_prefix = draw(st.sampled_from([None, None, 0]))
    # n_prefix=0 makes the prompt evictable: each row starts at its prompt length, kept short of the budget
    prompts = draw(st.lists(st.integers(1, min(24, budget - 1)), min_size=1, max_size=2))
    gap = budget - b_min
    if n_prefix is None:
        first, last = budget, budget  # every row starts at 0 evictable tokens
    else:
        first, last = budget - max(prompts), budget - min(prompts)  # the first / the last row to reach it
    if evicts:  # past the last row's first eviction, by up to three cadences
        steps = last + draw(st.integers(0, 3 * gap))
    else:  # short of the first row's first eviction
        assume(first > 1)
        steps = draw(st.integers(max(first - max(budget // 16, 1), 1), first - 1))
    return {"budget": budget, "n_recent": n_recent, "ratio": ratio, "prompts": prompts, "n_prefix": n_prefix,
            "steps": steps, "seed": draw(st.integers(0, 2**16)), "n_kv": draw(st.integers(1, 2)),
            "group": draw(st.integers(1, 3))}


def _policy(name: str, case: dict):
    kw = dict(n_recent=case["n_recent"], n_prefix=case["n_prefix"], ratio=case["ratio"])
    if name in BEACONS:
        kw["n_beacon"] = min(case["n_recent"] + 1, 8)
    if name == "streaming":
        kw["n_sink"] = 0 if math.floor(case["ratio"] * case["budget"]) < case["n_recent"] + 4 else 4
    return make_policy(name, budget=case["budget"], **kw)


PROPERTY = settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("name", POLICIES)
@PROPERTY
@given(case=budget_cases())
def test_budget_invariants_hold_for_every_policy_and_every_row_evicts(name, case):
    policy = _policy(name, case)
    keep = math.floor(case["ratio"] * case["budget"])  # computed here: the cache must keep exactly this
    _, state = drive(policy, case["prompts"], case["steps"], n_kv=case["n_kv"], group=case["group"],
                     n_layers=1, head_dim=4, seed=case["seed"], keep=keep)
    assert min(state.stats.evictions) > 0, f"a row never evicted: {state.stats.evictions}"


@pytest.mark.parametrize("name", POLICIES)
@settings(PROPERTY, max_examples=2)
@given(case=budget_cases(max_budget=160, evicts=False))
def test_no_policy_evicts_before_the_budget(name, case):
    _, state = drive(_policy(name, case), case["prompts"], case["steps"], n_kv=case["n_kv"], group=case["group"],
                     n_layers=1, head_dim=4, seed=case["seed"])
    assert state.stats.evictions == [0] * len(case["prompts"])


#: (selector, query memory) of the paper's Fig. 7: Continual FPS, Naive FPS, K-Means over the history, and
#: K-Means over the bounded buffer (a combination the separate setting now allows)
SAMPLERS = {"continual_fps": (FPS, "bounded"), "naive_fps": (FPS, "history"),
            "kmeans": (lambda: KMeans(n_iter=2), "history"), "kmeans_bounded": (lambda: KMeans(n_iter=2), "bounded")}


@pytest.mark.parametrize("sampler", sorted(SAMPLERS))
@settings(PROPERTY, max_examples=6)
@given(case=budget_cases(max_budget=160, max_recent=16), n_beacon=st.integers(0, 8))
def test_query_memory_is_bounded_for_bounded_samplers_and_the_whole_history_otherwise(sampler, case, n_beacon):
    assume(n_beacon + case["n_recent"] >= 1)
    make, memory_model = SAMPLERS[sampler]
    policy = BeaconKV(case["budget"], n_beacon=n_beacon, n_recent=case["n_recent"], ratio=case["ratio"],
                      n_prefix=case["n_prefix"], sampler=make(), query_memory=memory_model)
    q_max = n_beacon + case["n_recent"]
    bounded = memory_model == "bounded"
    steps = []

    def memory(step, state):
        held = policy.held_queries(state)  # the public counter
        for b in range(len(case["prompts"])):
            if bounded:
                assert held[b] <= q_max, f"{sampler}: {held[b]} > B_max^Q = {q_max}"
            else:  # every query of the sequence, prompt and decode, is kept
                assert held[b] == state.t[b] + 1
        steps.append(step)

    _, state = drive(policy, case["prompts"], case["steps"], n_kv=case["n_kv"], group=case["group"], n_layers=1,
                     head_dim=4, seed=case["seed"], on_step=memory)
    assert steps == list(range(case["steps"])) and min(state.stats.evictions) > 0


def test_an_unbounded_sampler_freezes_over_every_query_of_the_history():
    """The history lifecycle samples the beacons from every query so far: the prompt's and each decode
    query's, none missing between compressions (the old bug dropped up to n_recent per cycle)."""
    sizes = []

    class Recording(BeaconKV):
        def select_queries(self, queries, k):
            if queries.q.shape[-2] > k:
                sizes.append((queries.valid.sum(-1).amax().item(), queries.pos.amax().item()))
            return super().select_queries(queries, k)

    for n_beacon, n_recent, budget in ((16, 16, 128), (28, 4, 256)):
        sizes.clear()
        policy = Recording(budget, n_beacon=n_beacon, n_recent=n_recent, query_memory="history")
        _, state = drive(policy, [20], steps=3 * budget, n_layers=1, n_kv=1, group=2, head_dim=4)
        assert sizes and state.stats.evictions[0] >= 2
        for valid, newest in sizes:  # at each freeze: positions 0 .. newest, all of them
            assert valid == newest + 1


@st.composite
def chunked_cases(draw):
    """A valid (budget, n_recent, ratio), an int prefix, prompts longer than the budget, and a prefill chunk."""
    case = draw(budget_cases(max_budget=96, max_recent=8))
    budget = case["budget"]
    case["n_prefix"] = draw(st.integers(0, 6))
    case["prompts"] = draw(st.lists(st.integers(case["n_prefix"] + 1, 3 * budget + 20), min_size=1, max_size=2))
    case["chunk"] = draw(st.integers(1, budget + 8))
    case["steps"] = draw(st.integers(0, budget))
    return case


@pytest.mark.parametrize("name", POLICIES)
@settings(PROPERTY, max_examples=3)
@given(case=chunked_cases())
def test_a_chunked_prefill_bounds_the_cache_for_every_policy(name, case):
    # issue #43: with prefill_chunk=N the cache is sized n_prefix + budget + N at most, never the whole
    # prompt; the 7/8 budget, prefix and recent guarantees hold at every chunk (checked by the driver)
    policy = _policy(name, case)
    N = case["chunk"]
    bound = case["n_prefix"] + case["budget"] + N
    capacity = policy.capacity(case["prompts"], case["steps"], prefill_chunk=N)
    assert capacity <= bound, f"capacity {capacity} > n_prefix + budget + N = {bound}"
    keep = math.floor(case["ratio"] * case["budget"])
    cache, state = drive(policy, case["prompts"], case["steps"], n_kv=case["n_kv"], group=case["group"],
                         n_layers=1, head_dim=4, seed=case["seed"], keep=keep, prefill_chunk=N)
    assert cache.capacity == capacity
    longest = max(case["prompts"])
    if longest >= case["n_prefix"] + case["budget"] + N:  # the whole prompt could never have fit
        assert max(state.stats.evictions) > 0
