"""The rivals beyond the paper's baselines (ExpectedAttention, TOVA, KeyDiff, KNorm, LazyEviction, TriAttention): each
score pinned against a reference written out here in float64 on the hand-built cache of
:mod:`tests.policies.test_baselines`, one hand-checkable eviction each, and their settings' errors.

The references do not reuse the library's helpers: RoPE, the averaged rotation (a matrix built from
rotated basis vectors), the Gaussian statistics, softmax, the recurrence bookkeeping and TriAttention's
trigonometric series (in complex numbers, from the un-rotated keys) are spelled out per head and per slot.
"""

from __future__ import annotations

import cmath
import math

import pytest
import torch

from beaconkv.cache import KVCache
from beaconkv.models.config import RopeConfig
from beaconkv.models.rope import RotaryEmbedding
from beaconkv.policies import make_policy
from beaconkv.policies.config import PolicyConfigError
from beaconkv.policies.expected_attention import ExpectedAttention, apply_rotation, mean_rotation
from beaconkv.policies.keydiff import KeyDiff
from beaconkv.policies.knorm import KNorm
from beaconkv.policies.lazy_eviction import MRI, SEEN, LazyEviction
from beaconkv.policies.tova import TOVA
from beaconkv.policies.triattention import TriAttention, geometric_offsets, rotary_gain

from .driver import IdentityRope, bind, drive_hand, dull_keys, kept, tap
from .test_baselines import CAP, GROUP, HEADS, N_KV, PROMPTS, D, check_rows, hand_cache, pool_ref, rope_ref, softmax_ref

pytestmark = pytest.mark.usefixtures("one_thread")


def filled_slots(layer, b, kv) -> list[int]:
    return [j for j in range(CAP) if int(layer.cache.pos[b, kv, j]) >= 0]


def with_values(layer, seed=5):
    """Random values in every slot (the hand cache leaves them zero)."""
    layer.cache.v.copy_(torch.randn(layer.cache.v.shape, generator=torch.Generator().manual_seed(seed)))
    return layer


# ------------------------------------------------------------------- KNorm
def test_knorm_score_is_minus_the_key_norm():
    policy = KNorm(16, n_recent=2)
    layer, rows, t = hand_cache(policy)

    def ref(layer, b, kv, t):
        return [-math.sqrt(sum(float(x) ** 2 for x in layer.cache.k[b, kv, j].double())) for j in range(CAP)]

    check_rows(policy, layer, rows, t, ref, atol=1e-5)


def test_knorm_keeps_the_lowest_norm_keys():
    # prefix 2; positions 2..17 fill B_max=16 at t=17 -> keep B_min=14: recent {16, 17} + 12 of 2..15
    g = torch.Generator().manual_seed(3)
    norms = (torch.rand(18, 2, generator=g) * 9 + 1).tolist()  # distinct norms in [1, 10)
    directions = torch.nn.functional.normalize(torch.randn(18, 2, 8, generator=g), dim=-1)

    def keys_at(p, h):
        return directions[p, h] * norms[p][h]

    layer = drive_hand(KNorm(16, n_recent=2), 2, keys_at, steps=16)
    assert layer.state.stats.evictions == [1]
    for h in range(2):
        lowest = sorted(range(2, 16), key=lambda p: norms[p][h])[:12]
        assert kept(layer, h) == sorted({0, 1, 16, 17, *lowest})


@pytest.mark.parametrize("older_lower", [True, False])
def test_knorm_copies_of_one_key_tie_on_the_newer_whatever_the_rounding(older_lower):
    # prefix 2; at t=17 keep 12 of 2..15: the 11 lowest, then one of two copies of a key (3 and 11), whose
    # norms differ by one float32 rounding step as RoPE'd copies do (which one is lower depends on the CPU)
    g = torch.Generator().manual_seed(4)
    directions = torch.nn.functional.normalize(torch.randn(18, 8, generator=g), dim=-1)
    copy = directions[0] * 7.0
    bigger = copy * (1 + 2.0 ** -23)  # one rounding step longer
    assert float(bigger.norm()) != float(copy.norm())
    low = iter(torch.linspace(1, 5, 11).tolist())
    norms = {p: next(low) for p in range(2, 16) if p not in (3, 11, 14)} | {14: 9.0}

    def keys_at(p, h):
        if p in (3, 11):
            return copy if (p == 3) == older_lower else bigger
        return directions[p] * norms.get(p, 2.0)

    want = [0, 1, *sorted(set(norms) - {14} | {11}), 16, 17]
    assert kept(drive_hand(KNorm(16, n_recent=2), 2, keys_at, steps=16), 0) == want
    # the exact float32 norms keep the lower copy: the older one when it is the lower
    exact = kept(drive_hand(KNorm(16, n_recent=2, tie_rtol=0), 2, keys_at, steps=16), 0)
    assert exact == (sorted(set(want) - {11} | {3}) if older_lower else want)


def test_knorm_tie_rtol_must_be_in_zero_one():
    with pytest.raises(PolicyConfigError, match="tie_rtol=1"):
        KNorm(16, tie_rtol=1)
    with pytest.raises(PolicyConfigError, match="tie_rtol=nan"):
        KNorm(16, tie_rtol=math.nan)


# ------------------------------------------------------------------- KeyDiff
def keydiff_ref(layer, b, kv, t):
    """``-cos(k_j, mean of the unit filled keys)``, written out."""
    unit = {j: layer.cache.k[b, kv, j].double() / layer.cache.k[b, kv, j].double().norm()
            for j in filled_slots(layer, b, kv)}
    anchor = sum(unit.values()) / len(unit)
    out = []
    for j in range(CAP):
        k = layer.cache.k[b, kv, j].double()
        out.append(-float(k @ anchor) / (float(k.norm()) * float(anchor.norm())))
    return out


def test_keydiff_score_is_minus_the_cosine_to_the_mean_unit_key():
    policy = KeyDiff(16, n_recent=2)
    layer, rows, t = hand_cache(policy)
    check_rows(policy, layer, rows, t, keydiff_ref, atol=1e-5)


def test_keydiff_keeps_the_keys_least_like_the_average():
    # most keys point near e0; a few point elsewhere (the distinct ones survive), the rest are noise around e0
    e = torch.eye(8)
    distinct = {0: {4: e[1], 9: -e[2], 13: e[3]}, 1: {2: e[4], 7: -e[0], 11: e[5]}}

    def keys_at(p, h):
        noise = torch.randn(8, generator=torch.Generator().manual_seed(100 + p * 2 + h)) * 0.1
        return distinct[h].get(p, e[0] + noise)

    layer = drive_hand(KeyDiff(16, n_recent=2), 2, keys_at, steps=16)
    assert layer.state.stats.evictions == [1]
    for h in range(2):
        keys = torch.stack([keys_at(p, h) for p in range(18)]).double()
        unit = keys / keys.norm(dim=-1, keepdim=True)
        cos = unit @ (unit.mean(0) / unit.mean(0).norm())
        least_similar = sorted(range(2, 16), key=lambda p: float(cos[p]))[:12]
        assert set(distinct[h]) <= set(least_similar)
        assert kept(layer, h) == sorted({0, 1, 16, 17, *least_similar})


# ------------------------------------------------------------------- TOVA
@pytest.mark.parametrize("group_reduce", ["mean", "all_heads"])
def test_tova_score_is_the_last_query_attention_averaged_over_heads(group_reduce):
    policy = TOVA(16, group_reduce=group_reduce, n_recent=2)
    layer, rows, t = hand_cache(policy)
    if group_reduce == "all_heads":  # one shared score per sequence needs the same positions in every KV head
        layer.cache.pos[:, 1] = layer.cache.pos[:, 0]

    def per_head(layer, b, h, t):
        kv = h // GROUP
        q = rope_ref(layer.ring_buffer.queries[b, h, t % layer.query_window].double(), t)
        logits = {j: float(q @ layer.cache.k[b, kv, j].double()) / math.sqrt(D) for j in filled_slots(layer, b, kv)}
        w = softmax_ref(logits)
        return [w.get(j, 0.0) for j in range(CAP)]

    def ref(layer, b, kv, t):
        heads = range(kv * GROUP, (kv + 1) * GROUP) if group_reduce == "mean" else range(HEADS)
        per = [per_head(layer, b, h, t) for h in heads]
        return [sum(col) / len(per) for col in zip(*per)]

    check_rows(policy, layer, rows, t, ref)
    observed = policy.observed_positions(layer, rows, t)
    assert observed[:, :].max(-1).values.tolist() == t.tolist()  # the one query: step t's own


def test_tova_evicts_what_the_newest_query_ignores():
    policy = TOVA(16, n_recent=2)
    assert policy.query_window(100) == 1
    layer = drive_hand(policy, 2, dull_keys({0: {5, 9}, 1: {3, 12}}), steps=16)
    assert layer.state.stats.evictions == [1]
    assert kept(layer, 0) == [p for p in range(18) if p not in (5, 9)]
    assert kept(layer, 1) == [p for p in range(18) if p not in (3, 12)]


# ------------------------------------------------------------------- ExpectedAttention
def mean_rotation_matrix_ref(p0: int, n_future: int) -> torch.Tensor:
    """``mean_p R_p`` over positions ``p0 .. p0 + n_future - 1``, column ``j`` = ``e_j`` rotated (float64)."""
    eye = torch.eye(D, dtype=torch.float64)
    mats = [torch.stack([rope_ref(eye[j], p) for j in range(D)], dim=1) for p in range(p0, p0 + n_future)]
    return sum(mats) / n_future


def expected_attention_ref(window, n_future, use_covariance, use_vnorm, epsilon, kernel):
    def ref(layer, b, kv, t):
        R = mean_rotation_matrix_ref(t + 1, n_future)
        ring = layer.ring_buffer
        slots = [s for s in range(ring.window) if t - window < int(ring.query_pos[b, s]) <= t]
        per_head = []
        for h in range(kv * GROUP, (kv + 1) * GROUP):
            qs = torch.stack([ring.queries[b, h, s].double() for s in slots])  # (n, d)
            mu = qs.mean(0)
            cov = (qs - mu).T @ (qs - mu) / len(slots)
            mu_r, cov_r = R @ mu, R @ cov @ R.T
            logits = {}
            for j in filled_slots(layer, b, kv):
                k = layer.cache.k[b, kv, j].double()
                logits[j] = float(k @ mu_r) / math.sqrt(D) + (float(k @ cov_r @ k) / (2 * D) if use_covariance else 0.0)
            w = softmax_ref(logits)
            per_head.append([w.get(j, 0.0) for j in range(CAP)])
        scores = [sum(col) / GROUP for col in zip(*per_head)]
        if use_vnorm:
            scores = [(s + epsilon) * float(layer.cache.v[b, kv, j].double().norm()) for j, s in enumerate(scores)]
        return pool_ref(scores, kernel, "avg")
    return ref


@pytest.mark.parametrize("settings", [
    dict(window=4, n_future=7, use_covariance=True, use_vnorm=True, epsilon=0.0, kernel=1),
    dict(window=5, n_future=1, use_covariance=True, use_vnorm=True, epsilon=0.05, kernel=3),
    dict(window=3, n_future=20, use_covariance=False, use_vnorm=True, epsilon=0.0, kernel=1),
    dict(window=4, n_future=7, use_covariance=True, use_vnorm=False, epsilon=0.0, kernel=1),
], ids=["default", "epsilon-pooled", "mean-only", "no-vnorm"])
def test_expected_attention_score_matches_the_gaussian_formula(settings):
    s = settings
    policy = ExpectedAttention(16, window=s["window"], kernel=s["kernel"], n_future_positions=s["n_future"],
                               use_covariance=s["use_covariance"], use_vnorm=s["use_vnorm"], epsilon=s["epsilon"],
                               n_recent=2)
    layer, rows, t = hand_cache(policy)
    with_values(layer)
    check_rows(policy, layer, rows, t, expected_attention_ref(**s), atol=1e-5)


@pytest.mark.parametrize("rope", [
    RopeConfig(theta=1e4),
    RopeConfig(theta=5e5, rope_type="llama3", factor=8.0,
               params={"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    RopeConfig(theta=1e6, rope_type="yarn", factor=4.0, params={"original_max_position_embeddings": 64}),
], ids=["default", "llama3", "yarn"])
def test_the_mean_rotation_is_the_mean_of_the_rotated_vectors(rope):
    rotary = RotaryEmbedding(16, rope)
    x = torch.randn(2, 3, 5, 16, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([7, 300])
    cos, sin = mean_rotation(rotary, t, 33, 16)
    got = apply_rotation(x, cos[:, None, None], sin[:, None, None])
    want = torch.stack([rotary.rotate(x, (t[:, None] + p).expand(-1, 5)) for p in range(1, 34)]).mean(0)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_expected_attention_keeps_the_keys_the_queries_lean_towards():
    # every query e0 (the identity rope), so mean e0 and no spread: keys along -e0 expect almost no attention
    policy = ExpectedAttention(16, window=8, n_recent=2, use_vnorm=False)
    layer = drive_hand(policy, 2, dull_keys({0: {5, 9}, 1: {3, 12}}), steps=16)
    assert layer.state.stats.evictions == [1]
    assert kept(layer, 0) == [p for p in range(18) if p not in (5, 9)]
    assert kept(layer, 1) == [p for p in range(18) if p not in (3, 12)]


# ------------------------------------------------------------------- LazyEviction
def recurrence_ref(hits: dict[int, list[int]], p_written: int) -> tuple[int, int]:
    """(last hit, maximum recurrence interval) of a token written at ``p_written`` hit at the given steps."""
    last, mri = p_written, 0
    for s in hits.get(p_written, []):
        mri, last = max(mri, s - last), s
    return last, mri


def test_lazy_eviction_tracks_last_hits_and_recurrence_intervals():
    policy = LazyEviction(16, threshold=1.5, n_recent=2)
    layer, rows, t = hand_cache(policy)
    g = torch.Generator().manual_seed(2)
    hits = {(b, kv): {} for b in range(2) for kv in range(N_KV)}  # (row, kv head) -> position -> hit steps
    for step in range(6):
        now = [14 + step, 9 + step]  # each row's query position this step, past every position it holds
        layer.state.t_dev.copy_(torch.tensor(now) - 1)
        w = torch.rand(2, N_KV, GROUP, CAP, generator=g) ** 4
        w = w.masked_fill(~(layer.cache.pos >= 0)[:, :, None], 0.0)
        w = w / w.sum(-1, keepdim=True)
        tap(layer, w)
        for b in range(2):
            for kv in range(N_KV):
                n = len(filled_slots(layer, b, kv))
                for j in filled_slots(layer, b, kv):
                    if max(float(w[b, kv, h, j]) for h in range(GROUP)) * n >= 1.5:
                        hits[(b, kv)].setdefault(int(layer.cache.pos[b, kv, j]), []).append(now[b])
    assert sum(len(v) for h in hits.values() for v in h.values()) > 10  # the case has hits, and repeats
    assert any(len(v) >= 2 for h in hits.values() for v in h.values())

    def ref(layer, b, kv, t):
        out = []
        for j in range(CAP):
            last, mri = recurrence_ref(hits[(b, kv)], int(layer.cache.pos[b, kv, j]))
            out.append(float(last + mri - t))
        return out

    t = torch.tensor([now[1], now[0]])  # an eviction right after the last step (rows in reverse order)
    check_rows(policy, layer, rows, t, ref)


def test_lazy_eviction_evicts_the_overdue_tokens_and_moves_its_records():
    # prefix 2, positions 2..17 fill B_max=16 at t=17 -> keep 14: recent {16, 17} + 12 of 2..15
    policy = LazyEviction(16, n_recent=2)
    hit_steps = {  # position -> decode steps (query positions) at which it is attended (both KV heads)
        2: [5, 12],       # gap 3 then 7: last 12, MRI 7 -> slack 2, kept
        3: [3],           # only at its own step: last 3, MRI 0 -> slack -14, evicted
        4: [6, 16],       # last 16, MRI 10 -> slack 9, kept
        5: [],            # never: last 5 -> slack -12, evicted
        8: [9, 10, 11],   # last 11, MRI 1 -> slack -5, kept (younger than 3 and 5)
    }
    records = {}

    def attention(layer, step):
        p = 2 + step  # the query position of this step
        w = torch.zeros(1, 2, 1, layer.capacity)
        filled = int(layer.cache.length[0])
        w[0, :, 0, :filled] = 0.1 / filled  # everything well below a uniform share...
        for q, steps in hit_steps.items():
            if p in steps:
                w[0, :, 0, q] = 0.5  # ...but these
        tap(layer, w)
        if step == 15:
            records.update({int(pos): (int(s), int(m)) for pos, s, m in zip(
                layer.cache.pos[0, 0], layer.slot_buffers[SEEN][0, 0], layer.slot_buffers[MRI][0, 0]) if pos >= 0})

    layer = drive_hand(policy, 2, lambda p, h: torch.zeros(8), steps=16, attention=attention)
    assert layer.state.stats.evictions == [1]
    assert kept(layer, 0) == kept(layer, 1) == [p for p in range(18) if p not in (3, 5)]
    assert records[2] == (13, 7) and records[4] == (17, 10) and records[8] == (12, 1) and records[6] == (0, 0)
    n = len(kept(layer, 0))
    moved = list(zip(layer.slot_buffers[SEEN][0, 0, :n].tolist(), layer.slot_buffers[MRI][0, 0, :n].tolist()))
    assert moved == [records[p] for p in kept(layer, 0)]


# ------------------------------------------------------------------- TriAttention
def triattention_ref(prompt_q, window, centres, max_offset, offset_reduce, norm_term, trig, normalize, group_reduce):
    """TriAttention's score as the paper writes it: per frequency pair a complex number, the key un-rotated
    from its position, ``|c_f| |k_f| cos(w_f (t + 1 + D - p) + phi_f)`` summed over the pairs, plus the
    dispersion-weighted key norms; z-scored per query head over the evictable slots; reduced over the group."""
    half = D // 2
    omega = [1.0 / 10000.0 ** (2 * f / D) for f in range(half)]
    offsets = [2**i for i in range(max_offset.bit_length())]

    def pairs(x):
        return [complex(float(x[f]), float(x[f + half])) for f in range(half)]

    def queries(layer, b, h, t):
        ring = layer.ring_buffer
        if centres == "window":
            held = [int(ring.query_pos[b, s]) for s in range(ring.window)]
            return [ring.queries[b, h, s] for s, p in enumerate(held) if t - window < p <= t]
        # the prompt's queries (observed at prefill), then every ring query after the prompt
        prompt = [prompt_q[b, h, i] for i in range(PROMPTS[b])]
        return prompt + [ring.queries[b, h, s] for s in range(ring.window)
                         if PROMPTS[b] <= int(ring.query_pos[b, s]) <= t]

    def head_scores(layer, b, h, t):
        kv = h // GROUP
        qs = [pairs(q.double()) for q in queries(layer, b, h, t)]
        c = [sum(q[f] for q in qs) / len(qs) for f in range(half)]
        mean_abs = [sum(abs(q[f]) for q in qs) / len(qs) for f in range(half)]
        weight = [mean_abs[f] - abs(c[f]) if norm_term == "dispersion" else mean_abs[f] for f in range(half)]
        out = []
        for j in range(CAP):
            p = int(layer.cache.pos[b, kv, j])
            k = pairs(rope_ref(layer.cache.k[b, kv, j].double(), -p))  # the key before RoPE
            s = 0.0
            if trig:
                at = []
                for delta in offsets:
                    dist = t + 1 + delta - p
                    phase = [cmath.phase(c[f] * k[f].conjugate()) for f in range(half)]  # angle from k_f to c_f
                    at.append(sum(abs(c[f]) * abs(k[f]) * math.cos(omega[f] * dist + phase[f]) for f in range(half)))
                s += sum(at) / len(at) if offset_reduce == "mean" else max(at)
            if norm_term != "none":
                s += sum(weight[f] * abs(k[f]) for f in range(half))
            out.append(s)
        if normalize:
            cand = [j for j in range(CAP) if int(layer.cache.pos[b, kv, j]) >= PROMPTS[b]]
            mu = sum(out[j] for j in cand) / len(cand)
            sd = max(math.sqrt(sum((out[j] - mu) ** 2 for j in cand) / len(cand)), 1e-6)
            out = [(out[j] - mu) / sd if j in cand else 0.0 for j in range(CAP)]
        return out

    def ref(layer, b, kv, t):
        per = [head_scores(layer, b, h, t) for h in range(kv * GROUP, (kv + 1) * GROUP)]
        return [max(col) if group_reduce == "max" else sum(col) / len(col) for col in zip(*per)]
    return ref


TRI_DEFAULTS = dict(window=4, centres="running", max_offset=65536, offset_reduce="mean", norm_term="dispersion",
                    trig=True, normalize=True, group_reduce="max")


@pytest.mark.parametrize("settings", [
    dict(),
    dict(max_offset=8, offset_reduce="max", norm_term="magnitude", group_reduce="mean"),
    dict(max_offset=5, normalize=False, norm_term="none"),
    dict(trig=False, normalize=False),
    dict(centres="window", max_offset=32),
], ids=["default", "max-magnitude-mean", "trig-only-raw", "norm-only-raw", "window-centres"])
def test_triattention_score_matches_the_trigonometric_series(settings):
    s = {**TRI_DEFAULTS, **settings}
    policy = TriAttention(16, n_recent=2, **s)
    layer, rows, t = hand_cache(policy)
    # the prompts' queries as a prefill hands them over (right-padded: row 1's third is padding, never counted)
    prompt_q = torch.randn(2, HEADS, 3, D, generator=torch.Generator().manual_seed(7)) * 2 + 1
    valid = torch.arange(3)[None] < torch.tensor(PROMPTS)[:, None]
    policy.observe_prefill(layer.state, layer.layer_state, prompt_q, torch.arange(3).expand(2, 3), valid,
                           torch.arange(2))
    check_rows(policy, layer, rows, t, triattention_ref(prompt_q, **s), atol=1e-5)
    # a second eviction at the same step counts no query twice
    check_rows(policy, layer, rows, t, triattention_ref(prompt_q, **s), atol=1e-5)


def test_triattention_sums_every_query_exactly_once():
    """Prompt (ragged), then decode queries through the ring: at every step the running sums hold exactly the
    queries up to ``folded``, and no query older than the ring has been left out."""
    policy = TriAttention(16, n_recent=2, window=4)
    g = torch.Generator().manual_seed(11)
    prompts, steps, H = [5, 9], 40, 4
    cache = KVCache.allocate(1, 2, 2, H, policy.capacity(prompts, steps), D)
    driver = bind(policy, cache, RotaryEmbedding(D), prompts, max_tokens=9 + steps)
    state = driver.state
    store, layer = cache[0], state.observers[0]
    seen = torch.randn(2, H, 9 + steps, D, generator=g)  # the query each row produces at each position
    L = max(prompts)
    valid = torch.arange(L)[None] < torch.tensor(prompts)[:, None]
    positions = torch.arange(L).expand(2, L)
    store.write_prefill(torch.randn(2, 2, L, D, generator=g), torch.randn(2, 2, L, D, generator=g), positions, valid)
    layer.prefill(seen[:, :, :L], positions, valid)
    driver.after_prefill([0, 1])
    centres = state.layers[0]
    for s in range(steps):
        pos = torch.tensor(prompts) + s
        store.append(torch.randn(2, 2, 1, D, generator=g), torch.randn(2, 2, 1, D, generator=g), pos)
        layer.decode(seen[torch.arange(2), :, pos][:, :, None], pos, None)
        driver.after_decode_step()
        for b in range(2):
            folded = int(centres.folded[b])
            assert state.t[b] - policy.window <= folded <= state.t[b]  # the ring still holds the rest
            assert float(centres.count[b]) == folded + 1
            torch.testing.assert_close(centres.total[b], seen[b, :, : folded + 1].sum(1))
            torch.testing.assert_close(centres.magnitude[b], (seen[b, :, : folded + 1, :2] ** 2
                                                              + seen[b, :, : folded + 1, 2:] ** 2).sqrt().sum(1))
    assert min(state.stats.evictions) >= 2
    # a new prompt in row 0 starts its sums afresh; a chunk that continues it adds to them
    layer.rows(torch.tensor([0])).prefill(seen[:1, :, :3], torch.arange(3)[None], torch.ones(1, 3, dtype=torch.bool))
    policy.observe_chunk(state, centres, seen[:1, :, 3:5], torch.arange(3, 5)[None], torch.ones(1, 2, dtype=torch.bool),
                         torch.tensor([0]))
    assert float(centres.count[0]) == 5 and int(centres.folded[0]) == 4
    torch.testing.assert_close(centres.total[0], seen[0, :, :5].sum(1))


def test_triattention_keeps_the_keys_the_query_centre_points_at():
    # every query e0 (the identity rope): the centre is e0 and no query strays from it (no norm term), so the
    # keys along -e0 score lowest
    policy = TriAttention(16, window=8, n_recent=2)
    layer = drive_hand(policy, 2, dull_keys({0: {5, 9}, 1: {3, 12}}), steps=16)
    assert layer.state.stats.evictions == [1]
    assert kept(layer, 0) == [p for p in range(18) if p not in (5, 9)]
    assert kept(layer, 1) == [p for p in range(18) if p not in (3, 12)]


def test_triattention_norm_term_keeps_large_keys_where_the_queries_scatter():
    # queries alternate +e1 / -e1 (centre 0 in the first pair: it says nothing there), so only the norm term
    # speaks: the keys largest in that pair stay
    e = torch.eye(8)

    def keys_at(p, h):
        return e[1] * (1.0 + (7 * p) % 17)  # distinct norms for positions 0..16

    policy = TriAttention(16, window=8, n_recent=2)
    cap = policy.capacity([2], 16)
    cache = KVCache.allocate(1, 1, 1, 1, cap, 8)
    driver = bind(policy, cache, IdentityRope(), [2], max_tokens=18)
    state = driver.state
    store, layer = cache[0], state.observers[0]

    def query(p):
        return (e[1] if p % 2 else -e[1]).view(1, 1, 1, 8)

    store.write_prefill(torch.stack([keys_at(p, 0) for p in range(2)])[None, None].expand(1, 1, 2, 8).contiguous(),
                        torch.zeros(1, 1, 2, 8), torch.tensor([[0, 1]]), torch.ones(1, 2, dtype=torch.bool))
    layer.prefill(torch.cat([query(0), query(1)], 2), torch.tensor([[0, 1]]), torch.ones(1, 2, dtype=torch.bool))
    driver.after_prefill([0])
    for p in range(2, 18):
        store.append(keys_at(p, 0).view(1, 1, 1, 8), torch.zeros(1, 1, 1, 8), torch.tensor([p]))
        layer.decode(query(p), torch.tensor([p]), None)
        driver.after_decode_step()
    assert state.stats.evictions == [1]
    largest = sorted(range(2, 16), key=lambda p: -float(keys_at(p, 0).norm()))[:12]
    assert kept(layer, 0) == sorted({0, 1, 16, 17, *largest})


@pytest.mark.parametrize("rope, gain", [
    (RopeConfig(theta=1e4), 1.0),
    (RopeConfig(theta=5e5, rope_type="llama3", factor=8.0,
                params={"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}), 1.0),
    (RopeConfig(theta=1e6, rope_type="yarn", factor=4.0, params={"original_max_position_embeddings": 64}),
     0.1 * math.log(4.0) + 1.0),
], ids=["default", "llama3", "yarn"])
def test_the_rotary_gain_is_the_models_cos_sin_scale(rope, gain):
    got = rotary_gain(RotaryEmbedding(16, rope), torch.tensor([0, 5, 40000]), 16)
    torch.testing.assert_close(got, torch.full((3, 8), gain), atol=1e-6, rtol=1e-6)
    assert geometric_offsets(65536, "cpu").tolist() == [2**i for i in range(17)]
    assert geometric_offsets(1, "cpu").tolist() == [1] and geometric_offsets(12, "cpu").tolist() == [1, 2, 4, 8]


# ------------------------------------------------------------------- validation
@pytest.mark.parametrize("make, match", [
    (lambda: ExpectedAttention(128, n_future_positions=0), "n_future_positions=0"),
    (lambda: ExpectedAttention(128, epsilon=-0.5), "epsilon=-0.5"),
    (lambda: ExpectedAttention(128, use_covariance="yes"), "use_covariance='yes'"),
    (lambda: ExpectedAttention(128, use_vnorm=1), "use_vnorm=1"),
    (lambda: ExpectedAttention(128, window=0), "window=0"),
    (lambda: ExpectedAttention(128, kernel=2), "kernel=2"),
    (lambda: TOVA(128, group_reduce="max"), "group_reduce='max'"),
    (lambda: LazyEviction(128, threshold=0.0), "threshold=0.0"),
    (lambda: LazyEviction(128, threshold=float("nan")), "threshold=nan"),
    (lambda: KNorm(0), "budget=0"),
    (lambda: KeyDiff(128, n_recent=-1), "n_recent=-1"),
    (lambda: make_policy("knorm", budget=128, window=4), "no parameter window"),
    (lambda: make_policy("keydiff", budget=128, threshold=0.5), "no parameter threshold"),
    (lambda: TriAttention(128, window=0), "window=0"),
    (lambda: TriAttention(128, max_offset=0), "max_offset=0"),
    (lambda: TriAttention(128, max_offset=2.5), "max_offset=2.5"),
    (lambda: TriAttention(128, centres="calibrated"), "centres='calibrated'"),
    (lambda: TriAttention(128, offset_reduce="median"), "offset_reduce='median'"),
    (lambda: TriAttention(128, norm_term="mlr"), "norm_term='mlr'"),
    (lambda: TriAttention(128, group_reduce="sum"), "group_reduce='sum'"),
    (lambda: TriAttention(128, normalize="yes"), "normalize='yes'"),
    (lambda: TriAttention(128, trig=1), "trig=1"),
    (lambda: TriAttention(128, trig=False, norm_term="none"), "nothing to score"),
])
def test_bad_settings_are_rejected_with_the_value(make, match):
    with pytest.raises(PolicyConfigError, match=match):
        make()


def test_the_rivals_are_registered_under_their_short_names():
    for name, cls in [("expected_attention", ExpectedAttention), ("tova", TOVA), ("keydiff", KeyDiff),
                      ("knorm", KNorm), ("lazy_eviction", LazyEviction), ("triattention", TriAttention)]:
        policy = make_policy(name, budget=128)
        assert type(policy) is cls and policy.name == name
