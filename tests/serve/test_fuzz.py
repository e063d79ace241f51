"""Fuzzed, not just tried: request bodies sent to the real app over a real engine (a tiny random model behind
the embedded tokenizer) — never a 500, every error in OpenAI's shape, every success well formed, and after
every request the engine thread alive and ``/health`` OK.

Coverage by construction: every field both request models declare (taken from the models themselves) gets every
value of a hostile table (wrong types, int64 and float32 overflows, NaN, huge strings and lists...), on both
endpoints, streamed and not. The Hypothesis test then draws whole bodies — mostly plausible values with hostile
ones mixed in, and raw bytes — under the derandomized ``ci`` profile and a fixed budget of 40 examples.
"""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from beaconkv.serve.schema import ChatCompletionRequest, CompletionRequest

from .conftest import NAME

ROUTES = {"chat": ("/v1/chat/completions", ChatCompletionRequest), "text": ("/v1/completions", CompletionRequest)}
BASE = {"chat": {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 0},
        "text": {"model": NAME, "prompt": "hi", "max_tokens": 1, "temperature": 0}}
HOSTILE = [None, True, -1, 0, 3, 2**63, -(2**63) - 1, 10**40, 1e39, -1e308, 5e-324, math.nan, math.inf, "", "1",
           "x" * 5000, "a\udc00b", [], [[]], [1, "a"], [5] * 300, {"5": 1e39}, {"": None, "role": "user"},
           [{"role": "user", "content": "\ud800"}]]
ALLOWED = {200, 400, 404, 413, 429}


def check(live, r) -> None:
    """One answer: an allowed status, OpenAI's error shape or a well-formed success; then the server is fine."""
    assert r.status_code in ALLOWED, (r.status_code, r.text[:500])
    if r.status_code != 200:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    elif r.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", r.text[-300:]
        assert all("error" not in json.loads(e) for e in events[:-1]), r.text[:500]
    else:
        out = r.json()
        assert [c["index"] for c in out["choices"]] == list(range(len(out["choices"]))) and out["choices"]
        usage = out["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    health = live.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok", health.text
    assert live.app.state.serve.worker.alive


@pytest.mark.parametrize("kind,field", [(k, f) for k, (_, m) in ROUTES.items() for f in m.model_fields])
def test_every_field_with_every_hostile_value_never_gets_a_500(live, kind, field):
    path, _ = ROUTES[kind]
    for i, value in enumerate(HOSTILE):  # every other one streamed (a field named "stream" takes the value itself)
        body = json.dumps({**BASE[kind], "stream": i % 2 == 1, field: value})  # NaN, Infinity as Python writes them
        check(live, live.post(path, content=body, headers={"content-type": "application/json"}))


def _json() -> st.SearchStrategy:
    leaves = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
    return st.recursive(leaves, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
                        max_leaves=8)


HOSTILE_VALUES = _json() | st.sampled_from(HOSTILE)
MESSAGE = st.fixed_dictionaries({
    "role": st.sampled_from(["user", "system", "assistant", "developer"]),
    "content": st.text(min_size=1, max_size=30) | st.lists(
        st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=10)}), min_size=1, max_size=3)})
# plausible values: in range, or the mistakes a client makes (a few land just outside a range)
COMMON = {
    "model": st.sampled_from([NAME, None, "gpt-4"]),
    "max_tokens": st.integers(1, 16) | st.none(),
    "temperature": st.floats(0, 2) | st.sampled_from([0, 1e-7, 2.5]),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 60),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "logit_bias": st.dictionaries(st.integers(0, 49_151).map(str), st.floats(-100, 100), max_size=6),
    "seed": st.integers(-(2**63), 2**63 - 1) | st.none(),
    "stop": st.text(min_size=1, max_size=4) | st.lists(st.text(min_size=1, max_size=4), max_size=4),
    "n": st.integers(1, 3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "ignore_eos": st.booleans(),
    "user": st.text(max_size=8),
}
FIELDS = {
    "chat": {**COMMON, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 20),
             "max_completion_tokens": st.integers(1, 16),
             "chat_template_kwargs": st.fixed_dictionaries({}, optional={"enable_thinking": st.booleans()}),
             "tools": st.just([]), "response_format": st.just({"type": "text"})},
    "text": {**COMMON, "logprobs": st.integers(0, 20) | st.none(), "echo": st.just(False), "suffix": st.just(""),
             "best_of": st.just(1)},
}
REQUIRED = {
    "chat": {"messages": st.lists(MESSAGE, min_size=1, max_size=3)},
    "text": {"prompt": st.text(min_size=1, max_size=40) | st.lists(st.text(min_size=1, max_size=10), min_size=1,
             max_size=3) | st.lists(st.integers(0, 49_151), min_size=1, max_size=12)
             | st.lists(st.lists(st.integers(0, 49_151), min_size=1, max_size=6), min_size=1, max_size=3)},
}


def _plausible(kind: str) -> st.SearchStrategy:
    return st.fixed_dictionaries(REQUIRED[kind], optional=FIELDS[kind])


def _one_hostile(kind: str) -> st.SearchStrategy:
    names = sorted({*REQUIRED[kind], *FIELDS[kind]})
    return st.tuples(_plausible(kind), st.sampled_from(names), HOSTILE_VALUES).map(lambda t: {**t[0], t[1]: t[2]})


REQUESTS = st.one_of(
    *[st.tuples(st.just(kind), body(kind).map(lambda b: json.dumps(b).encode()))  # NaN, Infinity as Python writes
      for kind in ("chat", "text") for body in (_plausible, _one_hostile)],
    st.tuples(st.sampled_from(["chat", "text"]), st.binary(max_size=40)),  # not JSON, or not an object
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(REQUESTS)
def test_fuzzed_bodies_never_get_a_500_and_the_server_stays_up(live, request_):
    kind, raw = request_
    check(live, live.post(ROUTES[kind][0], content=raw, headers={"content-type": "application/json"}))
