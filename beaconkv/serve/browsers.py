"""What keeps a web page from driving the server: the ``Host`` check and JSON-only bodies.

A page open in a browser on the same machine (or network) can send requests to the server two ways, and
:class:`BrowserGuard`, an ASGI middleware, closes both before a request is read:

* a cross-site "simple" request — a ``POST`` with ``Content-Type: text/plain`` or a form encoding, which a
  browser sends without asking the server first (no CORS preflight). The server used to parse such a body as
  JSON. Now a body must be declared ``application/json`` (HTTP 415 otherwise), and a browser asks the server
  before sending one cross-site — which this server, having no CORS headers, never allows;
* DNS rebinding — a page whose own domain the attacker re-points at ``127.0.0.1`` is, to the browser, the same
  origin as the server, so every request is allowed and its answer readable. The browser still sends the
  attacker's domain as ``Host``: a request whose ``Host`` is not one of the server's names gets HTTP 400.
  :func:`default_allowed_hosts` gives the names by default (localhost and the bind address); ``beaconkv serve
  --allowed-hosts`` replaces them (``*`` allows any).

A request without a ``Host`` (HTTP/1.0; no browser sends one) is not refused for it.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from .errors import APIError, host_not_allowed, unsupported_media_type
from .limits import send_error

if TYPE_CHECKING:  # annotations only: the command line imports this module without the serve extra
    from starlette.types import ASGIApp, Receive, Scope, Send

LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
"""Names of this machine every server answers to."""
ANY_HOST = "*"
"""The ``--allowed-hosts`` entry that allows every ``Host``."""
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
"""Methods whose body must be declared ``application/json``."""


def normalize_host(host: str) -> str:
    """A host name as compared: lower case, no port, no brackets around an IPv6 address, no final dot, an IP
    address in its canonical form.

    Args:
        host: A ``Host`` header value (``Example.COM:8000``, ``[::1]:8000``) or a bare name or address.
    """
    host = host.strip().lower()
    if host.startswith("["):  # [v6]:port
        host = host[1:].split("]", 1)[0]
    elif host.count(":") == 1:  # name:port or v4:port (a bare IPv6 address has several colons)
        host = host.rsplit(":", 1)[0]
    host = host.rstrip(".")
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host


def default_allowed_hosts(bind_host: str) -> list[str]:
    """The names a server bound to ``bind_host`` answers to by default.

    Localhost's names, and the bind address itself; for a wildcard bind (``0.0.0.0``, ``::``, empty) also this
    machine's host name, its fully qualified name and the addresses they resolve to — other names (a DNS name
    that points at the machine, a proxy's) must be given with ``--allowed-hosts``.

    Args:
        bind_host: ``--host`` as given.
    """
    names = list(LOCAL_HOSTS)
    bound = normalize_host(bind_host) if bind_host else ""
    if bound not in ("", "0.0.0.0", "::"):
        names.append(bound)
    else:
        for name in {socket.gethostname(), socket.getfqdn()}:
            if not name:
                continue
            names.append(name.lower())
            try:
                names += [info[4][0] for info in socket.getaddrinfo(name, None)]
            except OSError:
                pass
    return list(dict.fromkeys(normalize_host(n) for n in names))


def host_allowed(host: str, allowed: Sequence[str]) -> bool:
    """Whether a ``Host`` header names one of the ``allowed`` hosts.

    An entry ``*`` allows any host, ``.example.com`` allows ``example.com`` and its subdomains, any other entry
    allows that name or address exactly (case and port aside; IPv6 addresses compared as addresses).

    Args:
        host: The ``Host`` header value.
        allowed: The allowed entries (as :func:`normalize_host` writes them).
    """
    name = normalize_host(host)
    for entry in allowed:
        if entry == ANY_HOST or entry == name:
            return True
        if entry.startswith(".") and (name == entry[1:] or name.endswith(entry)):
            return True
    return False


def _entry(entry: str) -> str:
    """An ``--allowed-hosts`` entry as compared (``*`` and ``.domain`` kept as patterns)."""
    if entry == ANY_HOST:
        return entry
    if entry.startswith("."):
        return "." + normalize_host(entry[1:])
    return normalize_host(entry)


def _media_type(value: str) -> str:
    return value.split(";", 1)[0].strip().lower()


class BrowserGuard:
    """ASGI middleware: HTTP 400 for a ``Host`` not in ``allowed_hosts``, 415 for a body not declared JSON.

    Both answer before the body is read, with OpenAI's error body and ``Connection: close``.

    Args:
        app: The application.
        allowed_hosts: Allowed ``Host`` names (see :func:`host_allowed`); None: every host.
        on_refuse: Called once per refused request with the reason (``"bad_host"`` or ``"unsupported_media_type"``).
    """

    def __init__(self, app: ASGIApp, allowed_hosts: Sequence[str] | None,
                 on_refuse: Callable[[str], None] | None = None) -> None:
        self.app, self.on_refuse = app, on_refuse
        self.allowed = None if allowed_hosts is None else [_entry(h) for h in allowed_hosts]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {name.lower(): value for name, value in scope.get("headers", ())}
        host = headers.get(b"host")
        if self.allowed is not None and host is not None:
            text = host.decode("latin-1")
            if not host_allowed(text, self.allowed):
                await self._refuse(send, "bad_host", host_not_allowed(text, self.allowed))
                return
        if scope.get("method") in BODY_METHODS:
            declared = headers.get(b"content-type")
            shown = None if declared is None else declared.decode("latin-1")
            if shown is None or _media_type(shown) != "application/json":
                await self._refuse(send, "unsupported_media_type", unsupported_media_type(shown))
                return
        await self.app(scope, receive, send)

    async def _refuse(self, send: Send, reason: str, err: APIError) -> None:
        if self.on_refuse is not None:
            self.on_refuse(reason)
        await send_error(send, err)
