"""What one request may cost before it is admitted: a body over ``--max-request-bytes`` gets 413 before the app
reads it (declared or streamed); a prompt too long to fit is refused without being tokenized, and the bound that
decides it never refuses a prompt that fits; oversized lists are refused before they are parsed into models; and
the event loop keeps answering ``/health`` within a second while the largest requests are handled."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import beaconkv
from beaconkv.serve.limits import DEFAULT_MAX_REQUEST_BYTES, max_token_chars

from .conftest import NAME, PROMPT_CAPACITY, live_app

LIMIT = DEFAULT_MAX_REQUEST_BYTES


@pytest.fixture(scope="module")
def spied(tiny_served):
    """An app with a 64 KiB body limit whose tokenizer counts the characters it encodes."""
    model, _ = tiny_served
    tok = beaconkv.load_tokenizer(beaconkv.embedded_model_path())
    encoded = []
    real = tok.encode

    def encode(text, add_special_tokens=False):
        encoded.append(len(text))
        return real(text, add_special_tokens)

    tok.encode = encode
    app = live_app(model, tok, max_request_bytes=64 * 1024)
    app.encoded = encoded
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
