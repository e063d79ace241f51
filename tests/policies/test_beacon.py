"""BeaconKV worked examples small enough to check by hand, plus configuration errors."""

from __future__ import annotations

import math

import pytest
import torch

import beaconkv
from beaconkv.cache import KVCache
from beaconkv.models.rope import RotaryEmbedding
from beaconkv.policies import (
    BeaconKV,
    FullKV,
    InitialRecent,
    PolicyConfigError,
    make_policy,
)
from beaconkv.policies.beacon import QuerySet
from beaconkv.policies.query_selection import farthest_point_sampling

from .driver import bind, drive


def test_freeze_happens_when_evictable_count_reaches_budget_minus_recent():
    policy = BeaconKV(budget=64, n_beacon=4, n_recent=8)
    phases = []
    _, state = drive(policy, [10], steps=70, on_step=lambda s, st: phases.append((st.count[0], st.phase[0])))
    # count after step s is s + 1 (whole prompt protected); freeze at 64 - 8 = 56; evict at 64 -> 56 = B_min
    first_frozen = next(c for c, ph in phases if ph == "frozen")
    assert first_frozen == 56
    assert all(ph == "accumulate" for c, ph in phases[:55])
    # budget - B_min == n_recent: after the eviction the count is 56 again and the freeze is immediate
    assert phases[63] == (56, "frozen") and state.stats.evictions == [1]


def test_budget_128_freezes_immediately_after_each_eviction():
    policy = BeaconKV(budget=128)  # B_min = 112 = 128 - 16
    seen = []
    drive(policy, [4], steps=150, n_layers=1, on_step=lambda s, st: seen.append((st.count[0], st.phase[0])))
    after_evict = seen[127]
    assert after_evict == (112, "frozen")


def _bound_policy(policy, batch=1, n_kv=1, group=2, cap=16, D=4, window=None):
    """A one-layer cache bound to the policy; its state is ``cache.state`` (its layer as the policy sees
    it: ``cache.state.observers[0]``)."""
    cache = KVCache.allocate(1, batch, n_kv, n_kv * group, cap, D)
    rope = RotaryEmbedding(D)
    cache.state = bind(policy, cache, rope, [cap // 2] * batch, max_tokens=cap, query_window=window or 0).state
    return cache, rope


def _set_recent(state, t, recent_since):
    """Places row 0 at newest position ``t`` with recent queries after ``recent_since`` (host and device)."""
    state.t[0], state.recent_since[0] = t, recent_since
    state.t_dev[0], state.recent_since_dev[0] = t, recent_since


def test_beacons_rotate_to_t_and_recent_queries_to_their_own_positions():
    g = torch.Generator().manual_seed(0)
    policy = BeaconKV(budget=8, n_beacon=2, n_recent=1, ratio=0.5)
    cache, rope = _bound_policy(policy)
    layer = cache.state.observers[0]
    H, D = layer.n_heads, layer.head_dim
    beacons = torch.randn(1, H, 2, D, generator=g)
    state = cache.state
    state.layers[0].beacons.assign(torch.tensor([0]), QuerySet(beacons, torch.tensor([[[3, 5]] * H]),
                                                               torch.ones(1, H, 2, dtype=torch.bool)))
    recent = torch.randn(1, H, 1, D, generator=g)
    layer.ring_buffer.queries[:, :, 11 % layer.query_window] = recent[:, :, 0]
    layer.ring_buffer.query_pos[0, 11 % layer.query_window] = 11
    _set_recent(state, 11, 10)
    q_rot, q_mask, q_pos, source = policy.observation_queries(state, state.layers[0], layer, torch.tensor([0]),
                                                              torch.tensor([11]))

    def by_hand(x, p):  # rotate-half RoPE written out
        inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
        ang = torch.cat([p * inv, p * inv])
        a, b = x[..., : D // 2], x[..., D // 2 :]
        return x * ang.cos() + torch.cat([-b, a], -1) * ang.sin()

    torch.testing.assert_close(q_rot[0, :, 0], by_hand(beacons[0, :, 0], 11.0))
    torch.testing.assert_close(q_rot[0, :, 1], by_hand(beacons[0, :, 1], 11.0))
    i = 2 + 11 % layer.query_window  # the recent query's ring slot, after the 2 beacons
    torch.testing.assert_close(q_rot[0, :, i], by_hand(recent[0, :, 0], 11.0))  # its own position (= t here)
    assert q_mask[0].nonzero().flatten().tolist() == [0, 1, i]
    assert q_pos[0, [0, 1, i]].tolist() == [11, 11, 11] and source[0, [0, 1, i]].tolist() == [3, 5, 11]


def test_recent_query_is_rotated_to_its_own_position_not_t():
    policy = BeaconKV(budget=8, n_beacon=0, n_recent=2, ratio=0.5)
    cache, rope = _bound_policy(policy, group=1)
    layer = cache.state.observers[0]
    x = torch.randn(1, 1, 1, layer.head_dim)
    layer.ring_buffer.queries[:, :, 9 % layer.query_window] = x[:, :, 0]
    layer.ring_buffer.query_pos[0, 9 % layer.query_window] = 9
    state = cache.state
    _set_recent(state, 10, 8)
    q_rot, q_mask, q_pos, _ = policy.observation_queries(state, state.layers[0], layer, torch.tensor([0]),
                                                         torch.tensor([10]))
    i = q_mask[0].nonzero()[0, 0]
    assert q_pos[0, i] == 9
    torch.testing.assert_close(q_rot[0, :, i], rope.rotate(x, torch.tensor([[9]]))[0, :, 0])


def test_max_aggregation_over_group_and_queries_matches_loops():
    g = torch.Generator().manual_seed(1)
    policy = BeaconKV(budget=8, n_beacon=2, n_recent=2, ratio=0.5)
    cache, rope = _bound_policy(policy, n_kv=2, group=2, cap=10, D=4)
    layer = cache.state.observers[0]
    n = 7
    layer.cache.k[:, :, :n] = torch.randn(1, 2, n, 4, generator=g)
    layer.cache.pos[:, :, :n] = torch.tensor([0, 1, 2, 4, 5, 6, 7])
    layer.cache.length[:] = n
    H = 4
    beacons = torch.randn(1, H, 2, 4, generator=g)
    state = cache.state
    state.layers[0].beacons.assign(torch.tensor([0]), QuerySet(beacons, torch.tensor([[[1, 2]] * H]),
                                                               torch.ones(1, H, 2, dtype=torch.bool)))
    rq = torch.randn(1, H, 2, 4, generator=g)
    for j, p in enumerate((6, 7)):
        layer.ring_buffer.queries[:, :, p % layer.query_window] = rq[:, :, j]
        layer.ring_buffer.query_pos[0, p % layer.query_window] = p
    _set_recent(state, 7, 5)
    score = policy.score(layer, torch.tensor([0]), torch.tensor([7]))
    ref = torch.zeros(2, 10)
    keys_pos = layer.cache.pos[0]
    for kv in range(2):
        for h in (2 * kv, 2 * kv + 1):
            queries = [(rope.rotate(beacons[:, h : h + 1, j : j + 1], torch.tensor([[7]]))[0, 0, 0], 7) for j in range(2)]
            queries += [(rope.rotate(rq[:, h : h + 1, j : j + 1], torch.tensor([[p]]))[0, 0, 0], p)
                        for j, p in enumerate((6, 7))]
            for q, qp in queries:
                logits = [float(q @ layer.cache.k[0, kv, s]) / 2.0 if 0 <= keys_pos[kv, s] <= qp else -math.inf
                          for s in range(10)]
                w = torch.tensor(logits).softmax(-1)
                ref[kv] = torch.maximum(ref[kv], w)
    torch.testing.assert_close(score[0], ref, atol=1e-6, rtol=0)


def test_roll_makes_observation_set_fps_of_beacons_and_recent():
    policy = BeaconKV(budget=64, n_beacon=4, n_recent=8)
    snapshot = {}

    def watch(step, state):
        if state.phase[0] == "frozen" and step == 62:  # last step before the first eviction
            snapshot["beacons"] = state.layers[0].beacons.rows(torch.tensor([0]))
            layer = state.observers[0]
            snapshot["ring"] = (layer.ring_buffer.queries[0].clone(), layer.ring_buffer.query_pos[0].clone(), state.recent_since[0])
        if step == 63:
            snapshot["obs"] = state.layers[0].obs.rows(torch.tensor([0]))

    cache, state = drive(policy, [5], steps=64, n_layers=1, group=2, on_step=watch)
    q, qpos, since = snapshot["ring"]
    # the recent set at the eviction (step 63 wrote position 5 + 63 = 68) is positions since+1 .. 68
    assert since == 5 + 63 - 8
    b = snapshot["beacons"]
    # rebuild the recent queries as they were at the eviction: the ring slot of position 68 was written after
    assert state.stats.evictions == [1]
    obs = snapshot["obs"]
    assert obs.valid.all() and obs.q.shape[2] == 4
    # every observation vector is one of the beacons or one of the 8 recent queries (positions 61..68)
    ok = set(b.pos[0, 0].tolist()) | set(range(61, 69))
    assert set(obs.pos[0, 0].tolist()) <= ok
    # and they are exactly FPS of that union
    layer = state.observers[0]
    R = layer.query_window
    rec_pos = torch.arange(61, 69)
    rec_q = layer.ring_buffer.queries[0][:, rec_pos % R]  # (heads, 8, D) — ring untouched since the eviction
    union = torch.cat([b.q[0], rec_q], dim=1)
    idx, _ = farthest_point_sampling(union, 4)
    expect_pos = torch.cat([b.pos[0], rec_pos.expand(union.shape[0], -1)], dim=1).gather(1, idx)
    assert torch.equal(obs.pos[0], expect_pos)


def test_initial_recent_beacons_never_change():
    policy = InitialRecent(budget=64, n_beacon=4, n_recent=8)
    first = {}

    def watch(step, state):
        cur = state.layers[0].beacons.pos.clone()
        first.setdefault("pos", cur)
        assert torch.equal(first["pos"], cur)
        assert (cur < 12).all()  # all beacons come from the 12-token prompt

    _, state = drive(policy, [12], steps=150, n_layers=1, on_step=watch)
    assert state.stats.evictions == [(150 - 64) // 8 + 1]


@pytest.mark.parametrize("n_beacon,n_recent", [(16, 16), (1, 31), (28, 4), (0, 32)])
def test_paper_ablations_are_one_argument_away(n_beacon, n_recent):
    policy = BeaconKV(budget=256, n_beacon=n_beacon, n_recent=n_recent)
    _, state = drive(policy, [6, 9], steps=300, n_layers=1, n_kv=1, group=2)
    assert state.stats.evictions == [2, 2]


def test_inconsistent_settings_name_the_numbers():
    with pytest.raises(PolicyConfigError, match=r"budget=64.*B_min=56.*8 < n_recent=16.*budget >= 128"):
        BeaconKV(budget=64, n_recent=16)  # an explicit n_recent the budget cannot serve
    # n_recent="auto" (the default), as the command line's --n-recent auto: 16 where it fits, budget // 8 below
    assert (BeaconKV(budget=64).n_recent, BeaconKV(budget=128).n_recent, BeaconKV(budget=4096).n_recent) == (8, 16, 16)
    assert BeaconKV(budget=256, ratio=0.95).n_recent == 13  # the eviction step, 256 - floor(0.95 * 256), < 16
    with pytest.raises(PolicyConfigError, match="ratio=1.5"):
        BeaconKV(budget=256, ratio=1.5)
    with pytest.raises(PolicyConfigError, match="aggregation='median'"):
        BeaconKV(budget=256, aggregation="median")
    with pytest.raises(PolicyConfigError, match="n_prefix=50 is longer than a prompt of 10 tokens"):
        BeaconKV(budget=256, n_prefix=50).capacity([10, 60], 100)
    with pytest.raises(PolicyConfigError, match="policy='lru' is unknown"):
        make_policy("lru", budget=128)


def test_float_budget_is_rejected_with_the_int_to_use():
    with pytest.raises(PolicyConfigError, match=r"budget=128\.0 must be an int, not float \(e\.g\. budget=128\)"):
        BeaconKV(budget=128.0)
    with pytest.raises(PolicyConfigError, match=r"policy='beacn' is unknown \(did you mean 'beacon'\?\)"):
        make_policy("beacn", budget=128)


def test_budget_larger_than_generation_never_evicts_and_equals_fullkv(tiny_models):
    model = beaconkv.load_model(tiny_models["qwen3"][0])
    prompts = [[5, 6, 7, 8, 9], list(range(10, 40))]
    full = beaconkv.generate(model, None, prompts, max_new_tokens=40, eos_token_ids=[], policy=FullKV())
    for name in ("beacon", "initial_recent", "snapkv", "rpc", "rkv", "h2o", "streaming"):
        out = beaconkv.generate(model, None, prompts, max_new_tokens=40, eos_token_ids=[],
                                policy=make_policy(name, budget=512))
        assert out.stats.evictions == [0, 0], name
        assert out.token_ids == full.token_ids, name
