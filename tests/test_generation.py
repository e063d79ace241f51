"""Generation behaviour: stopping, sampling, streaming, stats, policies by name, cache dtypes and bad input."""

from __future__ import annotations

import pytest
import torch

import beaconkv
from beaconkv.generation import PromptError
from beaconkv.policies import BeaconKV


@pytest.fixture(scope="module")
def llama(tiny_models):
    return beaconkv.load_model(tiny_models["llama"][0])


def _prompts(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 97, (L,), generator=g).tolist() for L in (5, 12, 9)[:n]]


def test_sampling_with_seed_is_reproducible_and_seed_matters(llama):
    kw = dict(max_new_tokens=20, temperature=0.9, top_p=0.95, top_k=50, eos_token_ids=[])
    a = beaconkv.generate(llama, None, _prompts(), seed=7, **kw)
    b = beaconkv.generate(llama, None, _prompts(), seed=7, **kw)
    c = beaconkv.generate(llama, None, _prompts(), seed=8, **kw)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_top_k_one_is_greedy(llama):
    greedy = beaconkv.generate(llama, None, _prompts(), max_new_tokens=10, eos_token_ids=[])
    k1 = beaconkv.generate(llama, None, _prompts(), max_new_tokens=10, temperature=1.0, top_k=1, seed=0,
                           eos_token_ids=[])
    assert greedy.token_ids == k1.token_ids


def test_per_sequence_stop_on_eos(llama):
    free = beaconkv.generate(llama, None, _prompts(), max_new_tokens=16, eos_token_ids=[])
    # stop sequence 1 at its 4th token: use that token as the end-of-sequence id
    stop_id = free.token_ids[1][3]
    out = beaconkv.generate(llama, None, _prompts(), max_new_tokens=16, eos_token_ids=[stop_id])
    for full, got, reason in zip(free.token_ids, out.token_ids, out.finish_reasons):
        if stop_id in full:
            cut = full.index(stop_id) + 1
            assert got == full[:cut] and reason == "stop"
        else:
            assert got == full and reason == "length"
    assert out.stats.new_tokens == [len(t) for t in out.token_ids]


def test_streaming_callback_sees_every_token(llama):
    seen: dict[int, list[int]] = {}
    out = beaconkv.generate(llama, None, _prompts(), max_new_tokens=8, eos_token_ids=[],
                            stream=lambda i, tok, text: seen.setdefault(i, []).append(tok))
    assert [seen[i] for i in range(3)] == out.token_ids


def test_stats_are_filled(llama):
    out = beaconkv.generate(llama, None, _prompts(), max_new_tokens=8, eos_token_ids=[])
    s = out.stats
    assert s.prompt_tokens == [5, 12, 9] and s.new_tokens == [8, 8, 8]
    assert s.cache_capacity == 12 + 8 and s.evictions == [0, 0, 0]
    assert s.wall_time_s > 0 and s.tokens_per_s > 0 and s.decode_steps == 7
    assert s.peak_cache_tokens == 12 + 7


def test_empty_prompt_is_rejected(llama):
    with pytest.raises(PromptError, match="prompt 1"):
        beaconkv.generate(llama, None, [[5, 6], []])
    with pytest.raises(PromptError, match="empty"):
        beaconkv.generate(llama, None, [])


def test_prompt_longer_than_max_positions_is_rejected(llama):
    n = llama.config.max_position_embeddings + 1
    with pytest.raises(PromptError, match=f"{n} tokens.*max_position_embeddings=512"):
        beaconkv.generate(llama, None, [[5] * n])


def test_bad_sampling_parameters(llama):
    with pytest.raises(ValueError, match="top_p=1.5"):
        beaconkv.generate(llama, None, [[5, 6]], top_p=1.5)
    with pytest.raises(ValueError, match="temperature=-1"):
        beaconkv.generate(llama, None, [[5, 6]], temperature=-1)
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        beaconkv.generate(llama, None, [[5, 6]], max_new_tokens=0)


def test_token_ids_outside_the_vocabulary_name_the_id_and_the_range(llama):
    vocab = llama.config.vocab_size
    with pytest.raises(PromptError, match=rf"token id {vocab + 3} is outside the vocabulary 0 \.\. {vocab - 1}.*"
                                          r"prompt position 1.*tokenizer"):
        beaconkv.generate(llama, None, [[5, vocab + 3, 7]], max_new_tokens=2)
    with pytest.raises(PromptError, match=r"token id -1 is outside"):
        beaconkv.generate(llama, None, [[-1]], max_new_tokens=2)


def test_fractional_max_new_tokens_is_a_clear_error(llama):
    with pytest.raises(ValueError, match=r"max_new_tokens=2\.5 must be an int >= 1, not float.*max_new_tokens=2\b"):
        beaconkv.generate(llama, None, [[5, 6]], max_new_tokens=2.5)


@pytest.mark.parametrize("name,value", [("temperature", float("nan")), ("temperature", float("inf")),
                                        ("top_p", float("nan"))])
def test_non_finite_sampling_parameters_are_rejected(llama, name, value):
    with pytest.raises(ValueError, match=rf"{name}={value!r} must be a finite number"):
        beaconkv.generate(llama, None, [[5, 6]], max_new_tokens=2, **{name: value})


def test_a_policy_by_name_comes_from_the_registry(llama):
    out = beaconkv.generate(llama, None, _prompts(2), max_new_tokens=150, eos_token_ids=[],
                            policy=beaconkv.make_policy("beacon", budget=128))
    assert isinstance(out.policy, BeaconKV) and out.policy.budget == 128 and out.policy.n_recent == 16
    assert out.stats.cache_capacity == 12 + 128 and all(n > 0 for n in out.stats.evictions)


@pytest.mark.parametrize("policy", ["beacon", 128, BeaconKV])
def test_generate_refuses_anything_but_a_policy_object_and_names_the_call(llama, policy):
    with pytest.raises(beaconkv.PolicyConfigError, match="must be an EvictionPolicy|build the policy first") as info:
        beaconkv.generate(llama, None, [[5, 6]], max_new_tokens=2, policy=policy)
    assert "beaconkv." in str(info.value)


def test_generate_takes_its_options_by_keyword_only(llama):
    with pytest.raises(TypeError, match="positional"):
        beaconkv.generate(llama, None, [[5, 6]], 2)


def test_bfloat16_cache_under_a_float32_model(llama):
    kw = dict(max_new_tokens=24, eos_token_ids=[], policy=BeaconKV(budget=16, n_recent=2))
    full = beaconkv.generate(llama, None, _prompts(), **kw)
    half = beaconkv.generate(llama, None, _prompts(), cache_dtype=torch.bfloat16, **kw)
    layer = half.policy_state.cache[0]
    assert llama.lm_head.weight.dtype == torch.float32
    assert layer.storage.k.dtype == torch.bfloat16 and layer.dtype == torch.float32  # stored bf16, attended fp32
    assert half.stats.cache_bytes * 2 == full.stats.cache_bytes
    assert all(n > 0 for n in half.stats.evictions) and half.stats.new_tokens == [24, 24, 24]
    assert [t[0] for t in half.token_ids] == [t[0] for t in full.token_ids]  # the prefill's token does not read it
