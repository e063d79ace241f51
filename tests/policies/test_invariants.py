"""Property tests: every policy, driven with random tensors through the real cache, keeps the
budget semantics of SPEC §2 (bounded cache, 7/8 evictions, prefix/recent retention, bit-identical
kept K/V in position order) and BeaconKV keeps its query buffers bounded."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from beaconkv.policies import make_policy
from beaconkv.policies.beacon import BeaconKV

from .driver import drive

POLICIES = ["beacon", "initial_recent", "snapkv", "rpc", "rkv", "h2o", "streaming"]

cases = st.fixed_dictionaries({
    "extra": st.integers(0, 40),
    "n_recent": st.integers(1, 6),
    "prompts": st.lists(st.integers(1, 40), min_size=1, max_size=3),
    "steps": st.integers(0, 120),
    "n_kv": st.integers(1, 3),
    "group": st.integers(1, 3),
    "n_prefix": st.one_of(st.none(), st.integers(0, 1)),
    "seed": st.integers(0, 2**16),
})


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases, name=st.sampled_from(POLICIES))
def test_budget_invariants_hold_for_every_policy(case, name):
    kw = dict(n_recent=case["n_recent"], n_prefix=case["n_prefix"])
    if name in ("beacon", "initial_recent"):
        kw.update(n_beacon=case["n_recent"] + 1)
    policy = make_policy(name, budget=8 * case["n_recent"] + case["extra"], **kw)
    drive(policy, case["prompts"], case["steps"], n_kv=case["n_kv"], group=case["group"], seed=case["seed"])


@settings(max_examples=20, deadline=None)
@given(case=cases, n_beacon=st.integers(0, 8))
def test_beacon_query_buffers_stay_bounded(case, n_beacon):
    policy = BeaconKV(budget=8 * case["n_recent"] + case["extra"], n_beacon=n_beacon, n_recent=case["n_recent"],
                      n_prefix=case["n_prefix"])
    q_max = n_beacon + case["n_recent"]

    def bounded(step, state):
        for b in range(len(case["prompts"])):
            if state.phase[b] == "accumulate":  # stored + pending observation vectors
                assert state.obs_count[b] + state.t[b] - state.obs_since[b] < q_max
            else:  # the recent set never exceeds n_recent
                assert state.t[b] - state.recent_since[b] <= case["n_recent"]
        assert state.obs.q.shape[-2] == n_beacon and state.beacons.q.shape[-2] == n_beacon
        for layer in state.cache.layers:
            assert layer.queries.shape[2] == max(q_max, 1)

    drive(policy, case["prompts"], case["steps"], n_kv=case["n_kv"], group=case["group"], seed=case["seed"],
          on_step=bounded)
