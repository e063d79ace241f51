"""Parity with transformers on tiny random-weight models (fp32, CPU): the oracle for every architecture."""

from __future__ import annotations

import pytest
import torch

import beaconkv
from beaconkv.cache import KVCache

from ..conftest import save_tiny_model

KINDS = ["llama", "qwen2", "qwen3"]


@pytest.fixture(scope="module")
def loaded(tiny_models):
    return {k: (beaconkv.load_model(d), hf) for k, (d, hf) in tiny_models.items()}


@pytest.mark.parametrize("kind", KINDS)
def test_full_sequence_logits_match_transformers(loaded, kind):
    ours, hf = loaded[kind]
    ids = torch.randint(3, 97, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    torch.testing.assert_close(ours(ids), ref, atol=1e-4, rtol=0)


def test_yarn_rope_logits_match_transformers(tmp_path):
    hf = save_tiny_model("qwen3_yarn", tmp_path)
    ours = beaconkv.load_model(tmp_path)
    assert ours.rope.attention_scaling > 1.0
    ids = torch.randint(3, 97, (1, 300), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_cached_decode_logits_match_full_forward(loaded, kind):
    model, _ = loaded[kind]
    c = model.config
    ids = torch.randint(3, 97, (2, 40), generator=torch.Generator().manual_seed(3))
    prompt = 25
    cache = KVCache.allocate(c.num_hidden_layers, 2, c.num_key_value_heads, c.num_attention_heads, 40, c.head_dim)
    with torch.no_grad():
        full = model(ids)
        valid = torch.ones(2, prompt, dtype=torch.bool)
        step_logits = [model.prefill(ids[:, :prompt], valid, cache)]
        for p in range(prompt, 39):
            step_logits.append(model.decode_step(ids[:, p], torch.full((2,), p), cache))
    torch.testing.assert_close(torch.stack(step_logits, 1), full[:, prompt - 1 : 39], atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_generation_matches_transformers_generate(loaded, kind):
    model, hf = loaded[kind]
    ids = torch.randint(3, 97, (1, 30), generator=torch.Generator().manual_seed(4))
    out = beaconkv.generate(model, None, [ids[0].tolist()], max_new_tokens=32, eos_token_ids=[])
    ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    assert out.token_ids[0] == ref[0, 30:].tolist()
    assert out.finish_reasons == ["length"]


@pytest.mark.parametrize("kind", KINDS)
def test_ragged_batch_equals_single_runs(loaded, kind):
    model, _ = loaded[kind]
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (7, 31, 18)]
    batch = beaconkv.generate(model, None, prompts, max_new_tokens=24, eos_token_ids=[])
    singles = [beaconkv.generate(model, None, [p], max_new_tokens=24, eos_token_ids=[]).token_ids[0] for p in prompts]
    assert batch.token_ids == singles
