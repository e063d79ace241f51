"""Property tests: every policy, driven with random tensors through the real cache, keeps the budget
semantics of SPEC §2 (bounded cache, evictions down to ``floor(ratio * budget)``, prefix/recent
retention, kept K/V bit-identical in position order), and every sampler keeps BeaconKV's query
memory where it should.

The cases have teeth: budgets up to 512, ``n_recent`` up to 32, ``ratio`` anywhere in (0.5, 0.95),
sequences long enough that at least 80% of the examples really evict (asserted), and the count an
eviction must leave is computed here, not read from the policy.
"""

from __future__ import annotations

import math

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from beaconkv.policies import make_policy
from beaconkv.policies.beacon import BeaconKV
from beaconkv.policies.samplers import FPS, ContinualFPS, KMeans, NaiveFPS

from .driver import drive

POLICIES = ["beacon", "initial_recent", "snapkv", "rpc", "rkv", "h2o", "streaming", "beacon_group", "beacon_event",
            "beacon_lse", "beacon_evictable", "beacon_memory", "beacon_lse_memory", "beacon_mean"]
BEACONS = {"beacon", "initial_recent", "beacon_group", "beacon_event", "beacon_lse", "beacon_evictable", "beacon_memory",
           "beacon_lse_memory", "beacon_mean"}


@st.composite
def budget_cases(draw, max_budget: int = 512, max_recent: int = 32):
    """A valid (budget, n_recent, ratio) and a run long enough to evict most of the time."""
    n_recent = draw(st.integers(1, max_recent))
    ratio = draw(st.floats(0.5, 0.95, exclude_min=True, exclude_max=True))
    budget = draw(st.integers(8, max_budget))
    b_min = math.floor(ratio * budget)
    assume(budget - b_min >= n_recent and b_min >= n_recent)
    prompts = draw(st.lists(st.integers(1, 24), min_size=1, max_size=2))
    n_prefix = draw(st.sampled_from([None, None, 0]))
    gap = budget - b_min
    prompt_count = 0 if n_prefix is None else min(prompts)  # evictable tokens after the prefill
    # mostly past the first eviction (budget - count writes), sometimes just before it
    extra = draw(st.integers(-max(budget // 16, 1), 3 * gap))
    steps = max(budget - prompt_count + extra, 1)
    return {"budget": budget, "n_recent": n_recent, "ratio": ratio, "prompts": prompts, "n_prefix": n_prefix,
            "steps": steps, "seed": draw(st.integers(0, 2**16)), "n_kv": draw(st.integers(1, 2)),
            "group": draw(st.integers(1, 3))}


def test_budget_invariants_hold_for_every_policy_and_most_examples_evict():
    outcomes: list[bool] = []

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    @given(case=budget_cases(), name=st.sampled_from(POLICIES))
    def run(case, name):
        kw = dict(n_recent=case["n_recent"], n_prefix=case["n_prefix"], ratio=case["ratio"])
        if name in BEACONS:
            kw["n_beacon"] = min(case["n_recent"] + 1, 8)
        if name == "streaming":
            kw["n_sink"] = 0 if math.floor(case["ratio"] * case["budget"]) < case["n_recent"] + 4 else 4
        policy = make_policy(name, budget=case["budget"], **kw)
        keep = math.floor(case["ratio"] * case["budget"])  # computed here: the cache must keep exactly this
        _, state = drive(policy, case["prompts"], case["steps"], n_kv=case["n_kv"], group=case["group"],
                         n_layers=1, head_dim=4, seed=case["seed"], keep=keep)
        outcomes.append(min(state.stats.evictions) > 0)

    run()
    assert len(outcomes) >= 50 and sum(outcomes) / len(outcomes) >= 0.8, (
        f"only {sum(outcomes)} of {len(outcomes)} examples evicted: the property test would be toothless")


SAMPLERS = {"continual_fps": ContinualFPS, "fps": FPS, "naive_fps": NaiveFPS, "kmeans": lambda: KMeans(n_iter=2)}


def test_query_memory_is_bounded_for_bounded_samplers_and_the_whole_history_otherwise():
    seen: dict[str, int] = {}

    @settings(max_examples=24, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    @given(case=budget_cases(max_budget=160, max_recent=16), sampler=st.sampled_from(sorted(SAMPLERS)),
           n_beacon=st.integers(0, 8))
    def run(case, sampler, n_beacon):
        assume(n_beacon + case["n_recent"] >= 1)
        policy = BeaconKV(case["budget"], n_beacon=n_beacon, n_recent=case["n_recent"], ratio=case["ratio"],
                          n_prefix=case["n_prefix"], sampler=SAMPLERS[sampler]())
        q_max = n_beacon + case["n_recent"]
        bounded = policy.sampler.bounded

        def memory(step, state):
            held = policy.held_queries(state)  # the public counter
            for b in range(len(case["prompts"])):
                if bounded:
                    assert held[b] <= q_max, f"{sampler}: {held[b]} > B_max^Q = {q_max}"
                else:  # every query of the sequence, prompt and decode, is kept
                    assert held[b] == state.t[b] + 1
            seen[sampler] = seen.get(sampler, 0) + 1

        drive(policy, case["prompts"], case["steps"], n_kv=case["n_kv"], group=case["group"], n_layers=1,
              head_dim=4, seed=case["seed"], on_step=memory)

    run()
    assert set(seen) == set(SAMPLERS), f"every sampler must be exercised, got {sorted(seen)}"


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
        policy = Recording(budget, n_beacon=n_beacon, n_recent=n_recent, sampler=NaiveFPS())
        _, state = drive(policy, [20], steps=3 * budget, n_layers=1, n_kv=1, group=2, head_dim=4)
        assert sizes and state.stats.evictions[0] >= 2
        for valid, newest in sizes:  # at each freeze: positions 0 .. newest, all of them
            assert valid == newest + 1
