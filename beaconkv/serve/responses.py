"""The JSON objects the server answers with: completions, stream chunks, usage, model lists, SSE framing.

Plain dictionaries shaped as OpenAI's API writes them (``chat.completion``,
``chat.completion.chunk``, ``text_completion``, ``list`` of ``model``), so any OpenAI client parses
them; a stream is a sequence of ``data: {json}\\n\\n`` server-sent events ending with
``data: [DONE]\\n\\n``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from typing import Any

from ..engine import Completion

SSE_DONE = "data: [DONE]\n\n"
"""The event that ends every stream."""


def new_id(prefix: str) -> str:
    """A fresh response id: ``chatcmpl-<hex>`` or ``cmpl-<hex>``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """The ``created`` timestamp: Unix seconds."""
    return int(time.time())


def sse(obj: dict[str, Any]) -> str:
    """One server-sent event carrying ``obj`` as JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """The ``usage`` object of a call.

    Args:
        prompt_tokens: Prompt tokens (each distinct prompt once).
        completion_tokens: New tokens of every choice together.
    """
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_completion(id: str, created: int, model: str, completions: Sequence[Completion],
                    prompt_tokens: int) -> dict[str, Any]:
    """A ``chat.completion`` object: one assistant message per choice, and the usage.

    Args:
        id: The response id.
        created: Unix seconds.
        model: The served model name.
        completions: One finished engine request per choice, in choice order.
        prompt_tokens: Prompt tokens of the call.
    """
    return {
        "id": id, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": i, "message": {"role": "assistant", "content": c.text}, "logprobs": None,
                     "finish_reason": c.finish_reason} for i, c in enumerate(completions)],
        "usage": usage(prompt_tokens, sum(len(c.token_ids) for c in completions)),
    }


def text_completion(id: str, created: int, model: str, completions: Sequence[Completion],
                    prompt_tokens: int) -> dict[str, Any]:
    """A ``text_completion`` object: one text per choice, and the usage (arguments as :func:`chat_completion`)."""
    return {
        "id": id, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": i, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}
                    for i, c in enumerate(completions)],
        "usage": usage(prompt_tokens, sum(len(c.token_ids) for c in completions)),
    }


def chat_chunk(id: str, created: int, model: str, index: int, delta: dict[str, str],
               finish_reason: str | None = None, with_usage: bool = False) -> dict[str, Any]:
    """A ``chat.completion.chunk`` of one choice.

    Args:
        id: The response id (the same for every chunk of a stream).
        created: Unix seconds.
        model: The served model name.
        index: The choice.
        delta: ``{"role": "assistant", "content": ""}`` first, then ``{"content": text}``, ``{}`` last.
        finish_reason: Set on the choice's last chunk.
        with_usage: Add ``"usage": null`` (a stream asked for usage puts it in every chunk, null but the last).
    """
    out: dict[str, Any] = {"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                           "choices": [{"index": index, "delta": delta, "logprobs": None,
                                        "finish_reason": finish_reason}]}
    if with_usage:
        out["usage"] = None
    return out


def text_chunk(id: str, created: int, model: str, index: int, text: str, finish_reason: str | None = None,
               with_usage: bool = False) -> dict[str, Any]:
    """A streamed ``text_completion`` chunk of one choice (arguments as :func:`chat_chunk`, ``text`` the new text)."""
    out: dict[str, Any] = {"id": id, "object": "text_completion", "created": created, "model": model,
                           "choices": [{"index": index, "text": text, "logprobs": None,
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
