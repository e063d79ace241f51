"""What a client may cost the server: per connection (how long its request may take to arrive, how many
connections it may hold) and per request (the size of its body, the length of its prompt, the size of its answer).

Bounds on a connection (enforced by :mod:`beaconkv.serve.connections` under uvicorn, and by :class:`BodyLimit`):

* :class:`ConnectionLimits`: at most ``max_connections`` open connections — a new one beyond the cap closes the
  oldest connection whose request has not fully arrived (a slow-loris socket), or gets HTTP 503 when every
  connection holds a request being served; a request head must arrive within ``header_timeout_s``;
* :class:`BodyLimit`, an ASGI middleware: a body over ``max_bytes`` gets HTTP 413 at once — from its
  ``Content-Length`` before a byte of it is read, or as soon as a streamed (chunked) body passes the
  limit — and a body that has not fully arrived ``timeout_s`` seconds after its head gets HTTP 408; either way the
  connection is closed and the part already read is dropped, its memory handed back to the operating system
  (glibc keeps freed heap memory otherwise: 60 dropped bodies of 4 MiB left the server 200 MiB larger). Bodies
  under the limit are read in full, then handed to the app.

Bounds on a request (checked by :mod:`beaconkv.serve.schema` and :mod:`beaconkv.serve.prepare` before any work):

* :func:`max_token_chars`: the most characters one token of a tokenizer stands for. A prompt of
  more than ``prompt_capacity * max_token_chars`` characters needs more than ``prompt_capacity``
  tokens, so the routes refuse it without tokenizing it (a 50 MB prompt used to be tokenized in
  full — minutes, gigabytes — only to be refused for its length);
* :func:`check_answer_size`: ``choices x max_tokens x (1 + top_logprobs)`` — the tokens an answer may hold, each
  alternative reported counting as one — at most :attr:`RequestLimits.max_answer_tokens` (a 136-byte request once
  asked for a 111 MiB answer).
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import APIError, body_timeout, request_too_large

if TYPE_CHECKING:  # annotations only: the command line imports this module without the serve extra
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    from ..tokenizer import Tokenizer

DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20
"""``--max-request-bytes`` by default: 4 MiB (a prompt capacity of 32k tokens takes well under 1 MiB)."""
DEFAULT_BODY_TIMEOUT_S = 30.0
"""``--body-timeout`` by default: seconds a request body may take to arrive after its head (4 MiB at 1.1 Mbit/s)."""
DEFAULT_MAX_ANSWER_TOKENS = 2**20
"""``--max-answer-tokens`` by default: ``choices x max_tokens x (1 + top_logprobs)`` of one call (about 80 MiB of
JSON when every token carries 20 alternatives). A call of 32 choices of 32,768 tokens fits, as does one choice of
32,768 tokens with 20 alternatives each."""
DEFAULT_TEMPLATE_TIMEOUT_S = 5.0
"""``--template-timeout`` by default: seconds the chat template may take to render one conversation (it takes
milliseconds)."""
DEFAULT_MAX_CONNECTIONS = 512
"""``--max-connections`` by default: open connections at once (keep it above ``--max-batch`` + ``--max-queue``)."""
DEFAULT_HEADER_TIMEOUT_S = 10.0
"""``--header-timeout`` by default: seconds a request head (the request line and headers) may take to arrive."""
DEFAULT_KEEP_ALIVE_S = 5.0
"""Seconds an idle keep-alive connection stays open between requests (uvicorn's ``timeout_keep_alive``)."""


def _positive(name: str, value: float, flag: str, kind: type = float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int) or not value > 0:
        raise ValueError(f"{name}={value!r} must be a{'n int' if kind is int else ' number'} > 0 (the server's "
                         f"{flag}).")


@dataclass(frozen=True)
class RequestLimits:
    """What one request may cost the server before and while it is served.

    Attributes:
        max_request_bytes: Largest request body, in bytes (larger ones get HTTP 413 before they are read).
        body_timeout_s: Seconds a body may take to arrive after its head (then HTTP 408, and the part read is
            dropped).
        max_answer_tokens: Most ``choices x max_tokens x (1 + top_logprobs)`` of one call (more gets HTTP 400
            before any work).
        template_timeout_s: Seconds the chat template may take to render a conversation (then HTTP 400; the
            rendering is interrupted).

    Raises:
        ValueError: A limit that is not a positive number (an int for the counts).
    """

    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    max_answer_tokens: int = DEFAULT_MAX_ANSWER_TOKENS
    template_timeout_s: float = DEFAULT_TEMPLATE_TIMEOUT_S

    def __post_init__(self) -> None:
        _positive("max_request_bytes", self.max_request_bytes, "--max-request-bytes", int)
        _positive("body_timeout_s", self.body_timeout_s, "--body-timeout")
        _positive("max_answer_tokens", self.max_answer_tokens, "--max-answer-tokens", int)
        _positive("template_timeout_s", self.template_timeout_s, "--template-timeout")


@dataclass(frozen=True)
class ConnectionLimits:
    """What the open connections may hold (see :mod:`beaconkv.serve.connections`).

    Attributes:
        max_connections: Most connections open at once. A connection beyond it closes the oldest one whose
            request has not fully arrived; when every connection holds a request being served, it gets HTTP 503.
        header_timeout_s: Seconds a request head may take to arrive (from the connection's start, or from the end
            of the previous response on a keep-alive connection); then the connection is closed.
        keep_alive_s: Seconds an idle keep-alive connection stays open.

    Raises:
        ValueError: A limit that is not a positive number.
    """

    max_connections: int = DEFAULT_MAX_CONNECTIONS
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    keep_alive_s: float = DEFAULT_KEEP_ALIVE_S

    def __post_init__(self) -> None:
        _positive("max_connections", self.max_connections, "--max-connections", int)
        _positive("header_timeout_s", self.header_timeout_s, "--header-timeout")
        _positive("keep_alive_s", self.keep_alive_s, "keep-alive timeout")


def _find_malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` (None elsewhere: musl, macOS and Windows return freed memory themselves or lack it)."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):
        return None


_MALLOC_TRIM = _find_malloc_trim()
TRIM_DELAY_S = 0.2
"""Seconds between dropping a partial body and handing freed memory back (drops in between share one trim)."""


def max_token_chars(tokenizer: Tokenizer) -> int:
    """The most characters the text of one token has, over the whole vocabulary (special tokens included).

    Every character of a text is covered by at least one of its tokens, and a token's decoded text
    is at least as long as the characters it covers, so a text of ``c`` characters has at least
    ``c / max_token_chars`` tokens (for tokenizers whose normalizer does not shorten text, as the
    byte-level BPE of the supported models). Decodes each token once (about 0.1 s for 50k tokens).

    Args:
        tokenizer: The served model's tokenizer.
    """
    return max(1, max(len(tokenizer.decode([i], skip_special_tokens=False)) for i in range(tokenizer.vocab_size)))


def check_answer_size(choices: int, max_tokens: int, top_logprobs: int, limit: int, *, n: int | None = None,
                      prompts: int = 1, top_param: str = "top_logprobs") -> None:
    """Refuses a call whose answer could hold more than ``limit`` tokens: ``choices x max_tokens x (1 + top)``.

    Every generated token is one, and so is every alternative reported with it: the answer's JSON grows with
    that product (about 80 bytes per alternative), and it is built in memory before it is sent.

    Args:
        choices: Choices of the call (``n`` times the prompts).
        max_tokens: Most new tokens per choice.
        top_logprobs: Alternatives reported per token (0 without log-probabilities).
        limit: The server's ``--max-answer-tokens``.
        n: The call's ``n`` (for the message; ``choices`` when not given).
        prompts: The call's prompts (for the message).
        top_param: The field that asked for the alternatives (``top_logprobs``, or ``logprobs`` of a text call).

    Raises:
        APIError: HTTP 400 naming ``n``, ``max_tokens``, the alternatives, the product and the limit.
    """
    product = choices * max_tokens * (1 + top_logprobs)
    if product <= limit:
        return
    asked = f"n={choices if n is None else n}" + (f" for {prompts} prompts ({choices} choices)" if prompts > 1 else "")
    raise APIError(f"{asked} x max_tokens={max_tokens} x (1 + {top_param}={top_logprobs}) = {product} answer tokens, "
                   f"more than this server's limit of {limit}; ask for fewer choices, tokens or alternatives (or split "
                   "the call), or restart the server with a larger --max-answer-tokens.", param="n",
                   code="answer_too_large")


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` gets 413 before it is parsed, one slower than
    ``timeout_s`` gets 408.

    The refusal has OpenAI's error body (code ``request_too_large`` or ``request_timeout``) and ``Connection:
    close``, so the server does not read the rest of an upload it refused; the chunks already read are dropped
    with it.

    Args:
        app: The application.
        max_bytes: The largest body accepted, in bytes.
        on_refuse: Called once per refused request with the reason (``"too_large"`` or ``"body_timeout"``;
            the server's counters).
        timeout_s: Seconds the whole body may take to arrive, from the moment the app is called (its head has
            arrived); None: no limit.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, on_refuse: Callable[[str], None] | None = None,
                 timeout_s: float | None = None) -> None:
        self.app, self.max_bytes, self.on_refuse, self.timeout_s = app, max_bytes, on_refuse, timeout_s
        self._trim: asyncio.TimerHandle | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(send, "too_large", request_too_large(declared, self.max_bytes))
            return
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), None if deadline is None else deadline - time.monotonic())
            except asyncio.TimeoutError:
                chunks.clear()  # the partial body goes now, not when the client finally leaves
                self._return_memory()
                await self._refuse(send, "body_timeout", body_timeout(self.timeout_s or 0.0, size, declared))
                return
            if message["type"] == "http.disconnect":
                return  # the client left before its body arrived: nothing to answer
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                chunks.clear()
                self._return_memory()
                await self._refuse(send, "too_large", request_too_large(declared, self.max_bytes))
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        whole = [b"".join(chunks)]
        chunks.clear()

        async def replay() -> Message:
            if whole:  # the body once, then the connection's own messages (http.disconnect)
                return {"type": "http.request", "body": whole.pop(), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send, reason: str, err: APIError) -> None:
        if self.on_refuse is not None:
            self.on_refuse(reason)
        await send_error(send, err)

    def _return_memory(self) -> None:
        """Hands the heap memory freed with a dropped body back to the OS, :data:`TRIM_DELAY_S` later (once for
        all the bodies dropped meanwhile: a trim takes up to a few tens of milliseconds)."""
        if _MALLOC_TRIM is None or self._trim is not None:
            return

        def trim() -> None:
            self._trim = None
            _MALLOC_TRIM(0)

        self._trim = asyncio.get_running_loop().call_later(TRIM_DELAY_S, trim)


async def send_error(send: Send, err: APIError) -> None:
    """Answers an ASGI request with ``err`` (OpenAI's body, ASCII JSON) and ``Connection: close``, so that the
    server reads nothing more of it.

    Args:
        send: The request's ASGI ``send``.
        err: The error to answer with.
    """
    payload = json.dumps(err.body(), ensure_ascii=True).encode("ascii")
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
               (b"connection", b"close")]
    headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": payload, "more_body": False})


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # unreadable: the streamed bytes are counted instead
    return None
