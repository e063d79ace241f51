"""The continuous-batching engine: a request's result does not depend on its company, slots are
reused, finished requests stop costing, and requests carry their own sampling and stop conditions."""

from __future__ import annotations

import pytest
import torch

import beaconkv
from beaconkv.engine import Engine, EngineError, QueueFullError, Request
from beaconkv.policies import make_policy
from beaconkv.sampling import SamplingParams

POLICIES = {
    "full": lambda: make_policy("full", telemetry=True),
    "beacon": lambda: make_policy("beacon", budget=16, n_recent=2, n_beacon=3, telemetry=True),
    "snapkv": lambda: make_policy("snapkv", budget=16, n_recent=2, window=4, telemetry=True),
}


@pytest.fixture(scope="module")
def llama(tiny_models):
    return beaconkv.load_model(tiny_models["llama"][0])


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _prompt(n, seed):
    return torch.randint(3, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _kept(engine, completion):
    """The kept positions of one request's slot at each of its evictions, layer by layer (padding dropped:
    an eviction shared with a longer prefix pads the shorter rows)."""
    out = []
    for r in engine.session.state.stats.telemetry:
        if completion.slot in r.rows:
            heads = r.kept_positions[r.rows.index(completion.slot)].tolist()
            out.append((r.layer, [[p for p in h if p >= 0] for h in heads]))
    return out


def _engine(llama, name, **kw):
    return Engine(llama, None, policy=POLICIES[name](), max_batch=3, prompt_capacity=24, max_new_tokens=64, **kw)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_request_does_not_depend_on_its_company(llama, name):
    target = Request(_prompt(11, 0), max_new_tokens=50, eos_token_ids=[])
    others = [Request(_prompt(n, s), max_new_tokens=m, eos_token_ids=[]) for n, s, m in ((20, 1, 60), (7, 2, 12))]

    alone = _engine(llama, name)
    a = alone.run([target])[0]

    static = _engine(llama, name)
    b = static.run([target, *others])[0]

    busy = _engine(llama, name)  # the short request finishes; the target takes a freed slot mid-flight
    ids = [busy.submit(r) for r in [*others, Request(_prompt(5, 3), max_new_tokens=40, eos_token_ids=[])]]
    done = {}
    for _ in range(15):
        for ev in busy.step():
            if ev.completion is not None:
                done[ev.request_id] = ev.completion
    assert ids[1] in done and busy.running == 2  # one slot came free while the others run
    c = busy.run([target])[0]
    assert c.slot == done[ids[1]].slot and c.queued_s < 1.0

    assert a.token_ids == b.token_ids == c.token_ids and len(a.token_ids) == 50
    assert a.evictions == b.evictions == c.evictions
    if name != "full":
        assert a.evictions > 0
    assert _kept(alone, a) == _kept(static, b) == _kept(busy, c)


def test_finished_requests_stop_being_evicted_and_counted(llama):
    short = Request(_prompt(6, 4), max_new_tokens=8, eos_token_ids=[])
    long = Request(_prompt(6, 5), max_new_tokens=64, eos_token_ids=[])
    policy = make_policy("beacon", budget=16, n_recent=2, n_beacon=3)
    alone = Engine(llama, None, policy=policy, max_batch=2, prompt_capacity=8, max_new_tokens=64).run([short])[0]
    both = Engine(llama, None, policy=policy, max_batch=2, prompt_capacity=8, max_new_tokens=64).run([short, long])
    assert alone.evictions == both[0].evictions == 0 and both[1].evictions > 3


def test_slots_are_reused_and_the_compiled_step_too(llama):
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from beaconkv.execution.decode import decode_and_sample

    engine = Engine(llama, None, policy=make_policy("snapkv", budget=16, n_recent=2, window=4), max_batch=2,
                    prompt_capacity=12, max_new_tokens=40, compile=beaconkv.CompileConfig(backend="aot_eager"))
    engine.run([Request(_prompt(9, 9), max_new_tokens=5, eos_token_ids=[])])  # compiles the step
    before = len(_debug_get_cache_entry_list(decode_and_sample.__code__))
    reqs = [Request(_prompt(4 + i, 10 + i), max_new_tokens=6 + 5 * i, eos_token_ids=[]) for i in range(7)]
    done = engine.run(reqs)
    assert [len(c.token_ids) for c in done] == [6 + 5 * i for i in range(7)]
    assert {c.slot for c in done} == {0, 1}  # seven requests through two slots
    assert len(_debug_get_cache_entry_list(decode_and_sample.__code__)) == before  # no new graph per admission
    assert engine.stats.busy_slot_steps <= 2 * engine.stats.steps


def test_per_request_sampling_and_seeds_do_not_depend_on_company(llama):
    sampled = Request(_prompt(10, 6), max_new_tokens=20, eos_token_ids=[],
                      sampling=SamplingParams(temperature=0.9, top_p=0.9, top_k=20), seed=123)
    greedy = Request(_prompt(8, 7), max_new_tokens=20, eos_token_ids=[])
    other = Request(_prompt(8, 8), max_new_tokens=20, eos_token_ids=[], sampling=SamplingParams(temperature=1.3),
                    seed=5)
    alone = _engine(llama, "full").run([sampled])[0]
    mixed = _engine(llama, "full").run([greedy, sampled, other])
    again = _engine(llama, "full").run([other, sampled])
    assert alone.token_ids == mixed[1].token_ids == again[1].token_ids
    reseeded = _engine(llama, "full").run([Request(sampled.prompt, 20, sampled.sampling, seed=124, eos_token_ids=[])])
    assert reseeded[0].token_ids != alone.token_ids
    assert mixed[0].token_ids == _engine(llama, "full").run([greedy])[0].token_ids


def test_eos_ends_a_request_and_frees_its_slot(llama):
    free = _engine(llama, "full").run([Request(_prompt(10, 11), max_new_tokens=30, eos_token_ids=[])])[0]
    stop_id = free.token_ids[6]
    out = _engine(llama, "full").run([Request(_prompt(10, 11), max_new_tokens=30, eos_token_ids=[stop_id])])[0]
    assert out.token_ids == free.token_ids[: free.token_ids.index(stop_id) + 1] and out.finish_reason == "stop"


def test_requests_are_checked_with_clear_messages(llama):
    engine = _engine(llama, "full", max_queue=2)
    with pytest.raises(EngineError, match="30 tokens, more than a slot's prompt capacity of 24"):
        engine.submit(Request(_prompt(30, 0)))
    with pytest.raises(EngineError, match="max_new_tokens=100 is more than this engine's max_new_tokens=64"):
        engine.submit(Request(_prompt(3, 0), max_new_tokens=100))
    with pytest.raises(EngineError, match="token id 500 is outside the vocabulary"):
        engine.submit(Request([1, 500], max_new_tokens=8))
    with pytest.raises(EngineError, match="stop strings need a tokenizer"):
        engine.submit(Request([1, 2], max_new_tokens=8, stop=["x"]))
    engine.submit(Request([1, 2], max_new_tokens=8))
    engine.submit(Request([1, 2], max_new_tokens=8))
    with pytest.raises(QueueFullError, match="max_queue=2") as err:
        engine.submit(Request([1, 2], max_new_tokens=8))
    assert err.value.retry_after_s >= 1.0


def test_cancel_frees_the_slot_within_a_step(llama):
    engine = _engine(llama, "full")
    rid = engine.submit(Request(_prompt(10, 12), max_new_tokens=60, eos_token_ids=[]))
    engine.step()
    engine.step()
    engine.cancel(rid)
    events = engine.step()
    assert [e.completion.finish_reason for e in events if e.completion] == ["cancelled"]
    assert engine.running == 0 and engine.idle


def test_generate_with_more_prompts_than_slots_equals_single_runs(llama):
    prompts = [_prompt(n, 20 + n) for n in (5, 12, 9, 7, 14)]
    policy = make_policy("beacon", budget=16, n_recent=2, n_beacon=3)
    pooled = beaconkv.generate(llama, None, prompts, max_new_tokens=40, eos_token_ids=[], policy=policy, max_batch=2)
    singles = [beaconkv.generate(llama, None, [p], max_new_tokens=40, eos_token_ids=[], policy=policy).token_ids[0]
               for p in prompts]
    assert pooled.token_ids == singles and pooled.stats.max_batch == 2
    assert all(e > 0 for e in pooled.stats.evictions)


# ------------------------------------------------------------------- text: stop strings, messages, streaming
@pytest.fixture(scope="module")
def embedded():
    path = beaconkv.embedded_model_path()
    return beaconkv.load_model(path), beaconkv.load_tokenizer(path)


def test_stop_strings_cut_the_text_and_streaming_never_shows_them(embedded):
    model, tok = embedded
    prompt = "Count from 1 to 20, one number per line."
    full = beaconkv.generate(model, tok, prompt, chat=True, max_new_tokens=40, eos_token_ids=[])
    assert "5. 5" in full.texts[0]
    streamed = []
    out = beaconkv.generate(model, tok, prompt, chat=True, max_new_tokens=40, eos_token_ids=[], stop=["5. 5", "zzz"],
                            stream=lambda i, t, text: streamed.append(text))
    assert out.finish_reasons == ["stop"]
    assert out.texts[0] == full.texts[0][: full.texts[0].index("5. 5")]
    assert "".join(streamed) == out.texts[0]
    assert out.token_ids[0] == full.token_ids[0][: len(out.token_ids[0])]


def test_generate_takes_messages_and_template_options(embedded):
    model, tok = embedded
    conversation = [{"role": "system", "content": "Answer in one word."},
                    {"role": "user", "content": "What color is the sky?"}]
    out = beaconkv.generate(model, tok, [conversation, conversation], max_new_tokens=6)
    rendered = tok.apply_chat_template(conversation)
    assert out.prompt_ids[0] == out.prompt_ids[1] == tok.encode_prompt(rendered)
    assert "Answer in one word." in rendered and out.token_ids[0] == out.token_ids[1]
    with pytest.raises(beaconkv.PromptError, match="'role' and 'content'"):
        beaconkv.generate(model, tok, [[{"role": "user"}]], max_new_tokens=2)


def test_streaming_detokenises_incrementally(embedded):
    from beaconkv.detokenize import IncrementalDetokenizer

    _, tok = embedded
    text = "Ünïcödé — 数学 🙂 and plain words, numbers 12345, spaces   and\nnewlines."
    ids = tok.encode(text) * 20
    detok = IncrementalDetokenizer(tok.decode)
    deltas = [detok.push(t) for t in ids]
    assert "".join(deltas) == tok.decode(ids) == detok.text
    assert detok.decoded_tokens <= 8 * len(ids)  # O(new tokens), not O(n^2) (that would be ~n^2/2 = 1.5M here)


# ------------------------------------------------------------------ faults stay with their request
def _corrupt(params: SamplingParams, **fields) -> SamplingParams:
    """``params`` with fields changed after its checks: a value a validation missed (the overflows once seen)."""
    for name, value in fields.items():
        object.__setattr__(params, name, value)
    return params


def _collect(engine, done):
    for ev in engine.step():
        if ev.completion is not None:
            done[ev.request_id] = ev.completion


FAULTS = ["temperature-overflow", "top_k-overflow", "callback", "prefill"]


@pytest.mark.parametrize("fault", FAULTS)
def test_a_failing_request_fails_alone_and_the_others_finish_identically(llama, fault, monkeypatch):
    """A busy pool: A runs; B and a failing request are admitted together mid-flight. The failing one ends with
    finish_reason "error" (its own fault: sampling values that overflow the row tensors, a callback that
    raises mid-decode, a prefill that raises), A and B give the very tokens they give without it, and the
    engine serves the next request."""
    a = Request(_prompt(11, 30), max_new_tokens=40, eos_token_ids=[])
    b = Request(_prompt(7, 31), max_new_tokens=30, eos_token_ids=[], seed=3,
                sampling=SamplingParams(temperature=0.9, top_k=30, presence_penalty=0.5))
    bad_prompt = _prompt(9, 32)

    def bad_request():
        if fault == "temperature-overflow":
            return Request(bad_prompt, 20, _corrupt(SamplingParams(temperature=0.5), temperature=1e39), seed=1)
        if fault == "top_k-overflow":
            return Request(bad_prompt, 20, _corrupt(SamplingParams(temperature=0.5), top_k=2**63), seed=1)
        if fault == "callback":
            def on_event(ev):
                if ev.token_id is not None and ev.completion is None and len(seen) == 2:
                    raise RuntimeError("the client's callback broke")
                seen.append(ev)
            seen = []
            return Request(bad_prompt, 20, eos_token_ids=[], on_event=on_event)
        return Request(bad_prompt, 20, eos_token_ids=[])

    def run(with_fault):
        engine = _engine(llama, "beacon")
        if fault == "prefill" and with_fault:
            real = engine.session.prefill

            def prefill(prompts, rows=None, **kwargs):
                if bad_prompt in prompts:
                    raise RuntimeError("out of memory in the prefill")
                return real(prompts, rows, **kwargs)

            monkeypatch.setattr(engine.session, "prefill", prefill)
        done = {}
        first = engine.submit(a)
        for _ in range(5):
            _collect(engine, done)
        ids = [first, engine.submit(b)] + ([engine.submit(bad_request())] if with_fault else [])
        while not engine.idle:
            _collect(engine, done)
        after = engine.run([Request(_prompt(6, 33), 12, eos_token_ids=[])])[0]
        return [done[i] for i in ids], after

    clean, clean_after = run(False)
    (got_a, got_b, failed), after = run(True)
    assert failed.finish_reason == "error" and failed.error.startswith("the request failed: ")
    expected = {"temperature-overflow": "overflow", "top_k-overflow": "Overflow", "callback": "callback broke",
                "prefill": "out of memory"}[fault]
    assert expected in failed.error
    assert got_a.token_ids == clean[0].token_ids and got_b.token_ids == clean[1].token_ids
    assert got_a.finish_reason == got_b.finish_reason == "length" and got_a.evictions == clean[0].evictions
    assert after.token_ids == clean_after.token_ids


def test_a_failing_decode_step_fails_its_requests_and_the_engine_goes_on(llama, monkeypatch):
    engine = _engine(llama, "beacon")
    done = {}
    ids = [engine.submit(Request(_prompt(8, 40 + i), 30, eos_token_ids=[])) for i in range(2)]
    for _ in range(3):
        _collect(engine, done)
    real = engine.session.step
    calls = []

    def step(*args):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("the device went away")
        return real(*args)

    monkeypatch.setattr(engine.session, "step", step)
    _collect(engine, done)  # does not raise: the step's requests fail
    assert [done[i].finish_reason for i in ids] == ["error", "error"] and engine.idle
    assert "the decode step failed (RuntimeError: the device went away)" in done[ids[0]].error
    target = Request(_prompt(10, 50), 25, eos_token_ids=[])
    assert engine.run([target])[0].token_ids == _engine(llama, "beacon").run([target])[0].token_ids


def test_new_request_fields_are_checked_against_the_engine(llama):
    engine = _engine(llama, "full")
    with pytest.raises(EngineError, match="logit_bias names token 97, outside the vocabulary 0 .. 96"):
        engine.submit(Request([1, 2], 4, SamplingParams(logit_bias={97: 1.0})))
    with pytest.raises(EngineError, match="must be a beaconkv.sampling.SamplingParams"):
        engine.submit(Request([1, 2], 4, sampling={"temperature": 0.5}))
    tokenized = Engine(llama, _WordTokenizer(), max_batch=1, prompt_capacity=8, max_new_tokens=8)
    with pytest.raises(EngineError, match="17 stop strings are more than 16"):
        tokenized.submit(Request([1, 2], 4, stop=[f"s{i}" for i in range(17)]))
    with pytest.raises(EngineError, match="at most 1024 characters"):
        tokenized.submit(Request([1, 2], 4, stop=["x" * 1025]))


class _WordTokenizer:
    """Just enough of a tokenizer for stop strings: token ``i`` reads ``w<i> ``."""

    eos_token_ids: list[int] = []

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"w{i} " for i in ids)


def test_bias_penalties_and_logprobs_through_the_engine_equal_a_step_by_step_reference(llama):
    """OpenAI's semantics, one token at a time on a plain session: logits + bias - presence * (count > 0)
    - frequency * count over the tokens generated so far; logprobs of the raw logits."""
    from beaconkv.session import Session

    prompt, n = _prompt(10, 60), 30
    params = SamplingParams(presence_penalty=0.8, frequency_penalty=0.6, logit_bias={7: 2.5, 8: -100}, logprobs=2)
    company = [Request(_prompt(9, 61), n, eos_token_ids=[]),
               Request(_prompt(12, 62), n, SamplingParams(temperature=1.1, frequency_penalty=-1.0), seed=4,
                       eos_token_ids=[])]
    got = _engine(llama, "full").run([company[0], Request(prompt, n, params, eos_token_ids=[]), company[1]])[1]

    session = Session.for_prompts(llama, None, [len(prompt)], n)
    logits = session.prefill([prompt])[0]
    bias, counts = torch.zeros(97), torch.zeros(97)
    bias[7], bias[8] = 2.5, -100.0
    tokens, logprobs = [], []
    with torch.inference_mode():
        for _ in range(n):
            token = int((logits + bias - 0.8 * (counts > 0) - 0.6 * counts).argmax())
            tokens.append(token)
            logprobs.append(logits.log_softmax(-1))
            counts[token] += 1
            logits = session.step_logits(torch.tensor([token]))[0]
    assert got.token_ids == tokens and 8 not in tokens and len(set(tokens)) > 5
    assert [e.token_id for e in got.logprobs] == tokens
    for entry, lp in zip(got.logprobs, logprobs):
        assert entry.logprob == pytest.approx(lp[entry.token_id].item(), abs=1e-5)
        top = lp.topk(2)
        assert [t for t, _ in entry.top] == top.indices.tolist()
        assert [v for _, v in entry.top] == pytest.approx(top.values.tolist(), abs=1e-5)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_batch": 0}, "max_batch=0 must be an int >= 1"),
    ({"prompt_capacity": True}, "prompt_capacity=True must be an int >= 1"),
    ({"prefill_chunk": 0}, "prefill_chunk=0 must be an int >= 1"),
    ({"prompt_capacity": 10**6}, "exceeds the model's max_position_embeddings"),
])
def test_an_engine_refuses_bad_sizes_naming_them(llama, kwargs, message):
    with pytest.raises(EngineError, match=message):
        Engine(llama, None, **kwargs)
