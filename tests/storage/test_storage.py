"""KV storages: the dense and int8 implementations of one contract, checked against each other and by hand."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import beaconkv
from beaconkv.cache import KVCache
from beaconkv.policies import make_policy
from beaconkv.storage import DenseKV, Int8KV, StorageError, make_storage
from beaconkv.storage.int8 import QMAX, dequantize, quantize

from ..policies.driver import drive

POLICIES = ["beacon", "initial_recent", "snapkv", "rpc", "rkv", "h2o", "streaming", "expected_attention", "tova",
            "keydiff", "knorm", "lazy_eviction", "triattention"]


def _filled(cls, B=2, H=2, C=12, D=8, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    s = cls(B, H, C, D, torch.float32, "cpu", **kw)
    k, v = torch.randn(B, H, C, D, generator=g), torch.randn(B, H, C, D, generator=g)
    s.write(torch.arange(B), torch.arange(C).expand(B, C), k, v)
    return s, k, v


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), scale=st.sampled_from([1e-3, 1.0, 30.0]))
def test_int8_reconstruction_error_is_at_most_half_a_step(seed, scale):
    x = torch.randn(3, 4, 5, 16, generator=torch.Generator().manual_seed(seed)) * scale
    q, s = quantize(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float16 and int(q.abs().max()) <= QMAX
    err = (dequantize(q, s, torch.float32) - x).abs()
    step = s.float()[..., None]  # one quantisation step per (token, head)
    assert bool((err <= step / 2 * (1 + 1e-3) + 1e-12).all())


def test_int8_zero_vectors_stay_zero():
    q, s = quantize(torch.zeros(2, 3, 8))
    assert not q.any() and not s.any() and not dequantize(q, s, torch.float32).any()


@pytest.mark.parametrize("cls", [DenseKV, Int8KV])
def test_append_writes_the_slot_and_compact_moves_kept_slots_bit_for_bit(cls):
    s, k, v = _filled(cls)
    before_k, before_v = s.keys().clone(), s.values().clone()
    new_k, new_v = torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8)
    s.append(torch.tensor([3, 7]), new_k, new_v)
    want = before_k.clone()
    want[0, :, 3], want[1, :, 7] = s.keys()[0, :, 3], s.keys()[1, :, 7]
    assert torch.equal(s.keys(), want)  # only the two slots changed
    if cls is DenseKV:
        assert torch.equal(s.keys()[0, :, 3], new_k[0, :, 0])
    keep = torch.tensor([[[1, 4, 9], [0, 2, 11]]])  # row 1, per head
    kept_k, kept_v = s.keys()[1].clone(), s.values()[1].clone()
    s.compact(torch.tensor([1]), keep)
    for h in range(2):
        assert torch.equal(s.keys()[1, h, :3], kept_k[h, keep[0, h]])
        assert torch.equal(s.values()[1, h, :3], kept_v[h, keep[0, h]])
    assert torch.equal(s.keys()[0], before_k[0].index_copy(1, torch.tensor([3]), s.keys()[0, :, 3:4]))
    assert before_v.shape == s.values().shape


@pytest.mark.parametrize("need_weights", [False, True])
def test_int8_attention_equals_attention_over_its_dequantised_cache(need_weights):
    s, _, _ = _filled(Int8KV, C=20)
    ref = DenseKV(2, 2, 20, 8, torch.float32, "cpu")
    ref.write(torch.arange(2), torch.arange(20).expand(2, 20), s.keys(), s.values())
    q = torch.randn(2, 2, 3, 8)
    mask = torch.rand(2, 2, 1, 20) > 0.3
    out, w = s.attend(q, mask, 8**-0.5, need_weights)
    want, want_w = ref.attend(q, mask, 8**-0.5, True)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    if need_weights:
        torch.testing.assert_close(w, want_w, atol=1e-6, rtol=1e-5)


def test_bytes_per_token_int8_vs_bf16_vs_fp32():
    C, D = 100, 64
    dense32 = DenseKV(1, 1, C, D, torch.float32, "cpu")
    dense16 = DenseKV(1, 1, C, D, torch.float32, "cpu", storage_dtype=torch.bfloat16)
    int8 = Int8KV(1, 1, C, D, torch.float32, "cpu")
    assert dense32.nbytes() == 2 * C * D * 4 and dense16.nbytes() == 2 * C * D * 2
    assert int8.nbytes() == 2 * C * (D + 2)  # int8 elements + one float16 scale per token, keys and values
    assert dense16.nbytes() / int8.nbytes() == pytest.approx(128 / 66)


def test_a_dense_storage_in_another_dtype_casts_at_the_read():
    s, k, _ = _filled(DenseKV, storage_dtype=torch.bfloat16)
    assert s.k.dtype == torch.bfloat16 and s.keys().dtype == torch.float32
    assert torch.equal(s.keys(), k.to(torch.bfloat16).float())


def test_storage_errors_name_the_value():
    with pytest.raises(StorageError, match="kv_storage='fp4' is unknown.*dense, int8"):
        make_storage("fp4", 1, 1, 4, 8, torch.float32, "cpu")
    with pytest.raises(StorageError, match="capacity=0"):
        DenseKV(1, 1, 0, 8)
    with pytest.raises(StorageError, match="int8.*cache_dtype=torch.bfloat16"):
        make_storage("int8", 1, 1, 4, 8, torch.float32, "cpu", storage_dtype=torch.bfloat16)
    with pytest.raises(StorageError, match="not a floating dtype"):
        DenseKV(1, 1, 4, 8, storage_dtype=torch.int32)


@pytest.mark.parametrize("name", POLICIES)
def test_every_policy_keeps_the_budget_invariants_on_int8_storage(name):
    kw = {"n_recent": 2, "n_prefix": None}
    if name in ("beacon", "initial_recent"):
        kw["n_beacon"] = 3
    policy = make_policy(name, budget=16, **kw)
    _, state = drive(policy, [5, 9], steps=60, storage="int8")
    assert min(state.stats.evictions) > 0


@pytest.fixture(scope="module")
def llama(tiny_models):
    return beaconkv.load_model(tiny_models["llama"][0])


@pytest.mark.parametrize("name", ["full", *POLICIES])
def test_every_policy_generates_on_int8_storage(llama, name):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (11, 6)]
    policy = make_policy(name, budget=None if name == "full" else 128)
    dense = beaconkv.generate(llama, None, prompts, max_new_tokens=160, eos_token_ids=[], policy=policy)
    int8 = beaconkv.generate(llama, None, prompts, max_new_tokens=160, eos_token_ids=[], policy=policy,
                             kv_storage="int8")
    assert int8.stats.evictions == dense.stats.evictions  # the schedule does not depend on the storage
    assert int8.stats.cache_bytes < dense.stats.cache_bytes / 3  # float32 model: 4 bytes -> 1 + scales
    assert int8.token_ids[0][0] == dense.token_ids[0][0]  # the prefill attends the fresh keys: same first token
    assert all(len(t) == 160 for t in int8.token_ids)


def test_int8_storage_is_close_to_dense_teacher_forced(llama):
    """The same forced tokens through FullKV on int8 and on dense storage: the logits barely move."""
    from beaconkv.measure.fidelity import LockStep, kl_divergence
    from beaconkv.policies import FullKV

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (12, 20)]
    tokens = torch.randint(3, 97, (2, 48), generator=g)
    run = LockStep(llama, [FullKV()], prompts, 48, kv_storage="int8")
    assert run.sessions[1].cache[0].storage.kind == "int8" and run.sessions[0].cache[0].storage.kind == "dense"
    run.prefill()
    kls, agree = [], []
    for s in range(48):
        out = run.step(tokens[:, s])
        kls.append(kl_divergence(out.logits[0], out.logits[1]))
        agree.append(out.logits[0].argmax(-1) == out.logits[1].argmax(-1))
    kl, top1 = torch.stack(kls), torch.stack(agree).float().mean()
    assert float(kl.max()) < 1e-2 and float(kl.mean()) < 1e-3 and float(top1) > 0.9
    assert float(kl.mean()) > 0  # it is not the dense cache in disguise


@pytest.mark.long
def test_int8_storage_compiles_with_the_same_tokens(llama):
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
    policy = make_policy("beacon", budget=128, telemetry=True)
    kw = dict(max_new_tokens=150, eos_token_ids=[], policy=policy, kv_storage="int8")
    eager = beaconkv.generate(llama, None, prompts, **kw)
    compiled = beaconkv.generate(llama, None, prompts, compile=beaconkv.CompileConfig(backend="aot_eager"), **kw)
    assert compiled.token_ids == eager.token_ids and compiled.stats.compiled_evictions == 2
    assert [r.kept_positions.tolist() for r in compiled.telemetry] == [r.kept_positions.tolist() for r in eager.telemetry]


def test_cache_dtype_other_than_the_model_stores_in_it_and_attends_in_the_model_dtype(llama):
    prompts = [[5, 6, 7, 8, 9]]
    full = beaconkv.generate(llama, None, prompts, max_new_tokens=12, eos_token_ids=[])
    half = beaconkv.generate(llama, None, prompts, max_new_tokens=12, eos_token_ids=[], cache_dtype=torch.bfloat16)
    assert half.stats.cache_bytes * 2 == full.stats.cache_bytes
    assert half.policy_state.cache[0].storage.k.dtype == torch.bfloat16
    assert len(half.token_ids[0]) == 12
    cache = KVCache.allocate(1, 1, 2, 4, 8, 16, dtype=torch.float32, storage_dtype=torch.float16)
    assert cache[0].keys().dtype == torch.float32 and math.isclose(cache.nbytes(), 2 * 2 * 8 * 16 * 2)
