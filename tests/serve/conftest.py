"""The in-process server of the ``tests/serve`` tests: the real app and a real engine on a tiny random model.

The model is a tiny random Llama with the embedded model's vocabulary, so that it takes the embedded
tokenizer (its chat template, special tokens and byte-level BPE) — every request is real text end to
end, at a cost of milliseconds. :class:`LiveApp` runs the application's lifespan (the engine
thread) on an event loop of its own thread and sends requests through ``httpx.ASGITransport``;
:class:`ThreadServer` serves an app with uvicorn (and the guarded protocol) on a free local port, in a
thread, for the tests that need real sockets.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import beaconkv
from beaconkv.engine import Engine
from beaconkv.policies import make_policy

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

NAME = "tiny"
"""The served model name."""
PROMPT_CAPACITY = 128
MAX_NEW = 16


def write_tiny_llama(directory: Path, with_tokenizer: bool = False) -> Path:
    """Writes a tiny random Llama checkpoint over the embedded tokenizer's 49,152-token vocabulary (seed 0)
    into ``directory``; ``with_tokenizer`` copies the tokenizer's files too (what ``beaconkv serve`` loads)."""
    import transformers as tf

    embedded = Path(beaconkv.embedded_model_path())
    tok = beaconkv.load_tokenizer(embedded)
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                            bos_token_id=1, eos_token_id=2, tie_word_embeddings=True, initializer_range=0.5)
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(directory, safe_serialization=True)
    if with_tokenizer:
        for f in embedded.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens")):
                shutil.copy(f, directory / f.name)
    return directory


@pytest.fixture(scope="session")
def tiny_served(tmp_path_factory) -> tuple[beaconkv.CausalLM, beaconkv.Tokenizer]:
    """The :func:`write_tiny_llama` checkpoint, loaded: (model, tokenizer)."""
    directory = write_tiny_llama(tmp_path_factory.mktemp("tiny-served"))
    return beaconkv.load_model(directory), beaconkv.load_tokenizer(beaconkv.embedded_model_path())


def make_engine(model, tok, **kw) -> Engine:
    """A small pool that evicts: 4 slots, prompts up to 128 tokens, up to 16 new, BeaconKV keeping 16."""
    settings = dict(policy=make_policy("beacon", budget=16, n_recent=2, n_beacon=3), max_batch=4,
                    prompt_capacity=PROMPT_CAPACITY, max_new_tokens=MAX_NEW, max_queue=32, kernels="model")
    return Engine(model, tok, **{**settings, **kw})


class LiveApp:
    """An application with its lifespan running on an event loop in a thread of its own.

    Args:
        app: The application (:func:`beaconkv.serve.app.create_app`).
    """

    def __init__(self, app) -> None:
        self.app = app
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="live-app", daemon=True)
        self.thread.start()
        self._lifespan = app.router.lifespan_context(app)
        self.call(self._lifespan.__aenter__())
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost", timeout=60)

    def call(self, coro, timeout: float = 60.0):
        """Runs a coroutine on the app's loop and returns its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def post(self, path: str, **kw) -> httpx.Response:
        """``POST`` through the app."""
        return self.call(self.client.post(path, **kw))

    def get(self, path: str, **kw) -> httpx.Response:
        """``GET`` through the app."""
        return self.call(self.client.get(path, **kw))

    def close(self) -> None:
        """Ends the lifespan (stops the engine thread) and the loop."""
        try:
            self.call(self.client.aclose())
            self.call(self._lifespan.__aexit__(None, None, None))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


def live_app(model, tok, *, engine_kw=None, **app_kw) -> LiveApp:
    """A :class:`LiveApp` over a fresh :func:`make_engine` pool (one engine thread, one torch thread)."""
    from beaconkv.serve.app import create_app
    from beaconkv.serve.worker import EngineWorker

    worker = EngineWorker(make_engine(model, tok, **(engine_kw or {})), threads=1, idle_wait_s=0.05)
    return LiveApp(create_app(worker, tok, [NAME], poll_s=0.05, **app_kw))


@pytest.fixture(scope="module")
def live(tiny_served) -> Iterator[LiveApp]:
    """One running app for a module's tests."""
    app = live_app(*tiny_served)
    try:
        yield app
    finally:
        app.close()


SLOW_TEMPLATE = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}never"
"""A chat template that renders for hours (10**10 empty loop turns), in pure Python."""


def slow_tokenizer() -> beaconkv.Tokenizer:
    """The embedded tokenizer with :data:`SLOW_TEMPLATE` as its chat template."""
    tok = beaconkv.load_tokenizer(beaconkv.embedded_model_path())
    tok.chat_template = SLOW_TEMPLATE
    return tok


class ThreadServer:
    """uvicorn serving ``app`` on a free port of 127.0.0.1, in a thread, with the guarded protocol.

    Args:
        app: An ASGI application (its lifespan runs).
        connections: The connection limits (:class:`~beaconkv.serve.limits.ConnectionLimits`).
    """

    def __init__(self, app, connections=None) -> None:
        import uvicorn

        from beaconkv.serve.cli import bind_socket
        from beaconkv.serve.connections import guarded_protocol
        from beaconkv.serve.limits import ConnectionLimits

        connections = connections or ConnectionLimits()
        self.protocol = guarded_protocol(connections)
        self.sock = bind_socket("127.0.0.1", 0)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="on", http=self.protocol, ws="none",
                                timeout_keep_alive=connections.keep_alive_s, timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, name="uvicorn",
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)

    @property
    def registry(self):
        """The server's open connections and what it closed."""
        return self.protocol.registry

    def close(self) -> None:
        """Stops uvicorn (and the app's lifespan)."""
        self.server.should_exit = True
        self.thread.join(20)
        self.sock.close()


def closed_by_server(sock: socket.socket, timeout: float) -> bool:
    """Whether the server closes ``sock`` within ``timeout`` seconds (reads end, or the connection resets)."""
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
