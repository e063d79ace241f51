"""What a PolicyCache promises around the decoding itself: a switched model computes what it did with any other
cache, the store is the policy's, and what it cannot do it refuses with the fix in the message."""

from __future__ import annotations

import pytest
import torch

from beaconkv.hf import AttentionImplementationError, PolicyCache, PolicyCacheError
from beaconkv.policies import BeaconKV, FullKV

from ..conftest import tiny_hf_config
from .helpers import greedy, left_padded, random_prompts

tf = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(kind: str = "llama", impl: str = "sdpa"):
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(tiny_hf_config(kind), attn_implementation=impl).float().eval()


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_a_switched_model_computes_what_it_did(impl):
    model = tiny(impl=impl)
    ids, mask = left_padded(random_prompts((9, 17), seed=1))
    with torch.no_grad():
        before = model(ids, attention_mask=mask).logits
        PolicyCache(model, BeaconKV(64, n_recent=8))
        assert model.config._attn_implementation == f"beaconkv:{impl}"
        after = model(ids, attention_mask=mask).logits
        with_dynamic = model(ids, attention_mask=mask, cache=tf.DynamicCache(config=model.config)).logits
    assert torch.equal(before, after) and torch.equal(before, with_dynamic)


def test_the_store_is_sized_by_the_policy_and_the_logical_length_is_reported():
    model = tiny()
    prompts = random_prompts((5, 12), seed=2)
    cache = PolicyCache(model, BeaconKV(64, n_recent=8), max_new_tokens=200)
    assert cache.get_seq_length() == 0 and cache.store is None
    greedy(model, prompts, cache, 100)
    assert cache.store.capacity == BeaconKV(64, n_recent=8).capacity([5, 12], 200) == 12 + 64
    assert cache.get_seq_length() == cache.get_seq_length(1) == 12 + 99
    assert cache.get_mask_sizes(1, 0) == (12 + 100, 0)
    cache.reset()
    assert cache.state is None and cache.get_seq_length() == 0
    assert len(greedy(model, prompts, cache, 10)[0]) == 10  # reset: a new generation


def test_an_unsupported_attention_implementation_is_refused_with_the_fix():
    model = tiny()
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(AttentionImplementationError, match="attn_implementation='sdpa'"):
        PolicyCache(model, BeaconKV(64, n_recent=8))


def test_keep_everything_needs_max_new_tokens_and_stops_at_it():
    model = tiny()
    prompts = random_prompts((6,), seed=3)
    with pytest.raises(PolicyCacheError, match="max_new_tokens"):
        greedy(model, prompts, PolicyCache(model, FullKV()), 5)
    with pytest.raises(PolicyCacheError, match="max_new_tokens=4"):
        greedy(model, prompts, PolicyCache(model, FullKV(), max_new_tokens=4), 8)


def test_another_batch_size_and_beam_search_are_refused():
    # a later forward of several tokens per row continues the rows (tests/hf/test_chunked.py); one of other rows
    # than the prefill's cannot, since the policy's state follows the rows it admitted
    model = tiny()
    ids = torch.tensor(random_prompts((8,), seed=4))
    cache = PolicyCache(model, BeaconKV(64, n_recent=8))
    with torch.no_grad():
        model(ids, cache=cache)
        with pytest.raises(PolicyCacheError, match="holds 1: a cache serves the rows it was prefilled with"):
            model(ids.expand(2, -1)[:, :3], cache=cache)
    with pytest.raises(PolicyCacheError, match="beam"):
        model.generate(ids, cache=PolicyCache(model, BeaconKV(64, n_recent=8)), num_beams=2, max_new_tokens=4,
                       do_sample=False, pad_token_id=0)


def test_the_issues_three_lines_with_past_key_values():
    """transformers' older name of the cache argument works as the issue writes it."""
    model = tiny("qwen2")
    ids = torch.tensor(random_prompts((11,), seed=5))
    policy = BeaconKV(32, n_recent=4, n_beacon=4)
    with pytest.warns(FutureWarning):
        old = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=PolicyCache(model, policy),
                             max_new_tokens=60, do_sample=False, pad_token_id=0, eos_token_id=None)
    new = model.generate(ids, attention_mask=torch.ones_like(ids), cache=PolicyCache(model, policy),
                         max_new_tokens=60, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert torch.equal(old, new)
