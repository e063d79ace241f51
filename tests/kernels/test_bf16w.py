"""The bf16-weight fp32-arithmetic CPU kernel, its module and its place in the kernel choice."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import beaconkv
from beaconkv.kernels import choice as kernel_choice
from beaconkv.kernels.bf16w import (
    BF16WLinear,
    bf16w_available,
    bf16w_linear,
    bf16w_status,
    with_bf16w_linears,
)
from beaconkv.kernels.choice import PACK_MIN_ROWS, bf16w_copy, choose_kernels

needs_kernel = pytest.mark.skipif(not bf16w_available(), reason=f"no bf16-weight kernel here: {bf16w_status(False)}")


def _prompts(n: int, length: int = 6) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return torch.randint(3, 97, (n, length), generator=g).tolist()


@pytest.fixture(scope="module")
def bf16_llama(tiny_models):
    return beaconkv.load_model(tiny_models["llama"][0], dtype=torch.bfloat16)


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(rows=st.integers(0, 20), out_features=st.integers(1, 70), in_features=st.integers(1, 100),
       with_bias=st.booleans(), seed=st.integers(0, 2**16))
def test_the_kernel_is_an_fp32_matmul_on_the_bf16_weights(rows, out_features, in_features, with_bias, seed):
    # every row count around the 8-row blocks, widths that are and are not multiples of 8 (the tail loop)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=g)
    w = torch.randn(out_features, in_features, generator=g).to(torch.bfloat16)
    b = torch.randn(out_features, generator=g) if with_bias else None
    y = bf16w_linear(x, w, b)
    ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    assert y.dtype == torch.float32 and y.shape == (rows, out_features)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * in_features ** 0.5)


@needs_kernel
def test_the_kernel_names_bad_inputs():
    w = torch.randn(4, 8).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="x must be float32 and weight bfloat16"):
        bf16w_linear(torch.randn(2, 8, dtype=torch.float64), w)
    with pytest.raises(RuntimeError, match=r"weight \(out_features, in_features\)"):
        bf16w_linear(torch.randn(2, 7), w)
    with pytest.raises(RuntimeError, match="bias must have 4 entries, got 3"):
        bf16w_linear(torch.randn(2, 8), w, torch.randn(3))


@needs_kernel
def test_a_bf16w_layer_reads_the_models_weight_in_place_and_refuses_other_dtypes():
    linear = torch.nn.Linear(16, 8).to(torch.bfloat16)
    layer = BF16WLinear(linear)
    assert layer.weight.data_ptr() == linear.weight.data_ptr()  # no copy
    x = torch.randn(2, 3, 16)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, linear.weight.float(), linear.bias.float()))
    with pytest.raises(ValueError, match="needs a bfloat16 CPU weight, not torch.float32.*dtype=torch.bfloat16"):
        BF16WLinear(torch.nn.Linear(16, 8))


@needs_kernel
def test_the_bf16w_copy_computes_the_fp32_logits_of_the_bf16_weights(bf16_llama, tiny_models):
    copy = with_bf16w_linears(bf16_llama)
    assert all(not isinstance(m, torch.nn.Linear) for m in copy.modules())
    # the reference: the same bf16 weights, every activation in fp32
    ref = beaconkv.load_model(tiny_models["llama"][0], dtype=torch.bfloat16).float()
    ids = torch.tensor(_prompts(3))
    torch.testing.assert_close(copy(ids), ref(ids), rtol=1e-4, atol=1e-4)
    assert bf16w_copy(bf16_llama) is bf16w_copy(bf16_llama)  # made once, reused with its compiled step


@needs_kernel
@pytest.mark.slow
@pytest.mark.long
def test_compiled_bf16w_decoding_matches_eager(bf16_llama):
    prompts = _prompts(PACK_MIN_ROWS)
    kw = dict(max_new_tokens=10, eos_token_ids=[], kernels="bf16w",
              policy=beaconkv.BeaconKV(budget=8, n_recent=1, n_beacon=2))
    eager = beaconkv.generate(bf16_llama, None, prompts, **kw)
    compiled = beaconkv.generate(bf16_llama, None, prompts, compile=True, **kw)
    assert (eager.stats.kernels, compiled.stats.kernels) == ("bf16w", "bf16w")
    assert compiled.token_ids == eager.token_ids and min(eager.stats.evictions) > 0


@needs_kernel
def test_auto_runs_bf16w_for_a_wide_bf16_batch_and_packs_fp32(bf16_llama, tiny_models, monkeypatch):
    monkeypatch.setattr(kernel_choice, "native_bf16_matmuls", lambda: False)  # the AVX2 branch, on any CPU
    wide = choose_kernels(bf16_llama, PACK_MIN_ROWS)
    assert wide.kernels == "bf16w" and "widened to fp32" in wide.reason
    assert choose_kernels(bf16_llama, PACK_MIN_ROWS - 1).kernels == "model"
    fp32 = beaconkv.load_model(tiny_models["llama"][0], dtype=torch.float32)
    assert choose_kernels(fp32, PACK_MIN_ROWS).kernels in ("packed", "model")  # never bf16w for fp32 weights
    with pytest.raises(ValueError, match="needs a bfloat16 CPU weight"):
        choose_kernels(fp32, 8, "bf16w")


@needs_kernel
def test_a_compiled_session_on_the_projects_kernels_leaves_inductors_gemv_pass_off(bf16_llama):
    # its linears are extern kernels (nothing for the pass), and the pass corrupted the heap of a
    # compiled bf16w step on an AVX-512 CPU; a session on the model's own kernels keeps it
    from beaconkv.preparation import prepare_model
    from beaconkv.session import Session

    ours = prepare_model(bf16_llama, PACK_MIN_ROWS, kernels="bf16w", compile=True)
    own = prepare_model(bf16_llama, PACK_MIN_ROWS, kernels="model", compile=True)
    assert ours.kernels == "bf16w" and ours.model is not bf16_llama and ours.source is bf16_llama
    assert not ours.compile.cpu_gemv and own.compile.cpu_gemv and own.model is bf16_llama
    assert ours.cache_dtype == torch.bfloat16  # the caller's cache size, though the copy computes in fp32
    session = Session.prepared(ours, None, batch=PACK_MIN_ROWS, capacity=16)
    assert session.model is ours.model and not session.decoder.config.cpu_gemv
