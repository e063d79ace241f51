"""``beaconkv serve --tensor-parallel-size 2``: rank 0 owns the HTTP server, the tokenizer and the engine, the
other rank mirrors its steps.

A tiny random Llama over the embedded tokenizer's vocabulary (4 query and 2 KV heads, one per rank; the
vocabulary split) answers a greedy chat completion with the single process's tokens: in process (the real
application over ``TensorParallelRun.engine``) and as the command (a subprocess on a free port), which stops
cleanly on one SIGINT with no rank left; a rank killed while the server waits stops the server with one
error naming it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

import beaconkv
from beaconkv.distributed import TensorParallelRun
from beaconkv.engine import Engine

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[2]
NAME = "tiny"
ENGINE = dict(max_batch=4, prompt_capacity=128, max_new_tokens=16, max_queue=32)
POLICY = ["--policy", "beacon", "--budget", "16", "--n-recent", "2", "--n-beacon", "3"]
BODY = {"model": NAME, "messages": [{"role": "user", "content": "Count: one two three four"}], "max_tokens": 16,
        "temperature": 0, "logprobs": True}


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Path:
    """A tiny random Llama checkpoint with the embedded tokenizer's files (what ``beaconkv serve`` loads)."""
    from tests.serve.conftest import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tp-served"), with_tokenizer=True)


def _policy():
    from beaconkv.arguments import policy_from_args
    from beaconkv.cli import build_parser

    return policy_from_args(build_parser().parse_args(["serve", *POLICY]))


def _answer(engine: Engine, tok) -> tuple[str, list[str]]:
    """One chat completion through the real application over ``engine``: its text and its tokens."""
    from beaconkv.serve.app import create_app
    from beaconkv.serve.worker import EngineWorker
    from tests.serve.conftest import LiveApp

    app = LiveApp(create_app(EngineWorker(engine, threads=1, idle_wait_s=0.05), tok, [NAME], poll_s=0.05))
    try:
        r = app.post("/v1/chat/completions", json=BODY)
    finally:
        app.close()
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["message"]["content"], [e["token"] for e in choice["logprobs"]["content"]]


@pytest.fixture(scope="module")
def single_answer(served):
    tok = beaconkv.load_tokenizer(served)
    text, tokens = _answer(Engine(beaconkv.load_model(served), tok, policy=_policy(), **ENGINE), tok)
    assert len(tokens) == 16  # long enough to evict (budget 16 past the prompt's prefix)
    return text, tokens


def test_the_application_over_two_ranks_answers_as_one_process(served, single_answer, monkeypatch):
    tok = beaconkv.load_tokenizer(served)
    with TensorParallelRun(served, 2, threads=1) as run:
        assert run.model.shard_plan.vocab_parallel
        assert _answer(run.engine(tok, policy=_policy(), **ENGINE), tok) == single_answer
    assert not any(p.is_alive() for p in run.processes.processes)
    assert not torch.distributed.is_initialized()


def _interruptible() -> None:
    """In the server's process before it starts: SIGINT as a terminal gives it. A pytest-xdist worker ignores
    SIGINT, a child inherits that, and Python then installs no KeyboardInterrupt handler (the server would exit 0
    on Ctrl-C instead of 130)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class _Server:
    """``beaconkv serve --tensor-parallel-size 2`` in a subprocess on a free port."""

    def __init__(self, checkpoint: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - lives as long as the server
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "beaconkv.cli", "serve", "--model", str(checkpoint), "--port", str(self.port),
             "--tensor-parallel-size", "2", "--threads", "1", "--max-batch", "4", "--prompt-capacity", "128",
             "--max-new-tokens", "16", "--served-model-name", NAME, "--log-level", "warning", *POLICY],
            cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
            text=True, preexec_fn=_interruptible)
        deadline = time.monotonic() + 120
        while True:
            assert self.proc.poll() is None, self.output()
            assert time.monotonic() < deadline, self.output()
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def rank(self) -> int:
        """The spawned rank's process id (rank 0's child that is not multiprocessing's resource tracker)."""
        children = [int(c) for t in os.listdir(f"/proc/{self.proc.pid}/task")
                    for c in Path(f"/proc/{self.proc.pid}/task/{t}/children").read_text().split()]
        ranks = [c for c in children if b"resource_tracker" not in Path(f"/proc/{c}/cmdline").read_bytes()]
        assert len(ranks) == 1, children
        return ranks[0]

    def wait(self, timeout: float = 60.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"the server did not stop within {timeout}s:\n{self.output()}")


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the spawned rank through /proc")
def test_the_command_answers_as_one_process_and_stops_on_one_sigint(served, single_answer):
    server = _Server(served)
    try:
        rank = server.rank()
        r = httpx.post(f"http://127.0.0.1:{server.port}/v1/chat/completions", json=BODY, timeout=60)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert (choice["message"]["content"], [e["token"] for e in choice["logprobs"]["content"]]) == single_answer
        server.proc.send_signal(signal.SIGINT)
        assert server.wait() == 130, server.output()
        assert "tensor parallel 2: rank 0/2: KV heads 0..0 (1 of 2)" in server.output()
        assert not Path(f"/proc/{rank}").exists() or "Z" in Path(f"/proc/{rank}/stat").read_text().split()[2]
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the spawned rank through /proc")
def test_a_rank_killed_while_the_server_waits_stops_it_with_one_error(served):
    server = _Server(served)
    try:
        os.kill(server.rank(), signal.SIGKILL)
        t0 = time.monotonic()
        assert server.wait() == 2, server.output()
        assert time.monotonic() - t0 < 30
        errors = [line for line in server.output().splitlines() if "error" in line.lower()]
        assert errors == ["beaconkv serve: error: tensor parallelism stopped: rank 1 died of SIGKILL (killed, or out "
                          "of memory)"], server.output()
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


def test_compile_and_the_hf_backend_are_refused(served, capsys):
    from beaconkv.cli import main

    for extra, message in ((["--compile"], "--compile is not supported with --tensor-parallel-size"),
                           (["--backend", "hf"], "--tensor-parallel-size needs --backend native")):
        assert main(["serve", "--model", str(served), "--port", "0", "--prompt-capacity", "128",
                     "--max-new-tokens", "16", "--tensor-parallel-size", "2", *extra]) == 2
        assert message in capsys.readouterr().err
    assert not torch.distributed.is_initialized()
