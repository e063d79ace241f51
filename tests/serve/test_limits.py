"""What one request may cost before it is admitted: a body over ``--max-request-bytes`` gets 413 before the app
reads it (declared or streamed), one slower than ``--body-timeout`` gets 408; a prompt too long to fit is refused
without being tokenized, and the bound that decides it never refuses a prompt that fits; oversized lists are
refused before they are parsed into models; an answer over ``--max-answer-tokens`` is refused before anything is
tokenized, and a large answer is serialised without holding the event loop; and the event loop keeps answering
``/health`` within a second while the largest requests are handled."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import beaconkv
from beaconkv.serve import responses
from beaconkv.serve.errors import APIError
from beaconkv.serve.limits import (
    DEFAULT_MAX_ANSWER_TOKENS,
    DEFAULT_MAX_REQUEST_BYTES,
    RequestLimits,
    check_answer_size,
    max_token_chars,
)
from beaconkv.serve.responses import json_bytes

from .conftest import NAME, PROMPT_CAPACITY, live_app

LIMIT = DEFAULT_MAX_REQUEST_BYTES


def _counting_app(tiny_served, limits: RequestLimits):
    """A live app with these limits whose tokenizer counts the characters it encodes (``app.encoded``)."""
    model, _ = tiny_served
    tok = beaconkv.load_tokenizer(beaconkv.embedded_model_path())
    encoded = []
    real = tok.encode

    def encode(text, add_special_tokens=False):
        encoded.append(len(text))
        return real(text, add_special_tokens)

    tok.encode = encode
    app = live_app(model, tok, limits=limits)
    app.encoded = encoded
    return app


@pytest.fixture(scope="module")
def spied(tiny_served):
    """An app with a 64 KiB body limit whose tokenizer counts the characters it encodes."""
    app = _counting_app(tiny_served, RequestLimits(max_request_bytes=64 * 1024))
    try:
        yield app
    finally:
        app.close()


def test_a_body_over_the_limit_gets_413_before_the_app_reads_it(spied):
    counters = spied.app.state.serve.worker.counters
    submitted, refused = counters.submitted, counters.refused["too_large"]
    body = json.dumps({"model": NAME, "prompt": "x" * 70_000}).encode()
    r = spied.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.headers["connection"] == "close"
    error = r.json()["error"]
    assert error["code"] == "request_too_large" and f"has {len(body)} bytes" in error["message"]
    assert "65536" in error["message"] and "--max-request-bytes" in error["message"]

    async def chunks():  # no Content-Length: the streamed bytes are counted
        for _ in range(100):
            yield b"x" * 1024

    r = spied.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "passed" in r.json()["error"]["message"]
    assert counters.submitted == submitted and counters.refused["too_large"] == refused + 2 and not spied.encoded
    r = spied.post("/v1/completions", json={"model": NAME, "prompt": "hello", "max_tokens": 2})  # under the limit
    assert r.status_code == 200 and spied.get("/health").status_code == 200


def test_a_prompt_too_long_to_fit_is_refused_without_tokenizing(spied):
    bound = spied.app.state.serve.max_prompt_chars
    assert bound == PROMPT_CAPACITY * max_token_chars(spied.app.state.serve.tokenizer)
    spied.encoded.clear()
    for path, body in [("/v1/completions", {"prompt": "a" * (bound + 1)}),
                       ("/v1/completions", {"prompt": ["hi", "b" * (bound + 1)]}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "c" * bound}]})]:
        r = spied.post(path, json={"model": NAME, **body})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "context_length_exceeded" and f"more than {bound}" in error["message"]
    assert spied.encoded == []  # none of them reached the tokenizer
    r = spied.post("/v1/completions", json={"model": NAME, "prompt": "a" * bound})  # fits the bound: tokenized
    assert r.status_code == 400 and "tokens, more than" in r.json()["error"]["message"]
    assert spied.encoded == [bound]


def test_oversized_lists_are_refused_before_they_are_parsed(live):
    cases = [({"prompt": [5] * (PROMPT_CAPACITY + 1)}, "prompt", "tokens, more than"),
             ({"prompt": [[5]] * 129}, "prompt", "129 prompts, more than the 128 choices"),
             ({"prompt": [[5], [6] * (PROMPT_CAPACITY + 1)]}, "prompt", "tokens, more than"),
             ({"messages": [{"role": "user", "content": "x"}] * (PROMPT_CAPACITY + 1)}, "messages", "messages, more")]
    for body, param, fragment in cases:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = live.post(path, json={"model": NAME, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param and fragment in r.text, r.text


@pytest.fixture(scope="module")
def tokenizer():
    return beaconkv.load_tokenizer(beaconkv.embedded_model_path())


@pytest.fixture(scope="module")
def longest(tokenizer):
    return max_token_chars(tokenizer)


SPECIAL = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<file_sep>", " " * 81, "#" * 80, "\n" + " " * 79]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.text(max_size=60) | st.sampled_from(SPECIAL), min_size=1, max_size=8).map("".join))
def test_the_character_bound_never_refuses_a_prompt_that_fits(tokenizer, longest, text):
    """A text of c characters has at least c / max_token_chars tokens: refusing longer texts unseen is exact."""
    assert len(text) <= longest * max(1, len(tokenizer.encode_prompt(text)))


def _bodies(bound: int) -> dict[str, tuple[str, str]]:
    """The costliest bodies under the default limit, by kind: what parsing, checking or tokenizing them costs."""
    limit = LIMIT - 1024
    return {
        "token ids": ("/v1/completions", json.dumps({"model": NAME, "prompt": [5] * (limit // 3)})),
        "128 id lists": ("/v1/completions", json.dumps({"model": NAME, "prompt": [[5] * (limit // 390)] * 128})),
        "many messages": ("/v1/chat/completions",
                          json.dumps({"model": NAME, "messages": [{"role": "user", "content": ""}] * (limit // 35)})),
        "texts at the bound": ("/v1/completions",  # tokenized: 8 x 20k tokens, refused for their length
                               json.dumps({"model": NAME, "prompt": ["🙂" * (bound - 1)] * 8, "max_tokens": 1})),
        "one long text": ("/v1/completions", json.dumps({"model": NAME, "prompt": "hello world " * (limit // 12)})),
    }


@pytest.mark.parametrize("kind", list(_bodies(1)))
def test_health_answers_within_a_second_while_a_large_request_is_handled(live, kind):
    """The event loop's longest stall, and the slowest /health, while the costliest body of each kind under the
    default --max-request-bytes is handled (parsed, checked, tokenized, refused)."""
    path, body = _bodies(live.app.state.serve.max_prompt_chars)[kind]
    assert LIMIT // 5 < len(body) < LIMIT

    async def run():
        stalls, done = [], asyncio.Event()

        async def watch():
            while not done.is_set():
                t0 = time.perf_counter()
                await asyncio.sleep(0.005)
                stalls.append(time.perf_counter() - t0)

        async def health():
            latencies = []
            while not done.is_set():
                t0 = time.perf_counter()
                assert (await live.client.get("/health")).status_code == 200
                latencies.append(time.perf_counter() - t0)
                await asyncio.sleep(0.01)
            return latencies

        watcher, prober = asyncio.ensure_future(watch()), asyncio.ensure_future(health())
        await asyncio.sleep(0.05)
        answer = await live.client.post(path, content=body, headers={"content-type": "application/json"})
        await asyncio.sleep(0.05)
        done.set()
        await watcher
        return answer, max(stalls), max(await prober)

    answer, stall, slowest = live.call(run(), timeout=120)
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "context_length_exceeded", answer.text
    assert stall < 1.0 and slowest < 1.0, (stall, slowest)


# ------------------------------------------------------------------------------ the size of an answer
def test_the_answer_bound_refuses_the_probe_before_any_work():
    """The issue's 136-byte request: n=128, max_tokens=512, 20 alternatives per token — 1,376,256 answer tokens
    (a 111 MiB answer) — is over the default bound; one choice of 32k tokens with 20 alternatives is under it."""
    with pytest.raises(APIError) as err:
        check_answer_size(128, 512, 20, DEFAULT_MAX_ANSWER_TOKENS)
    message = err.value.message
    assert err.value.status == 400 and err.value.code == "answer_too_large"
    for fragment in ("n=128", "max_tokens=512", "top_logprobs=20", "= 1376256", f"limit of {DEFAULT_MAX_ANSWER_TOKENS}",
                     "--max-answer-tokens"):
        assert fragment in message, (fragment, message)
    check_answer_size(1, 32768, 20, DEFAULT_MAX_ANSWER_TOKENS)
    check_answer_size(32, 32768, 0, DEFAULT_MAX_ANSWER_TOKENS)


@pytest.fixture(scope="module")
def bounded(tiny_served):
    """An app whose answers may hold 1,000 tokens (alternatives included), counting what it tokenizes."""
    app = _counting_app(tiny_served, RequestLimits(max_answer_tokens=1000))
    try:
        yield app
    finally:
        app.close()


def test_an_answer_over_the_bound_gets_400_naming_every_factor(bounded):
    counters = bounded.app.state.serve.worker.counters
    submitted = counters.submitted
    bounded.encoded.clear()
    chat = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "n": 4, "max_tokens": 16,
            "logprobs": True, "top_logprobs": 20, "ignore_eos": True}
    r = bounded.post("/v1/chat/completions", json=chat)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "answer_too_large" and error["param"] == "n"
    assert "n=4 x max_tokens=16 x (1 + top_logprobs=20) = 1344 answer tokens" in error["message"]
    assert "limit of 1000" in error["message"]
    text = {"model": NAME, "prompt": ["a", "b", "c"], "n": 2, "max_tokens": 16, "logprobs": 10}
    r = bounded.post("/v1/completions", json=text)
    assert r.status_code == 400, r.text
    assert "n=2 for 3 prompts (6 choices) x max_tokens=16 x (1 + logprobs=10) = 1056" in r.json()["error"]["message"]
    assert counters.submitted == submitted and bounded.encoded == []  # refused before anything was tokenized
    r = bounded.post("/v1/chat/completions", json={**chat, "top_logprobs": 14})  # 4 x 16 x 15 = 960: served
    assert r.status_code == 200 and all(len(c["logprobs"]["content"]) == 16 for c in r.json()["choices"])


ENTRY = {"token": "abc", "logprob": -1.25, "bytes": [97, 98, 99],
         "top_logprobs": [{"token": "x\u00e9", "logprob": -2.5, "bytes": [120, 195, 169]}] * 20}


def test_a_large_answer_is_serialised_without_holding_the_event_loop():
    """25,000 log-probability entries of 20 alternatives (a 28 MB answer, seconds of json.dumps on a busy CPU)
    serialised on a thread while the event loop ticks every 5 ms: no tick waits long, and the bytes are
    json.dumps's."""
    answer = {"id": "x", "choices": [{"index": i, "logprobs": {"content": [ENTRY] * 12_500}} for i in range(2)]}

    async def run():
        stalls, done = [], asyncio.Event()

        async def tick():
            while not done.is_set():
                t0 = time.perf_counter()
                await asyncio.sleep(0.005)
                stalls.append(time.perf_counter() - t0)

        ticker = asyncio.ensure_future(tick())
        payload = await asyncio.to_thread(json_bytes, answer)
        done.set()
        await ticker
        return payload, max(stalls), len(stalls)

    payload, stall, ticks = asyncio.run(run())
    assert payload == json.dumps(answer, ensure_ascii=False, separators=(",", ":")).encode()
    assert ticks > 10 and stall < 0.5, (stall, ticks)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                    | st.text(max_size=6), lambda c: st.lists(c, max_size=7) | st.dictionaries(
                        st.text(max_size=4) | st.integers() | st.booleans() | st.none(), c, max_size=4),
                    max_leaves=40)


@settings(max_examples=60, deadline=None)
@given(JSON)
def test_sliced_serialisation_is_json_dumps_byte_for_byte(monkeypatch_slice, value):
    assert json_bytes(value) == json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


@pytest.fixture(scope="module")
def monkeypatch_slice():
    """Slices of 3 elements and pieces of 5 values, so that small values take every path of the serialisation."""
    real = responses.JSON_SLICE, responses.JSON_NODES
    responses.JSON_SLICE, responses.JSON_NODES = 3, 5
    try:
        yield
    finally:
        responses.JSON_SLICE, responses.JSON_NODES = real


# ------------------------------------------------------------------------------ a body that comes slowly
def test_a_body_slower_than_the_timeout_gets_408_and_is_dropped(tiny_served):
    app = live_app(*tiny_served, limits=RequestLimits(body_timeout_s=0.5))
    try:
        async def trickle():
            yield b'{"model": "tiny", '
            await asyncio.sleep(10)
            yield b'"prompt": "hi"}'

        t0 = time.perf_counter()
        r = app.post("/v1/completions", content=trickle(), headers={"content-type": "application/json"})
        assert r.status_code == 408 and r.headers["connection"] == "close", r.text
        assert r.json()["error"]["code"] == "request_timeout" and "--body-timeout" in r.json()["error"]["message"]
        assert time.perf_counter() - t0 < 5  # answered at the timeout, not when the body ends (10 s)
        assert app.app.state.serve.worker.counters.refused["body_timeout"] == 1
        assert app.post("/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 1}).status_code == 200
    finally:
        app.close()


def test_request_limits_refuse_values_that_cannot_work():
    for field, value in (("max_request_bytes", 0), ("body_timeout_s", -1.0), ("max_answer_tokens", 1.5),
                         ("template_timeout_s", 0)):
        with pytest.raises(ValueError, match=f"{field}={value!r}"):
            RequestLimits(**{field: value})
