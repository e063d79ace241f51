"""Re-runs the attacker's and new user's probes of issue #21 against this checkout and prints each outcome.

Starts ``beaconkv serve`` (embedded model, CPU) on a free local port, sends it the requests that once stopped or
stalled it, and loads deliberately broken copies of the embedded checkpoint. One line per probe: the HTTP status
or the exception, how long it took, and whether ``/health`` still answered. Nothing here is asserted: the same
behaviour is checked by the tests (``tests/serve/test_limits.py``, ``tests/serve/test_fuzz.py``,
``tests/models/test_loading.py``, ``tests/models/test_loading_fuzz.py``); this prints the figures.

    python scripts/hardening_probes.py
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import beaconkv


def free_port() -> int:
    """A TCP port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``beaconkv serve`` in a child process, and small HTTP helpers against it."""

    def __init__(self, port: int) -> None:
        self.port = port
        exe = Path(sys.executable).with_name("beaconkv")
        self.proc = subprocess.Popen([str(exe), "serve", "--port", str(port), "--threads", "1"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(480):
            if self.health()[0] == 200:
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"beaconkv serve exited with {self.proc.returncode} before answering /health")
            time.sleep(0.25)
        raise RuntimeError("beaconkv serve did not answer /health within 120 s")

    def request(self, method: str, path: str, body: bytes | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any], float]:
        """``(status, JSON body, seconds)`` of one request."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
        t0 = time.perf_counter()
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        data = response.read()
        conn.close()
        return response.status, json.loads(data or b"{}"), time.perf_counter() - t0

    def post(self, path: str, payload: dict[str, Any]) -> tuple[int, dict[str, Any], float]:
        """POSTs ``payload`` as JSON."""
        return self.request("POST", path, json.dumps(payload).encode())

    def health(self) -> tuple[int | str, float]:
        """``(status or error, seconds)`` of ``GET /health``."""
        t0 = time.perf_counter()
        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
            conn.request("GET", "/health")
            status = conn.getresponse().status
            conn.close()
            return status, time.perf_counter() - t0
        except OSError as err:
            return type(err).__name__, time.perf_counter() - t0

    def rss_gib(self) -> float:
        """The server process's resident memory, GiB (Linux)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 2**20
        return float("nan")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait()


def error_line(name: str, server: Server, result: tuple[int, dict[str, Any], float]) -> str:
    """A probe's status, time, error message and the health that followed."""
    status, body, seconds = result
    message = body.get("error", {}).get("message", "")
    return f"{name}: HTTP {status} in {seconds:.2f} s {message[:160]!r}; then /health {server.health()[0]}"


def while_polling(server: Server, work: Callable[[], Any]) -> tuple[Any, list[tuple[int | str, float]]]:
    """Runs ``work`` while another thread polls ``/health`` every 0.2 s; returns its result and the polls."""
    polls: list[tuple[int | str, float]] = []
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            polls.append(server.health())
            time.sleep(0.2)

    thread = threading.Thread(target=poll)
    thread.start()
    try:
        result = work()
    finally:
        done.set()
        thread.join()
    return result, polls


def probe_server() -> None:
    """The request probes (fault isolation, bounded work, OpenAI fields)."""
    server = Server(free_port())
    try:
        messages = [{"role": "user", "content": "What is 2+3? Answer briefly."}]

        def chat(**fields: Any) -> tuple[int, dict[str, Any], float]:
            return server.post("/v1/chat/completions", {"model": "embedded", "messages": messages, "max_tokens": 12,
                                                        "temperature": 0, **fields})

        for name, fields in (("temperature=1e39", {"temperature": 1e39}), ("temperature=1e308", {"temperature": 1e308}),
                             ("top_k=2**63", {"top_k": 2**63}), ("presence_penalty=3", {"presence_penalty": 3})):
            print(error_line(name, server, chat(**fields)))
        print(error_line("model='gpt-4' (not served)", server,
                         server.post("/v1/chat/completions", {"model": "gpt-4", "messages": messages})))

        size = 50_000_000  # the body is announced, not sent: the server must answer from the header alone
        before = server.rss_gib()
        status, body, seconds = server.request("POST", "/v1/chat/completions", body=b"",
                                               headers={"Content-Length": str(size)})
        print(f"a {size / 1e6:.0f} MB body: HTTP {status} in {seconds:.2f} s "
              f"{body.get('error', {}).get('message', '')[:100]!r}; RSS {before:.2f} -> {server.rss_gib():.2f} GiB")
        text = "a " * 1_900_000  # under the body limit, far over the prompt capacity
        before = server.rss_gib()
        (status, body, seconds), polls = while_polling(server, lambda: server.post(
            "/v1/chat/completions", {"model": "embedded", "messages": [{"role": "user", "content": text}]}))
        print(f"a {len(text) / 1e6:.1f} M-character prompt: HTTP {status} in {seconds:.2f} s "
              f"{body.get('error', {}).get('message', '')[:100]!r}; /health meanwhile {sorted({p[0] for p in polls})}, "
              f"slowest {max(p[1] for p in polls):.3f} s; RSS {before:.2f} -> {server.rss_gib():.2f} GiB")

        greedy = chat()[1]["choices"][0]["message"]["content"]
        tokenizer = beaconkv.load_tokenizer(beaconkv.embedded_model_path())
        banned = sorted(set(tokenizer.encode(greedy)))
        biased = chat(logit_bias={str(t): -100 for t in banned})[1]["choices"][0]["message"]["content"]
        print(f"logit_bias -100 on the {len(banned)} tokens of the greedy answer {greedy!r}: {biased!r} "
              f"(banned tokens in it: {sorted(set(tokenizer.encode(biased)) & set(banned))})")
        everything = chat(logit_bias={str(t): -100 for t in range(tokenizer.vocab_size)})[1]["choices"][0]["message"]
        print(f"logit_bias -100 on every token (no token moves against another): {everything['content']!r}")
        prompt = {"model": "embedded", "prompt": "cat cat cat cat cat cat cat cat", "max_tokens": 16, "temperature": 0}
        plain = server.post("/v1/completions", prompt)[1]["choices"][0]["text"]
        for field in ("presence_penalty", "frequency_penalty"):
            penalised = server.post("/v1/completions", {**prompt, field: 2.0})[1]["choices"][0]["text"]
            print(f"{field}=2 on a repetitive prompt: {penalised[:60]!r} (without: {plain[:60]!r})")
        logprobs = chat(logprobs=True, top_logprobs=3)[1]["choices"][0]["logprobs"]["content"][0]
        print(f"logprobs, top_logprobs=3: first token {logprobs['token']!r} {logprobs['logprob']:.3f}, alternatives "
              f"{[(e['token'], round(e['logprob'], 3)) for e in logprobs['top_logprobs']]}")
        print(f"server still running: {server.proc.poll() is None}, /health {server.health()[0]}")
    finally:
        server.close()


def probe_loading() -> None:
    """The checkpoint probes: broken copies of the embedded model, each loaded once."""
    source = Path(beaconkv.embedded_model_path())

    def copy() -> Path:
        folder = Path(tempfile.mkdtemp(prefix="beaconkv-probe-"))
        for f in source.iterdir():
            shutil.copy(f, folder / f.name)
        return folder

    def attempt(name: str, folder: Path, load: Callable[[Path], Any] = beaconkv.load_model) -> None:
        t0 = time.perf_counter()
        try:
            load(folder)
            outcome = "loaded"
        except Exception as err:  # noqa: BLE001 - the probe reports whatever was raised
            outcome = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
        print(f"{name}: {time.perf_counter() - t0:.2f} s -> {outcome}")
        shutil.rmtree(folder)

    def with_config(**fields: Any) -> Path:
        folder = copy()
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **fields}))
        return folder

    for name, value in (("num_hidden_layers", 1_000_000_000), ("head_dim", -64), ("num_attention_heads", "9"),
                        ("vocab_size", 10**12)):
        attempt(f"config.json {name}={value!r}", with_config(**{name: value}))
    folder = copy()
    weights = folder / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    name = next(k for k in header if k.endswith("q_proj.weight"))
    header[name]["dtype"] = "I32"  # same byte size as F32: only the header's word says what the bytes are
    text = json.dumps(header, separators=(",", ":")).encode()
    raw[8:8 + n] = text + b" " * (n - len(text))
    weights.write_bytes(raw)
    attempt(f"safetensors header: {name} F32 -> I32", folder)
    folder = copy()
    (folder / "tokenizer.json").write_bytes(b"\xff\xfe not json \x00")
    attempt("a garbage tokenizer.json", folder, beaconkv.load_tokenizer)


def main() -> None:
    print(f"beaconkv {beaconkv.__version__}, {os.cpu_count()} CPUs")
    probe_server()
    probe_loading()


if __name__ == "__main__":
    main()
