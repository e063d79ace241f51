"""The routes in process: log-probabilities in OpenAI's formats, streamed exactly as they are whole; a request
the engine fails on gets a 500 (a stream, an error event) while the others and the server go on; the request
bodies in the OpenAPI schema."""

from __future__ import annotations

import json
import threading

from .conftest import NAME


def _events(r) -> list:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ") and line[6:] != "[DONE]"]


def test_chat_logprobs_streamed_equal_the_whole_answer(live):
    body = {"model": NAME, "messages": [{"role": "user", "content": "Count: one two"}], "max_tokens": 12,
            "temperature": 0.8, "seed": 11, "logprobs": True, "top_logprobs": 4, "n": 2, "stop": ["e"]}
    whole = live.post("/v1/chat/completions", json=body).json()
    chunks = _events(live.post("/v1/chat/completions", json={**body, "stream": True}))
    for choice in whole["choices"]:
        i, content = choice["index"], choice["logprobs"]["content"]
        streamed = [e for c in chunks for ch in c["choices"] if ch["index"] == i and ch["logprobs"]
                    for e in ch["logprobs"]["content"]]
        assert streamed == content and content
        assert all(len(e["top_logprobs"]) == 4 and e["bytes"] == list(e["token"].encode()) for e in content)
        assert all(e["top_logprobs"][0]["logprob"] >= e["top_logprobs"][-1]["logprob"] for e in content)
        text = "".join(ch["delta"].get("content", "") for c in chunks for ch in c["choices"] if ch["index"] == i)
        assert text == choice["message"]["content"]
    assert whole["usage"]["completion_tokens"] == sum(len(c["logprobs"]["content"]) for c in whole["choices"])


def test_completion_logprobs_streamed_equal_the_whole_answer(live):
    body = {"model": NAME, "prompt": [[5, 6, 7], [8, 9]], "max_tokens": 10, "temperature": 0, "logprobs": 3,
            "logit_bias": {"100": 5}, "presence_penalty": 1.0}
    whole = live.post("/v1/completions", json=body).json()
    chunks = _events(live.post("/v1/completions", json={**body, "stream": True}))
    for choice in whole["choices"]:
        i, lp = choice["index"], choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 10
        assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:k]) for k in range(10)]
        assert all(t in top and 3 <= len(top) <= 4 for t, top in zip(lp["tokens"], lp["top_logprobs"]))
        parts = [ch["logprobs"] for c in chunks for ch in c["choices"] if ch["index"] == i and ch["logprobs"]]
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert [x for p in parts for x in p[key]] == lp[key], key


def test_a_request_the_engine_fails_on_gets_500_and_the_others_go_on(live):
    engine = live.app.state.serve.engine
    real = engine.session.prefill
    marker = [7, 7, 7, 7]

    def prefill(prompts, rows=None, **options):
        if marker in prompts:
            raise RuntimeError("out of memory")
        return real(prompts, rows, **options)

    engine.session.prefill = prefill
    try:
        good = {"model": NAME, "prompt": [11, 12, 13], "max_tokens": 8, "temperature": 0}
        alone = live.post("/v1/completions", json=good).json()["choices"][0]["text"]
        results = {}

        def call(name, body):
            results[name] = live.post("/v1/completions", json=body)

        threads = [threading.Thread(target=call, args=(f"good{i}", good)) for i in range(2)]
        threads += [threading.Thread(target=call, args=("bad", {**good, "prompt": marker})),
                    threading.Thread(target=call, args=("bad stream", {**good, "prompt": marker, "stream": True}))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        del engine.session.prefill  # the instance attribute: the method again
    bad = results["bad"]
    assert bad.status_code == 500 and bad.json()["error"]["code"] == "request_failed"
    assert "its prefill failed (RuntimeError: out of memory)" in bad.json()["error"]["message"]
    events = _events(results["bad stream"])
    assert results["bad stream"].status_code == 200 and events[-1]["error"]["code"] == "request_failed"
    assert all(results[f"good{i}"].json()["choices"][0]["text"] == alone for i in range(2))
    assert live.get("/health").json()["status"] == "ok"
    assert live.app.state.serve.worker.counters.finished["error"] >= 2
    assert 'beaconkv_requests_finished_total{finish_reason="error"}' in live.get("/metrics").text


def test_the_openapi_schema_documents_both_request_bodies(live):
    schema = live.get("/openapi.json").json()
    components = schema["components"]["schemas"]
    assert {"ChatCompletionRequest", "CompletionRequest", "ChatMessage"} <= set(components)
    assert "logit_bias" in components["ChatCompletionRequest"]["properties"]
    body = schema["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/CompletionRequest"}


def test_a_step_that_raises_anyway_fails_its_requests_and_the_engine_thread_goes_on(live):
    """The worker's second line: an exception escaping ``Engine.step`` (a bug outside any request) ends the
    running requests with an error, is counted and logged, and the thread serves the next call."""
    worker = live.app.state.serve.worker
    engine, faults = worker.engine, worker.faults
    real = engine.step
    calls = []

    def step():
        calls.append(1)
        if len(calls) == 3:  # the request is running by then
            raise RuntimeError("a bug in the engine's bookkeeping")
        return real()

    engine.step = step
    try:
        r = live.post("/v1/completions", json={"model": NAME, "prompt": [5, 6], "max_tokens": 12, "ignore_eos": True})
    finally:
        del engine.step
    assert r.status_code == 500 and "an engine step failed (RuntimeError: a bug" in r.json()["error"]["message"]
    assert worker.faults == faults + 1 and worker.alive and live.get("/health").json()["status"] == "ok"
    r = live.post("/v1/completions", json={"model": NAME, "prompt": [5, 6], "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
