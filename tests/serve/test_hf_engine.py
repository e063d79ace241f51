"""``beaconkv serve --backend hf``: the server's engine over a transformers model whose cache is a PolicyCache.

A greedy request's tokens equal ``model.generate`` with a ``PolicyCache`` of the same policy (alone or beside
another request, through the engine or a chat completion over HTTP, streamed or whole); sampling follows the
request's seed; stop strings, cancellation and a request's own failure behave as with the native engine; the
command serves a checkpoint in transformers and refuses the native decoder's options in one line.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import beaconkv
from beaconkv.engine import EngineError, Request
from beaconkv.policies import make_policy
from beaconkv.sampling import SamplingParams

from .conftest import NAME, LiveApp

tf = pytest.importorskip("transformers")

from beaconkv.hf.generation import generate_hf, load_hf_model  # noqa: E402
from beaconkv.serve.hf_engine import HFEngine  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "The quick brown fox jumps over the lazy dog. " * 6


def policy():
    return make_policy("beacon", budget=16, n_recent=2, n_beacon=3)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny random Qwen3 over the embedded tokenizer's vocabulary, saved with the tokenizer's files."""
    tok = beaconkv.load_tokenizer(beaconkv.embedded_model_path())
    directory = tmp_path_factory.mktemp("tiny-hf-served")
    torch.manual_seed(0)
    config = tf.Qwen3Config(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=1024,
                            bos_token_id=1, eos_token_id=2, tie_word_embeddings=True, initializer_range=0.5)
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(directory, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(Path(beaconkv.embedded_model_path()) / name, directory / name)
    return directory


@pytest.fixture(scope="module")
def loaded(checkpoint):
    return load_hf_model(str(checkpoint)), beaconkv.load_tokenizer(checkpoint)


def engine(model, tok, **kw) -> HFEngine:
    return HFEngine(model, tok, **{**dict(policy=policy(), max_batch=2, prompt_capacity=128, max_new_tokens=24), **kw})


def run(eng: HFEngine, requests) -> list:
    ids = [eng.submit(r) for r in requests]
    done = {}
    while not eng.idle:
        for event in eng.step():
            if event.completion is not None:
                done[event.request_id] = event.completion
    return [done[i] for i in ids]


def test_greedy_requests_side_by_side_equal_model_generate_with_a_policy_cache(loaded):
    model, tok = loaded
    prompts = [tok.encode(PROMPT), tok.encode("One, two, three, four, five, six, seven, eight, nine")]
    got = run(engine(model, tok), [Request(p, max_new_tokens=24, eos_token_ids=[]) for p in prompts])
    for prompt, completion in zip(prompts, got):
        ref = generate_hf(model, None, [prompt], policy=policy(), max_new_tokens=24, eos_token_ids=[])
        assert completion.token_ids == ref.token_ids[0] and len(completion.token_ids) == 24
        assert completion.evictions == ref.stats.evictions[0]
        assert completion.text == tok.decode(completion.token_ids) and completion.finish_reason == "length"
    assert got[0].evictions > 0  # the long prompt was evicted while it decoded


def test_sampling_follows_the_seed_and_reports_logprobs(loaded):
    model, tok = loaded
    sampled = SamplingParams(temperature=1.0, top_k=50, logprobs=2)
    ask = [Request(tok.encode(PROMPT), max_new_tokens=12, sampling=sampled, seed=s, eos_token_ids=[])
           for s in (3, 3, 4)]
    a, b, c = run(engine(model, tok, max_batch=3), ask)
    assert a.token_ids == b.token_ids != c.token_ids
    assert [lp.token_id for lp in a.logprobs] == a.token_ids and all(len(lp.top) == 2 for lp in a.logprobs)


def test_stop_strings_cancellation_and_refusals(loaded):
    model, tok = loaded
    eng = engine(model, tok)
    [whole] = run(eng, [Request(tok.encode(PROMPT), max_new_tokens=24, eos_token_ids=[])])
    stop = whole.text[len(whole.text) // 2:][:3]
    [cut] = run(eng, [Request(tok.encode(PROMPT), max_new_tokens=24, eos_token_ids=[], stop=[stop])])
    assert cut.finish_reason == "stop" and cut.text == whole.text[: whole.text.find(stop)]
    rid = eng.submit(Request(tok.encode(PROMPT), max_new_tokens=24, eos_token_ids=[]))
    eng.step()
    eng.cancel(rid)
    [event] = eng.step()
    assert event.completion.finish_reason == "cancelled" and eng.idle
    with pytest.raises(EngineError, match="prompt capacity"):
        eng.submit(Request(list(range(1, 200))))
    with pytest.raises(EngineError, match="max_position_embeddings"):
        HFEngine(model, tok, prompt_capacity=1000, max_new_tokens=100)


def test_a_request_that_fails_ends_alone(loaded):
    model, tok = loaded
    eng = engine(model, tok)

    def broken(event):
        raise RuntimeError("the client's callback broke")

    bad = Request(tok.encode("one two"), max_new_tokens=4, eos_token_ids=[], on_event=broken)
    good = Request(tok.encode("one two"), max_new_tokens=4, eos_token_ids=[])
    failed, fine = run(eng, [bad, good])
    assert failed.finish_reason == "error" and "callback broke" in failed.error
    assert fine.finish_reason == "length" and len(fine.token_ids) == 4


def test_a_chat_completion_over_http_equals_model_generate_streamed_or_whole(loaded):
    from beaconkv.serve.app import create_app
    from beaconkv.serve.worker import EngineWorker

    model, tok = loaded
    live = LiveApp(create_app(EngineWorker(engine(model, tok), threads=1, idle_wait_s=0.05), tok, [NAME],
                              poll_s=0.05))
    try:
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        body = {"model": NAME, "messages": messages, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        whole = live.post("/v1/chat/completions", json=body).json()
        stream = live.post("/v1/chat/completions", json={**body, "stream": True})
    finally:
        live.close()
    ids = tok.encode_prompt(tok.apply_chat_template(messages))
    ref = generate_hf(model, None, [ids], policy=policy(), max_new_tokens=16, eos_token_ids=[])
    assert whole["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 16, "total_tokens": len(ids) + 16}
    assert whole["choices"][0]["message"]["content"] == tok.decode(ref.token_ids[0])
    chunks = [json.loads(line[6:]) for line in stream.text.splitlines()
              if line.startswith("data: ") and line[6:] != "[DONE]"]
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert streamed == whole["choices"][0]["message"]["content"] and len(chunks) > 3


def test_the_command_refuses_native_options_in_one_line(capsys, checkpoint):
    from beaconkv.cli import main

    for option in (["--compile"], ["--kv-storage", "int8"], ["--kernels", "packed"]):
        assert main(["serve", "--backend", "hf", "--model", str(checkpoint), *option]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--backend hf" in err[0] and option[0] in err[0]


def test_the_command_serves_a_checkpoint_in_transformers(checkpoint):
    httpx = pytest.importorskip("httpx")
    from beaconkv.serve.cli import bind_socket

    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()
    proc = subprocess.Popen([sys.executable, "-m", "beaconkv.cli", "serve", "--backend", "hf", "--model",
                             str(checkpoint), "--port", str(port), "--policy", "beacon", "--budget", "16",
                             "--n-recent", "2", "--threads", "1", "--max-new-tokens", "16", "--prompt-capacity",
                             "128", "--served-model-name", NAME, "--log-level", "warning"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60,
                       json={"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                             "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    assert "in transformers" in out or "transformers Qwen3ForCausalLM" in out
