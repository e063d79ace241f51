"""What one request may cost the server before it is admitted: the size of its body, the length of its prompt.

Two bounds keep a single request from holding the event loop, the memory or the tokenizer for long:

* :class:`BodyLimit`, an ASGI middleware: a body over ``max_bytes`` gets HTTP 413 at once — from its
  ``Content-Length`` before a byte of it is read, or as soon as a streamed (chunked) body passes the
  limit — and is never parsed. Bodies under the limit are read in full, then handed to the app.
* :func:`max_token_chars`: the most characters one token of a tokenizer stands for. A prompt of
  more than ``prompt_capacity * max_token_chars`` characters needs more than ``prompt_capacity``
  tokens, so the routes refuse it without tokenizing it (a 50 MB prompt used to be tokenized in
  full — minutes, gigabytes — only to be refused for its length).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING

from .errors import request_too_large

if TYPE_CHECKING:  # annotations only: the command line imports this module without the serve extra
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    from ..tokenizer import Tokenizer

DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20
"""``--max-request-bytes`` by default: 8 MiB (a prompt capacity of 32k tokens takes well under 1 MiB)."""


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


class BodyLimit:
    """ASGI middleware refusing HTTP request bodies over ``max_bytes`` with 413, before they are parsed.

    The refusal has OpenAI's error body (code ``request_too_large``) and ``Connection: close``, so
    the server does not read the rest of an upload it refused.

    Args:
        app: The application.
        max_bytes: The largest body accepted, in bytes.
        on_refuse: Called once per refused request (the server's counters).
    """

    def __init__(self, app: ASGIApp, max_bytes: int, on_refuse: Callable[[], None] | None = None) -> None:
        self.app, self.max_bytes, self.on_refuse = app, max_bytes, on_refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(send, declared)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before its body arrived: nothing to answer
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                chunks.clear()
                await self._refuse(send, declared)
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

    async def _refuse(self, send: Send, size: int | None) -> None:
        if self.on_refuse is not None:
            self.on_refuse()
        err = request_too_large(size, self.max_bytes)
        payload = json.dumps(err.body()).encode()
        await send({"type": "http.response.start", "status": err.status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": payload, "more_body": False})


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # unreadable: the streamed bytes are counted instead
    return None
