"""PolicyCache takes chunks (issue #43 item 1, the transformers half): a prompt prefilled ``N`` tokens at a time
with evictions between (``PolicyCache(..., prefill_chunk=N)``), and a forward of several tokens after the prefill
(a question asked on a compressed context). Tiny random llama / qwen2 / qwen3 in fp32 on CPU, against two
references:

* keeping everything, a chunked prefill attends over what a whole prefill attends over: the same logits, the same
  greedy tokens; a question after a context continues it as one prefill of context + question would;
* with eviction, the native session with the same policy and chunk (``beaconkv.generate(..., prefill_chunk=N)``,
  ``Session.prefill(chunk=N)`` then ``Session.extend``) gives the same greedy tokens and keeps the same positions
  at every eviction, row by row, in a ragged left-padded batch too;
* the store is sized ``policy.capacity(..., prefill_chunk=N)``, at most ``n_prefix + budget + N``, below the
  prompt, and never holds more.
"""

from __future__ import annotations

import pytest
import torch

import beaconkv
from beaconkv.hf import PolicyCache, PolicyCacheError
from beaconkv.hf.hooks import decoder_layers
from beaconkv.policies import H2O, BeaconKV, FullKV, SnapKV, StreamingLLM
from beaconkv.session import Session

from ..conftest import save_tiny_model
from .helpers import greedy, left_padded, random_prompts, same_evictions

tf = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

KINDS = ["llama", "qwen2", "qwen3"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """kind -> (transformers model, beaconkv's load of the same weights); built here since a PolicyCache switches
    a model's attention function."""
    out = {}
    for kind in KINDS:
        d = tmp_path_factory.mktemp(f"chunked_{kind}")
        out[kind] = (save_tiny_model(kind, d), beaconkv.load_model(d))
    return out


def last_logits(model, prompts: list[list[int]], cache) -> torch.Tensor:
    """One forward of left-padded ``prompts`` into ``cache`` (generate's positions); each row's last logits."""
    ids, mask = left_padded(prompts)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        return model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache).logits[:, -1]


def per_row(records, rows: int) -> list[list[tuple[int, list[list[int]]]]]:
    """Each row's evictions in order: (layer, kept positions per KV head), whatever rows evicted with it."""
    out: list[list[tuple[int, list[list[int]]]]] = [[] for _ in range(rows)]
    for record in records:
        for i, b in enumerate(record.rows):
            out[b].append((record.layer, [[p for p in head.tolist() if p >= 0] for head in record.kept_positions[i]]))
    return out


# ------------------------------------------------------------------------------------------- keeping everything
@pytest.mark.parametrize("chunk", [1, 7, 32])
@pytest.mark.parametrize("kind", KINDS)
def test_without_evictions_a_chunked_prefill_is_the_whole_prefill(models, kind, chunk):
    hf, _ = models[kind]
    prompts = random_prompts((61, 40, 9), seed=1)
    whole = PolicyCache(hf, FullKV(), max_new_tokens=12)
    parts = PolicyCache(hf, FullKV(), max_new_tokens=12, prefill_chunk=chunk)
    torch.testing.assert_close(last_logits(hf, prompts, parts), last_logits(hf, prompts, whole), atol=1e-4, rtol=0)
    for a, b in zip(whole.store.layers, parts.store.layers):  # the same slots hold the same positions and keys
        assert torch.equal(a.pos, b.pos) and torch.equal(a.length, b.length)
        filled = a.pos >= 0
        torch.testing.assert_close(b.keys()[filled], a.keys()[filled], atol=1e-5, rtol=0)
    assert whole.get_seq_length() == parts.get_seq_length() == 61
    want = greedy(hf, prompts, PolicyCache(hf, FullKV(), max_new_tokens=12), 12)
    assert greedy(hf, prompts, PolicyCache(hf, FullKV(), max_new_tokens=12, prefill_chunk=chunk), 12) == want


@pytest.mark.parametrize("chunk", [None, 16])
def test_a_question_after_a_context_is_one_prefill_of_both(models, chunk):
    hf, _ = models["qwen3"]
    context, question = random_prompts((70, 9), seed=2)
    one = PolicyCache(hf, FullKV(), max_new_tokens=20)
    want = last_logits(hf, [context + question], one)
    two = PolicyCache(hf, FullKV(), max_new_tokens=20, prefill_chunk=chunk)
    last_logits(hf, [context], two)
    with torch.inference_mode():  # a forward of 9 tokens after the prefill: the question
        got = hf(input_ids=torch.tensor([question]), cache=two).logits[:, -1]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert two.seen == 79 and two.state.t == [78] and two.store[0].length.tolist() == [79]
    assert torch.equal(two.store[0].pos[..., :79], one.store[0].pos[..., :79])
    # generate continues a cache that holds the context: it runs only the question, then decodes
    full = torch.tensor([context + question])
    ask = dict(attention_mask=torch.ones_like(full), max_new_tokens=10, do_sample=False, pad_token_id=0,
               eos_token_id=None)
    ref = hf.generate(full, cache=PolicyCache(hf, FullKV(), max_new_tokens=20), **ask)
    three = PolicyCache(hf, FullKV(), max_new_tokens=20, prefill_chunk=chunk)
    last_logits(hf, [context], three)
    assert torch.equal(hf.generate(full, cache=three, **ask), ref)


def test_a_ragged_batch_of_questions_continues_each_row(models):
    """Left-padded contexts, then left-padded questions of other lengths (holes between the two): each row's
    question continues its own context, as one prefill of both."""
    hf, _ = models["llama"]
    contexts, questions = random_prompts((30, 12), seed=3), random_prompts((4, 9), seed=4)
    cache = PolicyCache(hf, FullKV(), max_new_tokens=20, prefill_chunk=8)
    ids, mask = left_padded(contexts)
    q_ids, q_mask = left_padded(questions)
    mask2 = torch.cat([mask, q_mask], 1)
    positions = (mask2.cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        hf(input_ids=ids, attention_mask=mask, position_ids=positions[:, :30], cache=cache)
        got = hf(input_ids=q_ids, attention_mask=mask2, position_ids=positions[:, 30:], cache=cache).logits[:, -1]
    for b, (c, q) in enumerate(zip(contexts, questions)):
        want = last_logits(hf, [c + q], PolicyCache(hf, FullKV(), max_new_tokens=20))
        torch.testing.assert_close(got[b:b + 1], want, atol=1e-4, rtol=0)
        assert cache.state.t[b] == len(c) + len(q) - 1 and int(cache.store[0].length[b]) == len(c) + len(q)


# ------------------------------------------------------------------------------------------- against the native session
POLICIES = {
    "snapkv": lambda: SnapKV(32, window=8, n_recent=4, n_prefix=4, telemetry=True),
    "beacon": lambda: BeaconKV(32, n_recent=4, n_beacon=4, n_prefix=4, telemetry=True),
    "h2o": lambda: H2O(32, n_recent=4, n_prefix=4, telemetry=True),
    "streaming": lambda: StreamingLLM(32, n_recent=4, n_prefix=4, telemetry=True),
}


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("kind", KINDS)
def test_a_chunked_prefill_matches_the_native_sessions(models, kind, name):
    hf, ours = models[kind]
    prompts, steps, chunk = random_prompts((150,), seed=5), 40, 16
    native = beaconkv.generate(ours, None, prompts, max_new_tokens=steps, eos_token_ids=[], policy=POLICIES[name](),
                               prefill_chunk=chunk)
    cache = PolicyCache(hf, POLICIES[name](), max_new_tokens=steps, prefill_chunk=chunk)
    assert greedy(hf, prompts, cache, steps) == native.token_ids
    assert cache.store.capacity == native.stats.cache_capacity
    prefill = [r for r in native.telemetry if r.step == 0]
    assert len(prefill) >= 2 * len(cache.store.layers)  # evictions between the prompt's chunks, then decoding
    assert same_evictions(native.telemetry, cache.state.stats.telemetry) is None


@pytest.mark.parametrize("name", ["snapkv", "beacon"])
def test_a_ragged_batch_keeps_each_rows_native_chunks(models, name):
    """Left padding shifts a row's columns, not its chunks: each row evicts after its own N tokens, keeps the
    native's positions and gives the tokens it gets alone."""
    hf, ours = models["qwen2"]
    prompts, steps, chunk = random_prompts((130, 57, 90), seed=6), 30, 16
    native = beaconkv.generate(ours, None, prompts, max_new_tokens=steps, eos_token_ids=[], policy=POLICIES[name](),
                               prefill_chunk=chunk)
    cache = PolicyCache(hf, POLICIES[name](), max_new_tokens=steps, prefill_chunk=chunk)
    tokens = greedy(hf, prompts, cache, steps)
    assert tokens == native.token_ids
    assert cache.state.stats.evictions == native.stats.evictions and min(native.stats.evictions) >= 3
    assert per_row(cache.state.stats.telemetry, 3) == per_row(native.telemetry, 3)
    alone = [greedy(hf, [p], PolicyCache(hf, POLICIES[name](), max_new_tokens=steps, prefill_chunk=chunk), steps)[0]
             for p in prompts]
    assert tokens == alone


@pytest.mark.parametrize("name", ["snapkv", "beacon", "h2o"])
def test_a_question_on_a_compressed_context_matches_session_extend(models, name):
    """kvpress's protocol: the context compressed without the question, then asked."""
    hf, ours = models["llama"]
    context, question = random_prompts((100, 12), seed=7)
    steps, chunk = 10, 16
    policy = POLICIES[name]()
    session = Session(ours, policy, batch=1, capacity=policy.capacity([100], 12 + steps, prefill_chunk=chunk),
                      max_tokens=100 + 12 + steps)
    session.prefill([context], chunk=chunk)
    logits = session.extend([question], [0])
    want = [int(logits.argmax(-1))]
    for _ in range(steps - 1):
        want.append(int(session.step_logits(torch.tensor(want[-1:])).argmax(-1)))
    cache = PolicyCache(hf, POLICIES[name](), max_new_tokens=12 + steps, prefill_chunk=chunk)
    last_logits(hf, [context], cache)
    held = [int(layer.length[0]) for layer in cache.store.layers]
    assert max(held) <= 4 + 32 and cache.state.stats.evictions[0] >= 3  # the context is compressed
    full = torch.tensor([context + question])
    with torch.inference_mode():
        out = hf.generate(full, attention_mask=torch.ones_like(full), cache=cache, max_new_tokens=steps,
                          do_sample=False, pad_token_id=0, eos_token_id=None)
    assert out[0, 112:].tolist() == want
    assert same_evictions(session.state.stats.telemetry, cache.state.stats.telemetry) is None


# ------------------------------------------------------------------------------------------- the bound
@pytest.mark.parametrize("name", list(POLICIES))
def test_the_store_never_holds_more_than_n_prefix_plus_budget_plus_the_chunk(models, name):
    hf, _ = models["qwen3"]
    prompts, steps, chunk, bound = random_prompts((200, 120), seed=8), 20, 16, 4 + 32 + 16
    policy = POLICIES[name]()
    cache = PolicyCache(hf, policy, max_new_tokens=steps, prefill_chunk=chunk)
    peak = [0, 0]

    def watch(module, args, output):  # after each policy layer wrote a call's tokens, before the policy acts
        index = cache.policy_index(module.layer_idx)
        if index is not None and cache.store is not None:
            peak[:] = [max(p, n) for p, n in zip(peak, cache.store[index].length.tolist())]

    handles = [layer.self_attn.register_forward_hook(watch) for layer in decoder_layers(hf)]
    try:
        greedy(hf, prompts, cache, steps)
    finally:
        for h in handles:
            h.remove()
    assert cache.store.capacity == policy.capacity([200, 120], steps, prefill_chunk=chunk) <= bound < 120
    assert max(peak) <= cache.store.capacity and max(peak) > 4 + 32  # the chunk on top of a full budget
    assert PolicyCache(hf, POLICIES[name](), max_new_tokens=steps).store is None  # sized at the prefill:
    whole = PolicyCache(hf, POLICIES[name](), max_new_tokens=steps)
    last_logits(hf, prompts, whole)
    assert whole.store.capacity >= 200  # without chunks the store holds the whole prompt


# ------------------------------------------------------------------------------------------- refusals
def test_refusals_name_the_fix(models):
    hf, _ = models["llama"]
    with pytest.raises(PolicyCacheError, match="prefill_chunk=0 must be a positive int"):
        PolicyCache(hf, FullKV(), prefill_chunk=0)
    contexts = random_prompts((20, 11), seed=9)
    cache = PolicyCache(hf, FullKV(), max_new_tokens=8)
    last_logits(hf, contexts, cache)
    with torch.inference_mode():
        with pytest.raises(PolicyCacheError, match="room for 8 more after the prompt; this forward brings 9"):
            hf(input_ids=torch.ones(2, 9, dtype=torch.long), cache=cache)
        # a padded batch whose question comes without position_ids: the model would number the shorter row wrong
        with pytest.raises(PolicyCacheError, match="row 1's token in column 0 of this forward is position 11"):
            hf(input_ids=torch.ones(2, 3, dtype=torch.long), cache=cache)
        with pytest.raises(PolicyCacheError, match=r"2D attention_mask of shape \(2, 23\)"):
            hf(input_ids=torch.ones(2, 3, dtype=torch.long), attention_mask=torch.ones(2, 3), cache=cache)
    evicting = PolicyCache(hf, SnapKV(32, n_recent=4, n_prefix=4), max_new_tokens=8)
    last_logits(hf, random_prompts((40,), seed=10), evicting)
    with torch.inference_mode(), pytest.raises(PolicyCacheError, match="prefill_chunk=N"):
        hf(input_ids=torch.ones(1, 60, dtype=torch.long), cache=evicting)  # a long question overflows its store


def test_a_forward_cut_into_calls_returns_its_last_calls_logits(models):
    hf, _ = models["llama"]
    ids = torch.tensor(random_prompts((37,), seed=11))
    with torch.inference_mode():
        out = hf(input_ids=ids, cache=PolicyCache(hf, FullKV(), max_new_tokens=4, prefill_chunk=16))
        whole = hf(input_ids=ids, cache=PolicyCache(hf, FullKV(), max_new_tokens=4))
    assert out.logits.shape[1] == 37 - 32 and whole.logits.shape[1] == 37  # calls of 16, 16, then 5 columns
    torch.testing.assert_close(out.logits, whole.logits[:, 32:], atol=1e-4, rtol=0)
