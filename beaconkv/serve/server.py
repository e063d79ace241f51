"""Running the application under uvicorn, with a Ctrl-C that stops the engine thread and the prepare threads first.

uvicorn's graceful shutdown waits for every open response to finish, and a long generation may take
minutes. :class:`Server` therefore also asks the engine thread to stop when the first SIGINT or
SIGTERM arrives, and stops every call still being prepared (a slow chat template's render is interrupted): the
calls still waiting get an HTTP 503 (a stream gets an error event and ``[DONE]``), their connections close,
and uvicorn exits at once — one Ctrl-C is enough. :func:`serve` runs it on a socket the command line has
already bound (so a busy port fails before the model loads), with uvicorn's h11 protocol guarded against
slow and numerous connections (:mod:`beaconkv.serve.connections`).
"""

from __future__ import annotations

import asyncio
import socket
import sys
from collections.abc import Callable, Sequence
from types import FrameType

import uvicorn

from ..engine import Engine
from ..tokenizer import Tokenizer
from .app import create_app
from .browsers import LOCAL_HOSTS
from .connections import guarded_protocol
from .limits import ConnectionLimits, RequestLimits
from .worker import EngineWorker


class Server(uvicorn.Server):
    """uvicorn's server, which also stops the engine thread (and the work ``on_exit`` stops) on the first signal,
    and prints a banner when ready.

    Args:
        config: uvicorn's configuration (the app and its settings).
        worker: The engine thread to stop on a signal.
        banner: Printed on stderr once the socket accepts connections.
        on_exit: Run on the event loop after the first signal (stops the calls being prepared).
    """

    def __init__(self, config: uvicorn.Config, worker: EngineWorker, banner: str = "",
                 on_exit: Callable[[], None] | None = None) -> None:
        super().__init__(config)
        self.worker, self.banner, self.on_exit = worker, banner, on_exit
        self._loop: asyncio.AbstractEventLoop | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Signal handler: stop the engine thread (a flag only), schedule ``on_exit`` on the event loop (a signal
        handler may not take the locks it takes), then uvicorn's own shutdown."""
        self.worker.request_stop()
        if self.on_exit is not None and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.on_exit)
        super().handle_exit(sig, frame)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's startup, then the banner."""
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)
        if self.started and self.banner:
            print(self.banner, file=sys.stderr, flush=True)


def serve(engine: Engine, tokenizer: Tokenizer, served_names: Sequence[str], sock: socket.socket, *,
          threads: int | None = None, log_level: str = "info", banner: str = "",
          limits: RequestLimits | None = None, connections: ConnectionLimits | None = None,
          allowed_hosts: Sequence[str] | None = LOCAL_HOSTS, special_tokens: str | None = "escape") -> int:
    """Serves ``engine`` over HTTP on ``sock`` until a signal stops it.

    Args:
        engine: The engine (its thread is started here).
        tokenizer: The served model's tokenizer.
        served_names: The model names requests may ask for.
        sock: A bound TCP socket (see :func:`beaconkv.serve.cli.bind_socket`).
        threads: ``torch.set_num_threads`` of the engine thread.
        log_level: uvicorn's log level (``info`` logs every call).
        banner: Printed once the server accepts connections.
        limits: What one request may cost (see :class:`~beaconkv.serve.limits.RequestLimits`).
        connections: The connection cap and timeouts (see :class:`~beaconkv.serve.limits.ConnectionLimits`).
        allowed_hosts: The ``Host`` names requests may use (``["*"]``: any).
        special_tokens: ``"escape"`` or ``"refuse"`` special-token text in chat messages.

    Returns:
        0, or 1 when the engine thread failed. A signal's own exit (KeyboardInterrupt for Ctrl-C) is
        raised once the server has shut down, as uvicorn re-raises the signal it caught.
    """
    connections = connections if connections is not None else ConnectionLimits()
    worker = EngineWorker(engine, threads=threads)
    app = create_app(worker, tokenizer, served_names, limits=limits, allowed_hosts=allowed_hosts,
                     special_tokens=special_tokens)
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5, lifespan="on",
                            http=guarded_protocol(connections), timeout_keep_alive=connections.keep_alive_s,
                            ws="none")  # no WebSocket route: an upgrade would leave the guarded protocol's count
    server = Server(config, worker, banner, on_exit=app.state.serve.interrupt_all)
    try:
        server.run(sockets=[sock])
    finally:
        worker.stop()
        sock.close()
    return 1 if worker.error is not None else 0
