"""oneDNN-prepacked linears and the automatic choice of decode kernels."""

from __future__ import annotations

import pytest
import torch

import beaconkv
from beaconkv.kernels import choice as kernel_choice
from beaconkv.kernels.bf16w import bf16w_available
from beaconkv.kernels.choice import PACK_MIN_ROWS, choose_kernels, packed_copy
from beaconkv.kernels.packed import PackedLinear, packing_available, prepack

needs_packing = pytest.mark.skipif(not packing_available(), reason="this PyTorch has no oneDNN packing")
auto_packs = pytest.mark.usefixtures("emulated_bf16")  # the AVX2 branch of 'auto', on any CPU


@pytest.fixture
def emulated_bf16(monkeypatch):
    """'auto' as on a CPU without native bfloat16 (AVX2): the branch that packs, whatever this CPU has."""
    if not packing_available():
        pytest.skip("this PyTorch has no oneDNN packing")
    monkeypatch.setattr(kernel_choice, "native_bf16_matmuls", lambda: False)


def test_auto_keeps_the_models_kernels_on_a_cpu_with_native_bf16(llama, monkeypatch):
    monkeypatch.setattr(kernel_choice, "native_bf16_matmuls", lambda: True)
    choice = choose_kernels(llama, 64)
    assert (choice.kernels, choice.model) == ("model", llama) and "native bfloat16" in choice.reason


@pytest.fixture(scope="module")
def llama(tiny_models):
    return beaconkv.load_model(tiny_models["llama"][0], dtype=torch.float32)


def _prompts(n: int, length: int = 6) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return torch.randint(3, 97, (n, length), generator=g).tolist()


@needs_packing
def test_a_packed_copy_computes_the_same_logits(llama):
    packed = prepack(llama)
    assert isinstance(packed.lm_head, PackedLinear) and not isinstance(llama.lm_head, PackedLinear)
    ids = torch.tensor(_prompts(3))
    torch.testing.assert_close(packed(ids), llama(ids), rtol=1e-4, atol=1e-4)


def test_kernel_choice_follows_the_rows_and_the_request(llama):
    assert choose_kernels(llama, 1).model is llama  # one row: the model's own kernels, whatever the CPU
    assert choose_kernels(llama, 64, "model").model is llama
    with pytest.raises(ValueError, match="kernels='fast' is unknown; choose one of auto, model, packed, bf16w"):
        choose_kernels(llama, 8, "fast")


@auto_packs
def test_auto_packs_a_wide_batch_once_and_repacks_after_a_weight_changes(tiny_models):
    model = beaconkv.load_model(tiny_models["llama"][0], dtype=torch.float32)
    first = choose_kernels(model, PACK_MIN_ROWS)
    assert first.kernels == "packed" and f"{PACK_MIN_ROWS} rows" in first.reason
    assert choose_kernels(model, PACK_MIN_ROWS - 1).kernels == "model"
    assert packed_copy(model) is first.model  # reused: the compiled step is reused with it
    assert choose_kernels(first.model, 8).model is first.model  # a packed model is not packed again
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)
    again = packed_copy(model)
    assert again is not first.model
    ids = torch.tensor(_prompts(2))
    torch.testing.assert_close(again(ids), model(ids), rtol=1e-4, atol=1e-4)


@auto_packs
def test_generate_packs_a_wide_batch_with_the_same_greedy_tokens_and_cache(llama):
    prompts = _prompts(PACK_MIN_ROWS)
    kw = dict(max_new_tokens=12, eos_token_ids=[], policy=beaconkv.BeaconKV(budget=8, n_recent=1, n_beacon=2))
    auto = beaconkv.generate(llama, None, prompts, **kw)
    plain = beaconkv.generate(llama, None, prompts, kernels="model", **kw)
    assert (auto.stats.kernels, plain.stats.kernels) == ("packed", "model")
    assert auto.token_ids == plain.token_ids
    assert auto.stats.evictions == plain.stats.evictions and min(auto.stats.evictions) > 0


@auto_packs
def test_a_packed_session_keeps_the_cache_in_the_callers_dtype(tiny_models):
    bf16 = beaconkv.load_model(tiny_models["llama"][0], dtype=torch.bfloat16)
    prompts = _prompts(PACK_MIN_ROWS)
    auto = beaconkv.generate(bf16, None, prompts, max_new_tokens=4, eos_token_ids=[])
    plain = beaconkv.generate(bf16, None, prompts, max_new_tokens=4, eos_token_ids=[], kernels="model")
    assert auto.stats.kernels == ("bf16w" if bf16w_available() else "packed")  # bf16 weights: bf16w where it builds
    assert auto.stats.cache_bytes == plain.stats.cache_bytes


@auto_packs
def test_the_engine_and_its_session_run_the_one_prepared_model(llama):
    engine = beaconkv.Engine(llama, max_batch=PACK_MIN_ROWS, prompt_capacity=8, max_new_tokens=4)
    assert engine.prepared.kernels == "packed" and engine.prepared.source is llama
    assert engine.model is engine.session.model is engine.prepared.model is not llama
    plain = beaconkv.Engine(llama, max_batch=PACK_MIN_ROWS, prompt_capacity=8, max_new_tokens=4, kernels="model")
    assert plain.model is plain.session.model is llama and plain.prepared.kernels == "model"


@pytest.mark.parametrize("old, new, name", [("beaconkv.models.cpu_linear", "beaconkv.kernels.choice", "choose_kernels"),
                                            ("beaconkv.models.cpu_linear", "beaconkv.kernels.packed", "prepack"),
                                            ("beaconkv.models.bf16w", "beaconkv.kernels.bf16w", "BF16WLinear")])
def test_the_former_module_paths_warn_and_give_the_same_objects(old, new, name):
    import importlib
    import sys

    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=new.replace(".", r"\.")):
        module = importlib.import_module(old)
    assert getattr(module, name) is getattr(importlib.import_module(new), name)
