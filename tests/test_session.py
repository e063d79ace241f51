"""The session's chunked prefill and its multi-token forward after the prefill (issue #43 item 1).

A prompt prefilled in chunks attends over exactly what a whole-prompt prefill attends over while nothing
is evicted (FullKV: the same logits, the same greedy tokens, every storage); with an evicting policy and
an int prefix the cache is sized ``n_prefix + budget + N`` and never holds the whole prompt; a question
asked with :meth:`Session.extend` on a cache holding a compressed context continues it as one prefill of
context + question would.
"""

from __future__ import annotations

import pytest
import torch

from beaconkv import generate
from beaconkv.engine import Engine, Request
from beaconkv.policies import BeaconKV, FullKV, SnapKV, StreamingLLM, make_policy
from beaconkv.session import Session

pytestmark = pytest.mark.usefixtures("one_thread")


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 97, (n,), generator=g).tolist() for n in lengths]


def greedy(session: Session, logits: torch.Tensor, steps: int) -> list[list[int]]:
    out = [logits.argmax(-1)]
    for _ in range(steps - 1):
        out.append(session.step_logits(out[-1]).argmax(-1))
    return torch.stack(out, 1).tolist()


@pytest.mark.parametrize("storage", ["dense", "int8"])
@pytest.mark.parametrize("chunk", [1, 7, 32])
def test_without_evictions_a_chunked_prefill_is_the_whole_prefill(llama, storage: str, chunk: int) -> None:
    ps = prompts([61, 40, 9])
    whole = Session.for_prompts(llama, FullKV(), [len(p) for p in ps], 12, kv_storage=storage)
    parts = Session.for_prompts(llama, FullKV(), [len(p) for p in ps], 12, kv_storage=storage)
    a, b = whole.prefill(ps), parts.prefill(ps, chunk=chunk)
    # int8 storage: a later chunk attends over the quantised keys of the earlier ones, as decode does
    torch.testing.assert_close(b, a, atol=1e-4 if storage == "dense" else 0.15, rtol=0)
    if storage == "dense":
        assert greedy(whole, a, 12) == greedy(parts, b, 12)
    for layer_a, layer_b in zip(whole.cache.layers, parts.cache.layers):
        assert torch.equal(layer_a.pos, layer_b.pos) and torch.equal(layer_a.length, layer_b.length)


@pytest.mark.parametrize("name", ["beacon", "snapkv", "streaming", "h2o", "expected_attention", "rkv", "initial_recent"])
def test_an_evicting_policy_never_holds_the_whole_prompt(llama, name: str) -> None:
    budget, chunk, n_prefix = 32, 16, 4
    policy = make_policy(name, budget=budget, n_recent=4, n_prefix=n_prefix,
                         **({"n_beacon": 4} if name in ("beacon", "initial_recent") else {}))
    lengths = [150, 90]
    session = Session(llama, policy, batch=2, capacity=policy.capacity(lengths, 8, prefill_chunk=chunk),
                      max_tokens=max(lengths) + 8)
    assert session.cache.capacity <= n_prefix + budget + chunk < min(lengths)
    logits = session.prefill(prompts(lengths), chunk=chunk)
    assert session.state.stats.evictions[0] >= 3 and session.state.stats.evictions[1] >= 2
    for layer in session.cache.layers:
        assert int(layer.length.max()) <= n_prefix + budget
        assert (layer.pos[:, :, :n_prefix] == torch.arange(n_prefix)).all()  # the prefix is held
        for b, n in enumerate(lengths):  # and the newest tokens
            assert set(range(n - 4, n)) <= set(layer.pos[b, 0].tolist())
    assert session.state.t == [149, 89]
    greedy(session, logits, 8)  # decoding goes on from there


def test_a_question_on_a_compressed_context_continues_it(llama) -> None:
    # FullKV: context prefilled (in chunks), then the question through extend == one prefill of both
    context, question = prompts([70, 9], seed=3)
    one = Session.for_prompts(llama, FullKV(), [79], 6)
    two = Session.for_prompts(llama, FullKV(), [79], 6)
    expected = one.prefill([context + question])
    two.prefill([context], chunk=32)
    got = two.extend([question], [0])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    assert greedy(one, expected, 6) == greedy(two, got, 6)
    # with eviction: the context compressed without seeing the question, then asked (kvpress's protocol)
    policy = SnapKV(32, n_recent=4, n_prefix=2)
    s = Session(llama, policy, batch=1, capacity=policy.capacity([79], 6, prefill_chunk=16), max_tokens=85)
    s.prefill([context], chunk=16)
    held = int(s.cache[0].length[0])
    s.extend([question], [0])
    assert s.state.t == [78] and int(s.cache[0].length[0]) <= 2 + 32 and held <= 2 + 32


def test_extend_refuses_a_row_that_is_not_live_and_empty_tokens(llama) -> None:
    s = Session.for_prompts(llama, FullKV(), [5, 5], 4)
    with pytest.raises(ValueError, match="rows \\[0\\] are not live"):
        s.extend([[5]], [0])
    s.prefill(prompts([5, 5]))
    with pytest.raises(ValueError, match="one non-empty token list per row"):
        s.extend([[]], [0])
    with pytest.raises(ValueError, match="chunk=0 must be a positive int"):
        s.prefill(prompts([5, 5]), chunk=0)


def test_generate_and_the_engine_bound_the_cache_and_keep_requests_independent(llama) -> None:
    policy = BeaconKV(32, n_recent=4, n_beacon=4, n_prefix=4)
    ps = prompts([120, 30, 75], seed=5)
    out = generate(llama, None, ps, max_new_tokens=10, policy=policy, prefill_chunk=16)
    assert out.stats.cache_capacity == policy.capacity([120], 10, prefill_chunk=16) <= 4 + 32 + 16
    whole = generate(llama, None, ps, max_new_tokens=10, policy=policy)
    assert whole.stats.cache_capacity >= 120  # without chunks the whole prompt is held
    # a request's tokens do not depend on which requests share the pool (ragged chunks, sub-batch extends)
    solo = [generate(llama, None, [p], max_new_tokens=10, policy=policy, prefill_chunk=16).token_ids[0] for p in ps]
    assert out.token_ids == solo
    engine = Engine(llama, policy=StreamingLLM(32, n_recent=4, n_prefix=4), max_batch=2, prompt_capacity=120,
                    max_new_tokens=10, prefill_chunk=16)
    done = engine.run([Request(p, 10) for p in ps])
    assert [len(c.token_ids) for c in done] == [10, 10, 10]
    assert engine.slot_capacity <= 4 + 32 + 16


def test_a_short_row_of_a_ragged_chunk_fits_where_its_padding_would_not(llama) -> None:
    # row 1 is nearly full; its one real token fits, the width of row 0's chunk would not
    from beaconkv.cache import CacheCapacityError, KVCache

    cache = KVCache.allocate(1, 2, 2, 4, 12, 8)
    layer = cache[0]
    k = torch.randn(2, 2, 10, 8)
    layer.write_prefill(k[:, :, :2], k[:, :, :2], torch.arange(2).expand(2, 2), torch.tensor([[True, True], [True, True]]))
    layer.write_chunk(k[1:, :, :9], k[1:, :, :9], torch.arange(2, 11)[None], torch.ones(1, 9, dtype=torch.bool),
                      rows=torch.tensor([1]))
    valid = torch.tensor([[True] * 6, [True] + [False] * 5])
    positions = torch.stack([torch.arange(2, 8), torch.arange(11, 17)])
    layer.write_chunk(k[:, :, :6], k[:, :, :6] * 2, positions, valid)
    assert layer.length.tolist() == [8, 12]
    assert layer.pos[1, 0].tolist() == list(range(12))
    assert torch.equal(layer.keys()[1, :, 11], k[1, :, 0]) and torch.equal(layer.keys()[0, :, 2:8], k[0, :, :6])
    with pytest.raises(CacheCapacityError, match="a chunk of 1 tokens after 12 held slots"):
        layer.write_chunk(k[1:, :, :1], k[1:, :, :1], torch.tensor([[17]]), torch.ones(1, 1, dtype=torch.bool),
                          rows=torch.tensor([1]))
