"""The JSON objects the server answers with: completions, stream chunks, usage, model lists, SSE framing.

Plain dictionaries shaped as OpenAI's API writes them (``chat.completion``,
``chat.completion.chunk``, ``text_completion``, ``list`` of ``model``), so any OpenAI client parses
them; a stream is a sequence of ``data: {json}\\n\\n`` server-sent events ending with
``data: [DONE]\\n\\n``.

Log-probabilities come in OpenAI's two formats: a chat choice's ``logprobs`` is
``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}], "refusal": null}``
(:func:`chat_logprobs`), a text choice's is ``{"tokens", "token_logprobs", "top_logprobs",
"text_offset"}`` (:func:`text_logprobs`; ``top_logprobs`` maps token text to log-probability, the
chosen token included, as OpenAI's legacy API does). A token's text is its own decode
(:class:`TokenText`), so a token that holds part of a multi-byte character reads ``"\\ufffd"``.

:func:`json_bytes` serialises an answer a slice at a time: ``json.dumps`` holds the GIL for its whole call, and an
answer with a million log-probabilities took 20 s to serialise — on a thread, in one call, it would still hold
the event loop that long.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from typing import Any

from ..engine import Completion, TokenLogprob
from ..tokenizer import Tokenizer

SSE_DONE = "data: [DONE]\n\n"
"""The event that ends every stream."""


def new_id(prefix: str) -> str:
    """A fresh response id: ``chatcmpl-<hex>`` or ``cmpl-<hex>``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """The ``created`` timestamp: Unix seconds."""
    return int(time.time())


JSON_SLICE = 256
"""Elements of a long list serialised by one ``json.dumps`` call in :func:`json_bytes`."""
JSON_NODES = 4096
"""Values (containers and leaves) a value may hold to be serialised by one ``json.dumps`` call (a few ms)."""


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")


def _big(obj: Any) -> bool:
    """Whether ``obj`` holds more than :data:`JSON_NODES` values (counted until the count passes it)."""
    stack, seen = [obj], 0
    while stack:
        value = stack.pop()
        seen += 1
        if seen > JSON_NODES:
            return True
        if isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list):
            if len(value) > JSON_NODES:
                return True
            stack.extend(value)
    return False


def _encode(obj: Any, out: list[bytes]) -> None:
    if isinstance(obj, dict) and _big(obj):
        out.append(b"{")
        for i, (key, value) in enumerate(obj.items()):
            out.append((b"," if i else b"") + _dumps({key: 0})[1:-2])  # the key as json writes it, and ":"
            _encode(value, out)
        out.append(b"}")
    elif isinstance(obj, list) and _big(obj):
        out.append(b"[")
        short = len(obj) <= JSON_SLICE  # a short list (the choices) may hold one huge element anywhere
        for start in range(0, len(obj), JSON_SLICE):
            part = obj[start:start + JSON_SLICE]
            # a long list's elements are alike (log-probability entries): its first element speaks for a slice
            if any(map(_big, part)) if short else _big(part[0]):
                for i, value in enumerate(part):
                    if start or i:
                        out.append(b",")
                    _encode(value, out)
            else:
                out.append((b"," if start else b"") + _dumps(part)[1:-1])
        out.append(b"]")
    else:
        out.append(_dumps(obj))


def json_bytes(obj: Any) -> bytes:
    """``obj`` as compact UTF-8 JSON, byte for byte what ``json.dumps(obj, ensure_ascii=False,
    separators=(",", ":"))`` writes, serialised a piece at a time: a value of at most :data:`JSON_NODES` values
    in one call, a larger dict key by key, a larger list :data:`JSON_SLICE` elements at a time (its elements
    one by one when they are large themselves).

    Each slice is one short C call (serialised and encoded to UTF-8 on its own); between them the GIL passes to
    other threads, so serialising a huge answer on a worker thread leaves the event loop running. Only the last
    step, joining the slices' bytes, is one call over the whole answer (a copy: milliseconds for megabytes).

    Raises:
        ValueError: A NaN or infinite float (JSON has none).
        TypeError: A value JSON cannot hold.
    """
    out: list[bytes] = []
    _encode(obj, out)
    return b"".join(out)


def sse(obj: dict[str, Any], ascii: bool = False) -> str:
    """One server-sent event carrying ``obj`` as JSON (``ascii``: every non-ASCII character escaped, for errors
    that may quote what the client sent)."""
    return f"data: {json.dumps(obj, ensure_ascii=ascii, separators=(',', ':'))}\n\n"


class TokenText:
    """The text of single tokens (special tokens spelled out), decoded once each.

    Args:
        tokenizer: The served model's tokenizer.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._text: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        """The token's text."""
        text = self._text.get(token_id)
        if text is None:
            text = self._text[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text


FLOAT32_LOWEST = -3.4028234663852886e38
"""The log-probability reported for a token of probability 0 (JSON has no ``-inf``)."""


def _finite(x: float) -> float:
    return x if x > FLOAT32_LOWEST else FLOAT32_LOWEST


def chat_logprobs(entries: Sequence[TokenLogprob], text: TokenText) -> dict[str, Any]:
    """A chat choice's ``logprobs`` object (or a stream chunk's), for these tokens.

    Args:
        entries: One per token, in order (each with the alternatives the call asked for).
        text: Token texts.
    """
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        s = text(token_id)
        return {"token": s, "logprob": _finite(logprob), "bytes": list(s.encode("utf-8"))}

    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries], "refusal": None}


def text_logprobs(entries: Sequence[TokenLogprob], text: TokenText, offset: int = 0) -> dict[str, Any]:
    """A text choice's ``logprobs`` object (or a stream chunk's), for these tokens.

    Args:
        entries: One per token, in order.
        text: Token texts.
        offset: ``text_offset`` of the first token: the characters of the tokens before it (in a stream).
    """
    tokens = [text(e.token_id) for e in entries]
    offsets = []
    for s in tokens:
        offsets.append(offset)
        offset += len(s)
    tops = []
    for e in entries:
        top = {text(t): _finite(lp) for t, lp in e.top}
        top.setdefault(text(e.token_id), _finite(e.logprob))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": [_finite(e.logprob) for e in entries], "top_logprobs": tops,
            "text_offset": offsets}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """The ``usage`` object of a call.

    Args:
        prompt_tokens: Prompt tokens (each distinct prompt once).
        completion_tokens: New tokens of every choice together.
    """
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_completion(id: str, created: int, model: str, completions: Sequence[Completion],
                    prompt_tokens: int, text: TokenText | None = None) -> dict[str, Any]:
    """A ``chat.completion`` object: one assistant message per choice, and the usage.

    Args:
        id: The response id.
        created: Unix seconds.
        model: The served model name.
        completions: One finished engine request per choice, in choice order.
        prompt_tokens: Prompt tokens of the call.
        text: Token texts, for the choices that carry log-probabilities.
    """
    def logprobs(c: Completion) -> dict[str, Any] | None:
        return None if c.logprobs is None or text is None else chat_logprobs(c.logprobs, text)

    return {
        "id": id, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": i, "message": {"role": "assistant", "content": c.text}, "logprobs": logprobs(c),
                     "finish_reason": c.finish_reason} for i, c in enumerate(completions)],
        "usage": usage(prompt_tokens, sum(len(c.token_ids) for c in completions)),
    }


def text_completion(id: str, created: int, model: str, completions: Sequence[Completion],
                    prompt_tokens: int, text: TokenText | None = None) -> dict[str, Any]:
    """A ``text_completion`` object: one text per choice, and the usage (arguments as :func:`chat_completion`)."""
    def logprobs(c: Completion) -> dict[str, Any] | None:
        return None if c.logprobs is None or text is None else text_logprobs(c.logprobs, text)

    return {
        "id": id, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": i, "text": c.text, "logprobs": logprobs(c), "finish_reason": c.finish_reason}
                    for i, c in enumerate(completions)],
        "usage": usage(prompt_tokens, sum(len(c.token_ids) for c in completions)),
    }


def chat_chunk(id: str, created: int, model: str, index: int, delta: dict[str, str],
               finish_reason: str | None = None, with_usage: bool = False,
               logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ``chat.completion.chunk`` of one choice.

    Args:
        id: The response id (the same for every chunk of a stream).
        created: Unix seconds.
        model: The served model name.
        index: The choice.
        delta: ``{"role": "assistant", "content": ""}`` first, then ``{"content": text}``, ``{}`` last.
        finish_reason: Set on the choice's last chunk.
        with_usage: Add ``"usage": null`` (a stream asked for usage puts it in every chunk, null but the last).
        logprobs: The chunk's tokens' :func:`chat_logprobs` (None: not asked for).
    """
    out: dict[str, Any] = {"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                           "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                        "finish_reason": finish_reason}]}
    if with_usage:
        out["usage"] = None
    return out


def text_chunk(id: str, created: int, model: str, index: int, text: str, finish_reason: str | None = None,
               with_usage: bool = False, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """A streamed ``text_completion`` chunk of one choice (arguments as :func:`chat_chunk`, ``text`` the new
    text, ``logprobs`` the chunk's :func:`text_logprobs`)."""
    out: dict[str, Any] = {"id": id, "object": "text_completion", "created": created, "model": model,
                           "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                        "finish_reason": finish_reason}]}
    if with_usage:
        out["usage"] = None
    return out


def usage_chunk(object: str, id: str, created: int, model: str, prompt_tokens: int,
                completion_tokens: int) -> dict[str, Any]:
    """The last chunk of a stream that asked for usage: no choices, the call's usage.

    Args:
        object: ``chat.completion.chunk`` or ``text_completion``.
        id: The response id.
        created: Unix seconds.
        model: The served model name.
        prompt_tokens: Prompt tokens of the call.
        completion_tokens: New tokens of every choice together.
    """
    return {"id": id, "object": object, "created": created, "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}


def model_list(names: Sequence[str], created: int, max_model_len: int) -> dict[str, Any]:
    """The ``GET /v1/models`` object.

    Args:
        names: The served model names.
        created: Unix seconds (when the server started).
        max_model_len: Prompt capacity plus the most new tokens (vLLM's field).
    """
    return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "beaconkv",
                                        "max_model_len": max_model_len} for name in names]}
