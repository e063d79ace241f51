"""The baselines (StreamingLLM, H2O, SnapKV, RPC, R-KV): each scoring recipe pinned against a loop-by-loop
reference on a hand-built cache, one hand-checkable eviction each, their cadences, and generation on
the tiny llama (bounded cache, evictions, ragged batch = single runs).

The references below are written independently of the library: RoPE, softmax, pooling and the
R-KV redundancy are spelled out per query, per head and per slot in float64.
"""

from __future__ import annotations

import math

import pytest
import torch

import beaconkv
from beaconkv.cache import KVCache
from beaconkv.models.rope import RotaryEmbedding
from beaconkv.policies.config import PolicyConfigError
from beaconkv.policies.h2o import ACC, H2O
from beaconkv.policies.observer import ObservedLayer
from beaconkv.policies.rkv import RKV
from beaconkv.policies.rpc import RPC
from beaconkv.policies.snapkv import SnapKV
from beaconkv.policies.streaming import StreamingLLM

from .driver import bind, drive_hand, dull_keys, kept, tap

D, N_KV, HEADS, CAP, RING = 4, 2, 4, 12, 6
GROUP = HEADS // N_KV
PROMPTS = [3, 2]
# per (row, kv head): filled slots in position order; rows differ in length, heads in kept positions
POSITIONS = [
    [[0, 1, 2, 3, 5, 6, 8, 9, 10, 11, 12, 13], [0, 1, 2, 3, 4, 6, 7, 9, 10, 11, 12, 13]],
    [[0, 1, 2, 3, 5, 6, 7, 8], [0, 1, 2, 4, 5, 6, 7, 8]],
]
T = [13, 8]


pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------- hand-built cache
def hand_cache(policy, seed=0) -> tuple[ObservedLayer, torch.Tensor, torch.Tensor]:
    """A bound one-layer cache with random keys (junk in empty slots too) and a query ring larger than
    any test window (stale ring entries must be filtered by position). The layer is the policy's
    observer of it (``layer.cache`` the store, ``layer.ring_buffer`` the ring, ``layer.state`` the state)."""
    g = torch.Generator().manual_seed(seed)
    cache = KVCache.allocate(1, 2, N_KV, HEADS, CAP, D)
    layer = bind(policy, cache, RotaryEmbedding(D), PROMPTS, query_window=RING).state.observers[0]
    assert layer.query_window == RING
    layer.cache.k.copy_(torch.randn(layer.cache.k.shape, generator=g))
    layer.ring_buffer.queries.copy_(torch.randn(layer.ring_buffer.queries.shape, generator=g))
    layer.cache.pos.fill_(-1)
    for b, heads in enumerate(POSITIONS):
        for h, ps in enumerate(heads):
            layer.cache.pos[b, h, : len(ps)] = torch.tensor(ps)
        layer.cache.length[b] = len(heads[0])
        for p in range(T[b] - RING + 1, T[b] + 1):
            layer.ring_buffer.query_pos[b, p % RING] = p
    return layer, torch.tensor([1, 0]), torch.tensor([T[1], T[0]])  # rows in reverse order on purpose


def rope_ref(x: torch.Tensor, p: int, theta: float = 10000.0) -> torch.Tensor:
    """Rotate-half RoPE of one vector at position p, written out."""
    half = x.shape[0] // 2
    out = torch.empty(x.shape[0], dtype=torch.float64)
    for i in range(half):
        f = p / theta ** (2 * i / x.shape[0])
        c, s = math.cos(f), math.sin(f)
        out[i] = x[i] * c - x[i + half] * s
        out[i + half] = x[i + half] * c + x[i] * s
    return out


def softmax_ref(logits: dict[int, float]) -> dict[int, float]:
    m = max(logits.values())
    e = {j: math.exp(v - m) for j, v in logits.items()}
    z = sum(e.values())
    return {j: v / z for j, v in e.items()}


def pool_ref(x: list[float], kernel: int, mode: str) -> list[float]:
    """Stride-1 pooling over the slots that exist (the ends average / max fewer slots)."""
    r, out = kernel // 2, []
    for j in range(len(x)):
        win = x[max(0, j - r): j + r + 1]
        out.append(sum(win) / len(win) if mode == "avg" else max(win))
    return out


def window_queries(layer, b, t, window):
    """[(position, {head: rotated query})] of the last ``window`` positions present in the ring."""
    out = []
    for p in range(t - window + 1, t + 1):
        slot = p % RING
        if int(layer.ring_buffer.query_pos[b, slot]) == p:
            out.append((p, {h: rope_ref(layer.ring_buffer.queries[b, h, slot].double(), p) for h in range(HEADS)}))
    return out


def attention_ref(layer, b, h_q, q, visible) -> dict[int, float]:
    """Softmax of one rotated query over the visible slots of its KV head."""
    kv = h_q // GROUP
    return softmax_ref({j: float(q @ layer.cache.k[b, kv, j].double()) / math.sqrt(D) for j in visible})


def check_rows(policy, layer, rows, t, ref_fn, atol=1e-6):
    got = policy.score(layer, rows, t)
    assert got.shape == (len(rows), N_KV, CAP)
    for i, b in enumerate(rows.tolist()):
        for kv in range(N_KV):
            want = torch.tensor(ref_fn(layer, b, kv, int(t[i])), dtype=torch.float32)
            torch.testing.assert_close(got[i, kv], want, atol=atol, rtol=0)


# ------------------------------------------------------------------- score recipes
def test_streaming_score_is_position_with_sinks_first():
    policy = StreamingLLM(16, n_sink=2, n_recent=2)
    layer, rows, t = hand_cache(policy)

    def ref(layer, b, kv, t):
        out = []
        for j in range(CAP):
            p = int(layer.cache.pos[b, kv, j])
            out.append(math.inf if PROMPTS[b] <= p < PROMPTS[b] + 2 else float(p))
        return out

    check_rows(policy, layer, rows, t, ref)


def test_h2o_hook_accumulates_group_sums_and_score_protects_recent():
    policy = H2O(16, recent_ratio=0.25, n_recent=2)  # B_min 14 -> 3 recent positions
    layer, rows, t = hand_cache(policy)
    g = torch.Generator().manual_seed(1)
    steps = [torch.rand(2, N_KV, GROUP, CAP, generator=g) for _ in range(3)]
    for w in steps:
        tap(layer, w)
    total = sum(w.double() for w in steps)

    def ref(layer, b, kv, t):
        out = []
        for j in range(CAP):
            acc = sum(float(total[b, kv, h, j]) for h in range(GROUP))
            out.append(math.inf if int(layer.cache.pos[b, kv, j]) > t - 3 else acc)
        return out

    assert policy.n_recent_h2o == 3
    check_rows(policy, layer, rows, t, ref, atol=1e-5)


def test_snapkv_score_matches_loop_reference():
    policy = SnapKV(16, window=4, kernel=5, n_recent=2)
    layer, rows, t = hand_cache(policy)

    def ref(layer, b, kv, t):
        raw = [0.0] * CAP
        queries = window_queries(layer, b, t, 4)
        for h in range(kv * GROUP, (kv + 1) * GROUP):
            for p, q in queries:
                visible = [j for j in range(CAP) if 0 <= int(layer.cache.pos[b, kv, j]) <= p]
                for j, w in attention_ref(layer, b, h, q[h], visible).items():
                    raw[j] += w / len(queries) / GROUP
        return pool_ref(raw, 5, "avg")

    check_rows(policy, layer, rows, t, ref)
    observed = policy.observed_positions(layer, rows, t)  # (rows, ring): -1 for stale entries
    for i, b in enumerate(rows.tolist()):
        assert sorted(observed[i][observed[i] >= 0].tolist()) == list(range(T[b] - 3, T[b] + 1))
        assert int((observed[i] == -1).sum()) == RING - 4


@pytest.mark.parametrize("group_reduce", ["mean", "all_heads"])
def test_rpc_score_matches_loop_reference(group_reduce):
    policy = RPC(16, window=4, kernel=7, group_reduce=group_reduce, n_recent=2)
    layer, rows, t = hand_cache(policy)

    def per_head(layer, b, h, t):
        kv, raw = h // GROUP, [0.0] * CAP
        for p, q in window_queries(layer, b, t, 4):
            visible = [j for j in range(CAP) if PROMPTS[b] <= int(layer.cache.pos[b, kv, j]) <= p]
            for j, w in attention_ref(layer, b, h, q[h], visible).items():
                raw[j] += w  # sum over the queries
        return raw

    def ref(layer, b, kv, t):
        heads = range(kv * GROUP, (kv + 1) * GROUP) if group_reduce == "mean" else range(HEADS)
        per = [per_head(layer, b, h, t) for h in heads]
        return pool_ref([sum(col) / len(per) for col in zip(*per)], 7, "avg")

    if group_reduce == "all_heads":  # one shared score per sequence needs the same positions in every KV head
        layer.cache.pos[:, 1] = layer.cache.pos[:, 0]
    check_rows(policy, layer, rows, t, ref)


def rkv_redundancy_ref(layer, b, kv, threshold):
    """R-KV's redundancy (reference code recipe) over the filled evictable slots, written out."""
    keys = [j for j in range(CAP) if int(layer.cache.pos[b, kv, j]) >= PROMPTS[b]]
    unit = {j: layer.cache.k[b, kv, j].double() / (layer.cache.k[b, kv, j].double().norm() + 1e-8) for j in keys}
    S = {(i, j): (0.0 if i == j else float(unit[i] @ unit[j])) for i in keys for j in keys}
    for i in keys:
        similar = [j for j in keys if S[(i, j)] > threshold]
        if similar:
            S[(i, max(similar))] = 0.0  # spare the most recent similar neighbour
    mean = {j: sum(S[(i, j)] for i in keys) / len(keys) for j in keys}
    red = softmax_ref(mean)
    return [red.get(j, 0.0) for j in range(CAP)]


@pytest.mark.parametrize("lam", [0.1, 0.6])
def test_rkv_score_matches_loop_reference(lam):
    w_obs = 3
    policy = RKV(16, window=w_obs, kernel=7, lam=lam, threshold=0.3, n_recent=2)
    layer, rows, t = hand_cache(policy)

    def ref(layer, b, kv, t):
        raw = [0.0] * CAP
        queries = window_queries(layer, b, t, w_obs)
        seen = [j for j in range(CAP) if 0 <= int(layer.cache.pos[b, kv, j]) <= t - w_obs]
        for p, q in queries:
            logits = {}
            for j in seen:  # max over the GQA group on the logits, before the softmax
                logits[j] = max(float(q[h] @ layer.cache.k[b, kv, j].double()) / math.sqrt(D)
                                for h in range(kv * GROUP, (kv + 1) * GROUP))
            for j, w in softmax_ref(logits).items():
                raw[j] += w / len(queries)
        importance = pool_ref(raw, 7, "max")
        redundancy = rkv_redundancy_ref(layer, b, kv, 0.3)
        top = float(torch.finfo(torch.float32).max)  # the window: above any score, below the base's +inf
        return [top if int(layer.cache.pos[b, kv, j]) > t - w_obs else lam * importance[j] - (1 - lam) * redundancy[j]
                for j in range(CAP)]

    check_rows(policy, layer, rows, t, ref)


def test_rkv_redundancy_spares_the_newest_duplicate():
    from beaconkv.policies.rkv import key_redundancy

    e = torch.eye(8)
    keys = torch.stack([e[0], e[1], e[0], -e[1], e[0], e[2]])[None, None]  # duplicates at 0, 2, 4
    red = key_redundancy(keys, torch.ones(1, 1, 6, dtype=torch.bool), threshold=0.5)[0, 0]
    # column sums: slot 0 <- rows 2, 4 (2); slot 2 <- row 0 only (row 4 spares it); slot 4 <- none
    mean = torch.tensor([2.0, -1.0, 1.0, -1.0, 0.0, 0.0]) / 6
    torch.testing.assert_close(red, mean.softmax(-1))


# ------------------------------------------------------- hand-checkable evictions
@pytest.mark.parametrize("make", [
    lambda: SnapKV(16, window=4, kernel=1, n_recent=2),
    lambda: RPC(16, window=4, kernel=1, n_recent=2),
], ids=["snapkv", "rpc"])
def test_attention_policies_evict_the_unattended_keys(make):
    # prefix 2; positions 2..17 fill B_max=16 at t=17 -> keep B_min=14: recent {16, 17} + 12 of 2..15
    policy = make()
    layer = drive_hand(policy, 2, dull_keys({0: {5, 9}, 1: {3, 12}}), steps=16)
    assert layer.state.stats.evictions == [1]
    assert kept(layer, 0) == [p for p in range(18) if p not in (5, 9)]
    assert kept(layer, 1) == [p for p in range(18) if p not in (3, 12)]


def test_rkv_evicts_the_older_duplicates():
    # lam=0: redundancy only. e0 repeats at 4, 7, 10: slot 4 is twice redundant, 7 once, 10 spared.
    basis = torch.eye(8)
    others = iter([basis[i] for i in range(1, 8)] + [-basis[i] for i in range(1, 8)])
    table = {p: (basis[0] if p in (4, 7, 10) else next(others)) for p in range(2, 18)}
    policy = RKV(16, window=2, lam=0.0, n_recent=2)
    layer = drive_hand(policy, 2, lambda p, h: table.get(p, basis[0]), steps=16)
    assert kept(layer, 0) == kept(layer, 1) == [p for p in range(18) if p not in (4, 7)]


def test_streaming_keeps_sinks_and_the_most_recent():
    policy = StreamingLLM(8, n_sink=2, n_recent=1)  # B_min 7: sinks 3, 4 + the 5 newest
    layer = drive_hand(policy, 3, lambda p, h: torch.zeros(8), steps=8)
    assert layer.state.stats.evictions == [1]
    assert kept(layer, 0) == kept(layer, 1) == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10]


def test_h2o_keeps_heavy_hitters_and_recent_and_moves_the_buffer():
    # prefix 2, positions 2..9 fill B_max=8 at t=9; B_min 7 = 3 recent (7, 8, 9) + 4 heavy of 2..6
    policy = H2O(8, recent_ratio=0.5, n_recent=1)
    light = {0: 4, 1: 2}  # the one position per KV head that gets the least attention
    before = {}

    def attention(layer, step):
        if step == 7:  # just before the eviction check of the last write
            w = torch.zeros(1, 2, 1, layer.capacity)
            for h in range(2):
                for slot in range(2, 7):
                    w[0, h, 0, slot] = 0.01 if slot == light[h] else 0.1 + 0.01 * slot
            tap(layer, w)
            before.update({(h, int(p)): float(a) for h in range(2)
                           for p, a in zip(layer.cache.pos[0, h], layer.slot_buffers[ACC][0, h]) if p >= 0})

    layer = drive_hand(policy, 2, lambda p, h: torch.zeros(8), steps=8, attention=attention)
    assert policy.n_recent_h2o == 3 and layer.state.stats.evictions == [1]
    for h in range(2):
        assert kept(layer, h) == [p for p in range(10) if p != light[h]]
        moved = layer.slot_buffers[ACC][0, h, : len(kept(layer, h))].tolist()
        assert moved == pytest.approx([before[(h, p)] for p in kept(layer, h)])


# ------------------------------------------------------------------- validation
@pytest.mark.parametrize("make, match", [
    (lambda: StreamingLLM(128, n_sink=-1), "n_sink=-1"),
    (lambda: StreamingLLM(128, n_sink=100), "n_sink=100"),
    (lambda: H2O(128, recent_ratio=1.5), "recent_ratio=1.5"),
    (lambda: SnapKV(128, window=0), "window=0"),
    (lambda: SnapKV(128, kernel=4), "kernel=4"),
    (lambda: RPC(128, kernel=0), "kernel=0"),
    (lambda: RPC(128, group_reduce="max"), "group_reduce='max'"),
    (lambda: RKV(128, lam=1.2), "lam=1.2"),
    (lambda: RKV(128, threshold=2.0), "threshold=2.0"),
    (lambda: RKV(128, window=-1), "window=-1"),
])
def test_bad_settings_are_rejected_with_the_value(make, match):
    with pytest.raises(PolicyConfigError, match=match):
        make()


# ---------------------------------------------------------- through generation
def test_h2o_buffer_equals_attention_recomputed_by_transformers(llama, tiny_models):
    hf = tiny_models["llama"][1]
    prompt = torch.randint(3, 97, (20,), generator=torch.Generator().manual_seed(7)).tolist()
    out = beaconkv.generate(llama, None, [prompt], max_new_tokens=6, eos_token_ids=[], policy=H2O(128))
    ids = torch.tensor([prompt + out.token_ids[0][:-1]])  # the last sampled token is never fed back
    with torch.no_grad():
        attn = hf(ids, output_attentions=True).attentions  # per layer (1, heads, L, L)
    for i, layer in enumerate(out.policy_state.observers):
        decode_rows = attn[i][0, :, len(prompt):, :]  # (heads, steps, L): the decode queries
        want = decode_rows.sum(1).view(layer.n_kv_heads, -1, ids.shape[1]).sum(1)  # (kv_heads, L)
        got = layer.slot_buffers[ACC][0, :, : ids.shape[1]]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


BUDGET_POLICIES = {
    "streaming": lambda: StreamingLLM(128),
    "h2o": lambda: H2O(128),
    "snapkv": lambda: SnapKV(128),
    "rpc": lambda: RPC(128),
    "rkv": lambda: RKV(128),
}


@pytest.mark.parametrize("name", sorted(BUDGET_POLICIES))
def test_generation_stays_in_budget_and_ragged_batch_equals_single_runs(llama, name):
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (20, 13, 27)]
    policy = BUDGET_POLICIES[name]()
    assert policy.name == name

    def checked_step(step, session):
        for layer in session.cache.layers:
            lengths = layer.length.tolist()
            assert all(n <= p + 128 for n, p in zip(lengths, session.state.prefix))
            assert torch.equal((layer.pos >= 0).sum(-1), layer.length[:, None].expand(-1, layer.n_kv_heads))

    batch = beaconkv.generate(llama, None, prompts, max_new_tokens=200, eos_token_ids=[], policy=policy,
                              on_step=checked_step)
    assert batch.stats.evictions == [5, 5, 5]  # 199 writes: 128, then every 16
    assert batch.stats.cache_capacity == 27 + 128
    singles = [beaconkv.generate(llama, None, [p], max_new_tokens=200, eos_token_ids=[],
                                 policy=BUDGET_POLICIES[name]()).token_ids[0] for p in prompts]
    assert batch.token_ids == singles
