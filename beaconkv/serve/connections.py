"""uvicorn's HTTP/1.1 protocol with a cap on open connections and a time limit on request heads (slow-loris).

uvicorn closes an idle keep-alive connection after a few seconds, but a connection that never finishes its
request head stays open for good, and it accepts connections until the process runs out of file descriptors —
1,100 half-open sockets once made ``/health`` and every call time out. :class:`GuardedH11Protocol` adds, per
connection (with the limits of :class:`~beaconkv.serve.limits.ConnectionLimits`):

* a head timeout: a request head (request line and headers; uvicorn's h11 bounds its size at 16 KiB) must arrive
  within ``header_timeout_s`` of the connection's start, or of the end of the previous response on a keep-alive
  connection, else the connection is closed (the body's own limit is :class:`~beaconkv.serve.limits.BodyLimit`'s);
* a cap: at most ``max_connections`` connections. One more closes the oldest connection that is not being served
  (its head or body still arriving, or idle between requests); when every other connection holds a request being
  served, the new one is answered HTTP 503 (with ``Retry-After``) as soon as its head arrives. A flood of
  half-open sockets therefore pushes out its own oldest sockets, never a call being answered, and a new client
  (``/health``) always gets in.

On shutdown, a connection whose body is still arriving is closed at once (uvicorn would wait for it).
:func:`guarded_protocol` makes the class for one server (its connections are counted together).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import APIError, SERVER_ERROR
from .limits import ConnectionLimits, send_error


class ConnectionRegistry:
    """The open connections of one server, oldest first, and what became of the ones it pushed out.

    Args:
        limits: The cap and the head timeout.

    Attributes:
        evicted: Connections closed to make room for a newer one.
        timed_out: Connections closed because their request head was late.
        refused: Connections answered 503 (every other connection was being served).
    """

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.open: dict[GuardedH11Protocol, None] = {}  # insertion-ordered: oldest first
        self.evicted = self.timed_out = self.refused = 0


def _too_many(limit: int) -> APIError:
    return APIError(f"the server holds its limit of {limit} connections, each with a request being served; retry in "
                    "a moment, or restart the server with a larger --max-connections.", status=503, type=SERVER_ERROR,
                    code="too_many_connections", headers={"Retry-After": "1"})


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a head timeout and a connection cap (see the module).

    Made for one server by :func:`guarded_protocol`, which sets :attr:`registry`; uvicorn constructs one per
    connection (``uvicorn.Config(http=...)``).

    Attributes:
        registry: The server's open connections and limits.
    """

    registry: ConnectionRegistry

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_for: object = None  # the request cycle current when the head timer was armed

    @property
    def waiting(self) -> bool:
        """No request of this connection is being served: its head or body is still arriving, or it is idle."""
        cycle = self.cycle
        return cycle is None or cycle.response_complete or cycle.more_body

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """uvicorn's, then the cap: the oldest waiting connection makes room, or this one will get 503."""
        super().connection_made(transport)
        registry = self.registry
        registry.open[self] = None
        while len(registry.open) > registry.limits.max_connections:
            victim = next((c for c in registry.open if c is not self and c.waiting), None)
            if victim is None:
                registry.refused += 1
                self.app = _Refuse(_too_many(registry.limits.max_connections))
                break
            registry.open.pop(victim, None)
            registry.evicted += 1
            victim.transport.close()
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        """Forgets the connection, then uvicorn's."""
        self.registry.open.pop(self, None)
        if self._head_timer is not None:
            self._head_timer.cancel()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        """uvicorn's; the next request head has ``header_timeout_s`` to arrive."""
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_head_timer()

    def shutdown(self) -> None:
        """uvicorn's shutdown; a connection whose request body is still arriving is closed at once."""
        cycle = self.cycle
        if cycle is not None and cycle.more_body and not cycle.response_complete:
            self.transport.close()
            return
        super().shutdown()

    def _arm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_for = self.cycle
        self._head_timer = self.loop.call_later(self.registry.limits.header_timeout_s, self._head_timeout)

    def _head_timeout(self) -> None:
        self._head_timer = None
        cycle = self.cycle
        if cycle is self._head_for and (cycle is None or cycle.response_complete) and not self.transport.is_closing():
            self.registry.timed_out += 1
            self.transport.close()


class _Refuse:
    """The ASGI app of a connection over the cap: ``err``, whatever was asked."""

    def __init__(self, err: APIError) -> None:
        self.err = err

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send_error(send, self.err)


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedH11Protocol]:
    """The protocol class of one server: pass it as ``uvicorn.Config(http=...)``.

    Args:
        limits: The cap and the head timeout (the keep-alive timeout is uvicorn's ``timeout_keep_alive``).
    """
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"registry": ConnectionRegistry(limits),
                                                               "__module__": __name__})
