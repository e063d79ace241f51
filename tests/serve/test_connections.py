"""Slow and numerous connections, against uvicorn with the guarded protocol on a real socket: half-open sockets
beyond the cap push out their own oldest and never keep ``/health`` from answering; a request head late by the
header timeout (a fresh connection's, or one trickled on a keep-alive connection) closes its connection; a
connection over the cap while every other one is being served gets 503 with ``Retry-After``; a body slower than
the body timeout gets 408 and its connection closes; a client that leaves while its chat template renders stops
the render; ``/health`` says ``degraded`` while every prepare thread is stuck on a render."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time

import pytest

from beaconkv.serve.limits import ConnectionLimits, RequestLimits

from .conftest import NAME, ThreadServer, closed_by_server, httpx, make_engine, slow_tokenizer

PARTIAL_HEAD = b"GET /health HTTP/1.1\r\nHost: localhost\r\n"  # no blank line: the head never ends


def _response(sock: socket.socket, timeout: float = 5.0) -> bytes:
    """One whole HTTP response (head and ``Content-Length`` body) read from ``sock``."""
    sock.settimeout(timeout)
    data = b""
    while True:
        head, sep, body = data.partition(b"\r\n\r\n")
        length = re.search(rb"content-length: *(\d+)", head.lower())
        if sep and length and len(body) >= int(length.group(1)):
            return data
        part = sock.recv(65536)
        if not part:
            return data
        data += part


def _health(url: str) -> tuple[int, float]:
    t0 = time.perf_counter()
    with httpx.Client(base_url=url, timeout=10) as c:
        return c.get("/health").status_code, time.perf_counter() - t0


@pytest.fixture(scope="module")
def guarded(tiny_served):
    """The real app over the tiny model behind uvicorn: 64 connections at most, heads within 1 s, bodies within 1 s."""
    from beaconkv.serve.app import create_app
    from beaconkv.serve.worker import EngineWorker

    model, tok = tiny_served
    app = create_app(EngineWorker(make_engine(model, tok), threads=1, idle_wait_s=0.05), tok, [NAME], poll_s=0.05,
                     limits=RequestLimits(body_timeout_s=1.0))
    server = ThreadServer(app, ConnectionLimits(max_connections=64, header_timeout_s=1.0, keep_alive_s=5.0))
    try:
        yield server
    finally:
        server.close()


def test_half_open_sockets_beyond_the_cap_never_keep_health_from_answering(guarded):
    registry = guarded.registry
    evicted, timed_out = registry.evicted, registry.timed_out
    socks = []
    try:
        for _ in range(100):  # a slow-loris: heads that never end
            s = socket.create_connection(("127.0.0.1", guarded.port))
            s.sendall(PARTIAL_HEAD)
            socks.append(s)
        status, seconds = _health(guarded.url)
        assert status == 200 and seconds < 5.0, (status, seconds)
        assert registry.evicted - evicted >= 100 - 64  # the flood pushed out its own oldest sockets
        assert len(registry.open) <= 64
        # every one of them is closed: pushed out, or its head timed out (1 s)
        assert all(closed_by_server(s, 5.0) for s in socks)
        assert registry.evicted - evicted + registry.timed_out - timed_out >= 100
    finally:
        for s in socks:
            s.close()
    assert _health(guarded.url)[0] == 200


def test_a_head_trickled_on_a_keep_alive_connection_times_out(guarded):
    """uvicorn's keep-alive timer restarts with every byte; the head timeout counts from the end of the answer."""
    with socket.create_connection(("127.0.0.1", guarded.port)) as s:
        s.sendall(PARTIAL_HEAD + b"\r\n")
        assert _response(s).startswith(b"HTTP/1.1 200 ")
        t0 = time.monotonic()
        closed = False
        for _ in range(50):  # one byte every 0.2 s, for up to 10 s
            try:
                s.sendall(b"G")
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            s.settimeout(0.2)
            try:
                if s.recv(1) == b"":
                    closed = True
                    break
            except TimeoutError:
                pass
            except ConnectionResetError:
                closed = True
                break
        assert closed and 0.8 < time.monotonic() - t0 < 5.0, time.monotonic() - t0


def test_a_body_slower_than_the_body_timeout_gets_408_and_the_connection_closes(guarded):
    with socket.create_connection(("127.0.0.1", guarded.port)) as s:
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % (2**20))
        s.sendall(head + b"x" * (2**20 - 1))  # one byte short, and it never comes
        t0 = time.monotonic()
        data = _response(s)
        elapsed = time.monotonic() - t0
        assert data.startswith(b"HTTP/1.1 408 ") and b"connection: close" in data.lower(), data[:300]
        body = json.loads(data.split(b"\r\n\r\n", 1)[1])
        assert body["error"]["code"] == "request_timeout" and "--body-timeout" in body["error"]["message"]
        assert f"{2**20 - 1} of {2**20} bytes" in body["error"]["message"]
        assert 0.8 < elapsed < 5.0, elapsed
        assert closed_by_server(s, 2.0)
    with httpx.Client(base_url=guarded.url) as c:
        counters = c.get("/metrics").text
    assert 'beaconkv_requests_refused_total{reason="body_timeout"} 1' in counters


class _Gate:
    """A minimal ASGI app: ``/hold`` answers once released, anything else at once."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.holding = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    return
        if scope["path"] == "/hold":
            self.holding += 1
            while not self.release.is_set():
                await asyncio.sleep(0.01)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})


def test_a_connection_over_the_cap_while_every_other_is_served_gets_503():
    gate = _Gate()
    server = ThreadServer(gate, ConnectionLimits(max_connections=4, header_timeout_s=2.0))
    held = []
    try:
        for _ in range(4):
            s = socket.create_connection(("127.0.0.1", server.port))
            s.sendall(b"GET /hold HTTP/1.1\r\nHost: localhost\r\n\r\n")
            held.append(s)
        deadline = time.monotonic() + 5
        while gate.holding < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert gate.holding == 4
        with httpx.Client(base_url=server.url, timeout=5) as c:
            r = c.get("/")
        assert r.status_code == 503 and r.headers["retry-after"] == "1" and r.headers["connection"] == "close"
        error = r.json()["error"]
        assert error["code"] == "too_many_connections" and "--max-connections" in error["message"], error
        assert server.registry.refused == 1 and server.registry.evicted == 0  # no call being served was cut
        gate.release.set()
        for s in held:
            assert _response(s).startswith(b"HTTP/1.1 200 ")
        with httpx.Client(base_url=server.url, timeout=5) as c:
            assert c.get("/").status_code == 200
    finally:
        gate.release.set()
        for s in held:
            s.close()
        server.close()


@pytest.fixture(scope="module")
def slow(tiny_served):
    """The real app over a chat template that never finishes, behind uvicorn; renders may take 30 s."""
    from beaconkv.serve.app import create_app
    from beaconkv.serve.worker import EngineWorker

    model, _ = tiny_served
    tok = slow_tokenizer()
    app = create_app(EngineWorker(make_engine(model, tok), threads=1, idle_wait_s=0.05), tok, [NAME], poll_s=0.05,
                     limits=RequestLimits(template_timeout_s=30.0))
    server = ThreadServer(app)
    server.state = app.state.serve
    try:
        yield server
    finally:
        server.close()


CHAT = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _chat_gives_up_after(url: str, seconds: float) -> None:
    with pytest.raises(httpx.TimeoutException):
        httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=seconds)


def _wait(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_a_client_that_leaves_stops_its_render(slow):
    pool = slow.state.pool
    _chat_gives_up_after(slow.url, 0.5)
    assert _wait(lambda: pool.saturation()[0] == 0, timeout=3.0), pool.saturation()  # the render was stopped
    with httpx.Client(base_url=slow.url, timeout=10) as c:
        assert c.get("/health").json()["status"] == "ok"
        r = c.post("/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 2})  # the threads serve on
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_health_says_degraded_while_renders_hold_every_prepare_thread(slow):
    pool = slow.state.pool
    leavers = [threading.Thread(target=_chat_gives_up_after, args=(slow.url, 2.5)) for _ in range(pool.threads)]
    for t in leavers:
        t.start()
    try:
        assert _wait(lambda: pool.saturation()[0] == pool.threads, timeout=3.0)
        time.sleep(1.1)  # stuck for over a second
        with httpx.Client(base_url=slow.url, timeout=5) as c:
            r = c.get("/health")
        assert r.status_code == 503, r.text
        health = r.json()
        assert health["status"] == "degraded" and health["preparing"] == pool.threads
        assert f"all {pool.threads} prepare threads" in health["reason"] and "--template-timeout" in health["reason"]
    finally:
        for t in leavers:
            t.join(10)
    assert _wait(lambda: pool.saturation()[0] == 0, timeout=3.0)  # they left: their renders stopped
    assert _health(slow.url)[0] == 200
