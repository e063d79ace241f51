"""Running the application under uvicorn, with a Ctrl-C that stops the engine thread first.

uvicorn's graceful shutdown waits for every open response to finish, and a long generation may take
minutes. :class:`Server` therefore also asks the engine thread to stop when the first SIGINT or
SIGTERM arrives: the calls still waiting get an HTTP 503 (a stream gets an error event and
``[DONE]``), their connections close, and uvicorn exits at once. :func:`serve` runs it on a socket
the command line has already bound (so a busy port fails before the model loads).
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Sequence
from types import FrameType

import uvicorn

from ..engine import Engine
from ..tokenizer import Tokenizer
from .app import create_app
from .limits import DEFAULT_MAX_REQUEST_BYTES
from .worker import EngineWorker


class Server(uvicorn.Server):
    """uvicorn's server, which also stops the engine thread on the first signal and prints a banner when ready.

    Args:
        config: uvicorn's configuration (the app and its settings).
        worker: The engine thread to stop on a signal.
        banner: Printed on stderr once the socket accepts connections.
    """

    def __init__(self, config: uvicorn.Config, worker: EngineWorker, banner: str = "") -> None:
        super().__init__(config)
        self.worker, self.banner = worker, banner

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Signal handler: stop the engine thread (a flag only), then uvicorn's own shutdown."""
        self.worker.request_stop()
        super().handle_exit(sig, frame)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's startup, then the banner."""
        await super().startup(sockets=sockets)
        if self.started and self.banner:
            print(self.banner, file=sys.stderr, flush=True)


def serve(engine: Engine, tokenizer: Tokenizer, served_names: Sequence[str], sock: socket.socket, *,
          threads: int | None = None, log_level: str = "info", banner: str = "",
          max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> int:
    """Serves ``engine`` over HTTP on ``sock`` until a signal stops it.

    Args:
        engine: The engine (its thread is started here).
        tokenizer: The served model's tokenizer.
        served_names: The model names requests may ask for.
        sock: A bound TCP socket (see :func:`beaconkv.serve.cli.bind_socket`).
        threads: ``torch.set_num_threads`` of the engine thread.
        log_level: uvicorn's log level (``info`` logs every call).
        banner: Printed once the server accepts connections.
        max_request_bytes: Largest request body (larger ones get HTTP 413 before they are read).

    Returns:
        0, or 1 when the engine thread failed. A signal's own exit (KeyboardInterrupt for Ctrl-C) is
        raised once the server has shut down, as uvicorn re-raises the signal it caught.
    """
    worker = EngineWorker(engine, threads=threads)
    app = create_app(worker, tokenizer, served_names, max_request_bytes=max_request_bytes)
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5, lifespan="on")
    server = Server(config, worker, banner)
    try:
        server.run(sockets=[sock])
    finally:
        worker.stop()
        sock.close()
    return 1 if worker.error is not None else 0
