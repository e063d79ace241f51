"""The variants beyond the paper: each reduces to BeaconKV where it should, and does what it claims."""

from __future__ import annotations

import pytest
import torch

from beaconkv.cache import KVCache
from beaconkv.models.rope import RotaryEmbedding
from beaconkv.policies import BeaconKV, EventBeaconKV, GroupBeaconKV, MemoryBeaconKV, PolicyConfigError, make_policy
from beaconkv.policies.registry import policy_defaults
from beaconkv.policies.scoring import reduce_group, reduce_queries

from .driver import bind, drive, drive_hand, kept


def _kept(state):
    return [(r.step, r.layer, r.kept_positions.tolist()) for r in state.stats.telemetry]


def _same_run(a, b, **drive_kw):
    _, sa = drive(a, [9, 14], steps=120, **drive_kw)
    _, sb = drive(b, [9, 14], steps=120, **drive_kw)
    return _kept(sa), _kept(sb), sa, sb


def test_group_sharing_with_groups_of_one_is_beacon_kv():
    ka, kb, _, _ = _same_run(BeaconKV(32, n_beacon=4, n_recent=4, telemetry=True),
                             GroupBeaconKV(32, n_beacon=4, n_recent=4, telemetry=True), n_kv=2, group=1)
    assert ka == kb and ka


def test_group_sharing_keeps_one_set_per_kv_head_and_divides_the_memory():
    policy = GroupBeaconKV(32, n_beacon=4, n_recent=4)
    _, state = drive(policy, [9, 14], steps=120, n_kv=2, group=3)
    assert state.beacons.q.shape[-3] == 2 and state.obs.q.shape[-3] == 2  # KV heads, not the 6 query heads
    plain = BeaconKV(32, n_beacon=4, n_recent=4)
    _, ref = drive(plain, [9, 14], steps=120, n_kv=2, group=3)
    for b in range(2):  # the stored sets count 1/3 per query head; the pending ring queries are per head
        stored_g, pending_g = policy.lifecycle.held(policy, state, b)
        assert policy.held_queries(state)[b] == pytest.approx(stored_g / 3 + pending_g)
        assert policy.held_queries(state)[b] < plain.held_queries(ref)[b]


def test_evictable_normalisation_without_a_protected_prefix_is_beacon_kv():
    ka, kb, _, _ = _same_run(BeaconKV(32, n_beacon=4, n_recent=4, n_prefix=0, telemetry=True),
                             make_policy("beacon_evictable", 32, n_beacon=4, n_recent=4, n_prefix=0, telemetry=True))
    assert ka == kb and ka


def test_memory_zero_is_beacon_kv_and_memory_only_raises_scores():
    ka, kb, _, _ = _same_run(BeaconKV(32, n_beacon=4, n_recent=4, telemetry=True),
                             MemoryBeaconKV(32, n_beacon=4, n_recent=4, memory=0.0, telemetry=True))
    assert ka == kb and ka
    seen = []

    class Watching(MemoryBeaconKV):
        def score(self, layer, rows, t):
            now = BeaconKV.score(self, layer, rows, t)
            out = super().score(layer, rows, t)
            seen.append(bool((out >= now).all()) and bool((layer.layer_state.remembered[rows] == out).all()))
            return out

    drive(Watching(32, n_beacon=4, n_recent=4, memory=0.7), [9], steps=80)
    assert seen and all(seen)


def test_logsumexp_tends_to_max_and_is_a_smooth_upper_bound():
    w = torch.rand(2, 3, 2, 5, 17)  # (b, kv, group, n, C)
    mask = torch.ones(2, 5, dtype=torch.bool)
    hard = reduce_group(reduce_queries(w, mask, "max"), "max")
    for temp, tol in ((0.001, 0.02), (0.0001, 0.002)):
        soft = reduce_group(reduce_queries(w, mask, "logsumexp", temp), "logsumexp", temp)
        assert bool((soft >= hard - 1e-6).all()) and float((soft - hard).max()) < tol
    assert make_policy("beacon_lse", 128).aggregation == "logsumexp"


def test_the_combination_is_memory_scores_with_logsumexp_aggregation():
    combo = make_policy("beacon_lse_memory", 128, memory=0.3)
    assert isinstance(combo, MemoryBeaconKV) and (combo.aggregation, combo.temperature, combo.memory) == (
        "logsumexp", 0.02, 0.3)
    assert policy_defaults("beacon_lse_memory")["aggregation"] == "logsumexp"


def test_mean_aggregation_averages_over_the_beacons_and_the_group():
    w = torch.rand(2, 3, 2, 5, 17)  # (b, kv, group, n, C)
    mask = torch.tensor([[True, True, True, False, False], [True] * 5])
    w[0, :, :, 3:] = 0.0  # missing queries carry zero rows (the contract of reduce_queries)
    got = reduce_group(reduce_queries(w, mask, "mean"), "mean")
    expected = torch.stack([w[0, :, :, :3].mean(2), w[1].mean(2)]).mean(2)  # held beacons only, then the group
    torch.testing.assert_close(got, expected)
    policy = make_policy("beacon_mean", 128, n_beacon=64)
    assert (policy.aggregation, policy.n_beacon) == ("mean", 64) and policy_defaults("beacon_mean")["aggregation"] == "mean"


def test_event_refresh_takes_in_a_far_looking_query_and_ignores_a_local_one():
    policy = EventBeaconKV(64, n_beacon=2, n_recent=8, n_events=2, event_mass=0.5, event_window=4)
    B, n_kv, G, D, C = 1, 1, 2, 4, 96
    cache = KVCache.allocate(1, B, n_kv, n_kv * G, C, D)
    driver = bind(policy, cache, RotaryEmbedding(D), [6], max_tokens=C)
    state = driver.state
    layer, observer = cache[0], state.observers[0]
    assert observer.needs_weights
    g = torch.Generator().manual_seed(0)
    layer.write_prefill(torch.randn(B, n_kv, 6, D, generator=g), torch.randn(B, n_kv, 6, D, generator=g),
                        torch.arange(6)[None], torch.ones(B, 6, dtype=torch.bool))
    observer.prefill(torch.randn(B, n_kv * G, 6, D, generator=g), torch.arange(6)[None], torch.ones(B, 6, dtype=torch.bool))
    driver.after_prefill([0])
    for p in range(6, 30):
        q = torch.randn(B, n_kv * G, 1, D, generator=g)
        layer.append(torch.randn(B, n_kv, 1, D, generator=g), torch.randn(B, n_kv, 1, D, generator=g), torch.tensor([p]))
        w = torch.zeros(B, n_kv, G, C)
        if p == 25:  # head 1 looks at position 8: generated, far behind (window 4)
            w[0, 0, 0, p] = 1.0
            w[0, 0, 1, 8] = 1.0
        else:  # everyone looks at itself: local
            w[0, 0, :, p] = 1.0
        observer.decode(q, torch.tensor([p]), w)  # what attention hands the layer's observer
        if p == 25:
            event_q = q[0, 1, 0].clone()
        driver.after_decode_step()
    events = state.layers[0].events
    assert events.valid[0, 1].tolist() == [True, False] and events.pos[0, 1, 0].item() == 25
    torch.testing.assert_close(events.q[0, 1, 0], event_q)
    assert not events.valid[0, 0].any() and int(state.flagged[0]) == 1
    assert policy.held_queries(state)[0] == BeaconKV.held_queries(policy, state)[0] + 2


def test_pooled_beacon_scores_keep_a_span_around_what_a_query_looks_at():
    # one beacon query looks at position 40 only; unpooled, its neighbours score ~0 and go; max-pooled over
    # 7 slots, positions 37..43 score as 40 does and all stay (a number's digits after its lead-in)
    from beaconkv.policies.scoring import pool_slots

    scores = torch.zeros(1, 1, 64)
    scores[0, 0, 40] = 1.0
    pooled = pool_slots(scores, 7, "max")[0, 0]
    assert pooled[37:44].tolist() == [1.0] * 7 and float(pooled[:37].sum() + pooled[44:].sum()) == 0.0
    policy = make_policy("beacon_pool", 128)
    assert (policy.kernel, policy.pool) == (7, "max") and policy_defaults("beacon_pool")["kernel"] == 7
    assert make_policy("beacon", 128).kernel == 1  # the paper's: no pooling
    with pytest.raises(PolicyConfigError, match="kernel=4 must be odd"):
        make_policy("beacon", 128, kernel=4)
    with pytest.raises(PolicyConfigError, match="pool"):
        make_policy("beacon", 128, kernel=3, pool="median")


def test_a_pooled_beacon_eviction_keeps_the_neighbours_of_the_looked_at_key():
    # hand-made keys: every key 0 except position 20, which the (unrotated) beacon query e0 attends to
    def keys_at(p, h):
        k = torch.zeros(8)
        if p == 20:
            k[0] = 8.0
        return k

    kept_sets = {}
    for kernel in (1, 7):
        layer = drive_hand(BeaconKV(32, n_beacon=2, n_recent=4, n_prefix=2, kernel=kernel), 60, keys_at, steps=0)
        kept_sets[kernel] = set(kept(layer, 0))
    assert 20 in kept_sets[1] and 20 in kept_sets[7]
    assert set(range(17, 24)) <= kept_sets[7]
    assert not set(range(17, 24)) - {20} <= kept_sets[1]


def test_a_policy_written_for_the_older_interface_keeps_working_with_a_warning():
    # the custom-policy guide's older KeyNorm: score(self, state, layer_state, cache, rows, t), an old hook name
    with pytest.warns(DeprecationWarning) as caught:
        class OldKeyNorm(BeaconKV):
            def score(self, state, layer_state, cache, rows, t):
                assert state is cache.state and layer_state is cache.layer_state
                return -cache.keys(rows).float().norm(dim=-1)

            def after_evict(self, state, rows):
                evicted.extend(rows)
                super().on_evict(state, rows)

    messages = " ".join(str(w.message) for w in caught)
    assert "score(self, layer, rows, t)" in messages and "after_evict is now called on_evict" in messages
    evicted: list[int] = []
    old = drive(OldKeyNorm(32, n_beacon=4, n_recent=4, telemetry=True), [9], steps=60)[1]
    assert old.stats.evictions[0] > 0 and evicted.count(0) == old.stats.evictions[0]


def test_overriding_what_moved_to_the_driver_is_refused_with_the_hook_to_use():
    with pytest.raises(TypeError, match=r"overrides evict\(\), which moved .*PolicyDriver.*before_evict"):
        class Evicting(BeaconKV):
            def evict(self, state, rows):
                pass
    with pytest.raises(TypeError, match=r"overrides admit\(\).*on_admit\(state, rows\)"):
        class Admitting(BeaconKV):
            def admit(self, state, rows, prompt_lengths):
                pass
