"""OpenAI-style errors of the HTTP server: one exception type and the JSON body every client expects.

OpenAI clients (the official ``openai`` package, lm-evaluation-harness) read a failed call's body as
``{"error": {"message", "type", "param", "code"}}`` and choose their exception class from the HTTP
status (400 -> ``BadRequestError``, 404 -> ``NotFoundError``, 413, 429 -> ``RateLimitError``,
500 -> ``InternalServerError``...). Every route raises
:class:`APIError` for a request it cannot serve; the app turns it, FastAPI's own validation errors
and unknown routes into that body.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ..errors import BeaconKVError

INVALID_REQUEST = "invalid_request_error"
"""``type`` of a request the server cannot take as sent (HTTP 400)."""
RATE_LIMIT = "rate_limit_error"
"""``type`` of a request refused because the queue is full (HTTP 429)."""
SERVER_ERROR = "server_error"
"""``type`` of a failure of the server itself (HTTP 500/503)."""


def error_body(message: str, type: str = INVALID_REQUEST, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """The JSON body of an error response, as OpenAI's API writes it.

    Args:
        message: What was wrong and how to fix it.
        type: ``invalid_request_error``, ``rate_limit_error`` or ``server_error``.
        param: The request field at fault (``"temperature"``, ``"messages.0.role"``), if one is.
        code: A short machine-readable reason (``"invalid_value"``, ``"model_not_found"``...).

    Returns:
        ``{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}``.
    """
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class APIError(BeaconKVError):
    """A request the server answers with an error status and an OpenAI-style body.

    Args:
        message: What was wrong and how to fix it (names the bad value).
        status: The HTTP status (400 by default).
        type: The error ``type`` of the body.
        param: The request field at fault.
        code: A short machine-readable reason.
        headers: Extra response headers (``Retry-After`` for a full queue).
    """

    def __init__(self, message: str, *, status: int = 400, type: str = INVALID_REQUEST, param: str | None = None,
                 code: str | None = "invalid_value", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        """The response body (see :func:`error_body`)."""
        return error_body(self.message, self.type, self.param, self.code)


def queue_full(message: str, retry_after_s: float) -> APIError:
    """The HTTP 429 error of a full waiting queue, with a ``Retry-After`` header in whole seconds.

    Args:
        message: The engine's message (how many requests wait, the limit).
        retry_after_s: The engine's hint of when a slot may be free.
    """
    seconds = max(1, math.ceil(retry_after_s))
    return APIError(f"the server is busy: {message} Retry after {seconds}s, or start it with a larger --max-queue.",
                    status=429, type=RATE_LIMIT, code="queue_full", headers={"Retry-After": str(seconds)})


def model_not_found(name: str, served: Sequence[str]) -> APIError:
    """The HTTP 404 error of a call naming a model this server does not serve (as OpenAI and vLLM answer).

    Args:
        name: The ``model`` the call named.
        served: The names this server answers to.
    """
    shown = repr(name) if len(name) <= 80 else repr(name[:77] + "...")
    return APIError(f"model={shown} is not served here; this server serves {', '.join(map(repr, served))} "
                    "(see GET /v1/models).", status=404, param="model", code="model_not_found")


def request_too_large(size: int | None, limit: int) -> APIError:
    """The HTTP 413 error of a request body over the server's ``--max-request-bytes``.

    Args:
        size: The body's size in bytes (its ``Content-Length``), or None when it was streamed and
            only passing the limit is known.
        limit: The limit in bytes.
    """
    has = f"has {size} bytes" if size is not None else "passed"
    return APIError(f"the request body {has}, more than this server's limit of {limit} bytes; send a smaller "
                    "request, or restart the server with a larger --max-request-bytes.", status=413,
                    code="request_too_large")


def body_timeout(timeout_s: float, received: int, declared: int | None) -> APIError:
    """The HTTP 408 error of a request body that did not arrive within the server's ``--body-timeout``.

    Args:
        timeout_s: The limit in seconds.
        received: Bytes of the body that had arrived.
        declared: The body's ``Content-Length``, if it had one.
    """
    of = f" of {declared}" if declared is not None else ""
    return APIError(f"the request body did not arrive within {timeout_s:g} s ({received}{of} bytes came); send it "
                    "at once, or restart the server with a larger --body-timeout.", status=408,
                    code="request_timeout")


def unsupported_media_type(content_type: str | None) -> APIError:
    """The HTTP 415 error of a request body that is not declared as JSON.

    A web page may send a cross-site ``text/plain`` or form POST without asking the server first; a JSON body
    needs the browser's CORS preflight, which this server never grants.

    Args:
        content_type: The request's ``Content-Type`` (None: it had none).
    """
    shown = "no Content-Type" if content_type is None else f"Content-Type {content_type[:80]!r}"
    return APIError(f"the request has {shown}; this server reads JSON bodies only: send the header "
                    "'Content-Type: application/json'.", status=415, code="unsupported_media_type")


def host_not_allowed(host: str, allowed: Sequence[str]) -> APIError:
    """The HTTP 400 error of a request whose ``Host`` is not one this server answers to (DNS rebinding).

    Args:
        host: The host the request named.
        allowed: The allowed host names.
    """
    shown = host if len(host) <= 80 else host[:77] + "..."
    return APIError(f"Host {shown!r} is not a name of this server (it answers to {', '.join(map(repr, allowed))}): "
                    "a web page may have pointed its own domain at this address. Call the server by one of those "
                    "names, or restart it with --allowed-hosts naming this one.", code="host_not_allowed")


def template_timeout(timeout_s: float) -> APIError:
    """The HTTP 400 error of a conversation the chat template did not render within ``--template-timeout``.

    Args:
        timeout_s: The limit in seconds.
    """
    return APIError(f"the chat template took more than {timeout_s:g} s to render this conversation and was stopped; "
                    "send a shorter conversation or other chat_template_kwargs, or restart the server with a larger "
                    "--template-timeout.", param="messages", code="template_timeout")


def request_failed(reason: str) -> APIError:
    """The HTTP 500 error of a request the engine took but failed on (the other requests went on).

    Args:
        reason: The engine's :attr:`~beaconkv.engine.Completion.error`.
    """
    return APIError(f"{reason}; the server goes on (please report this).", status=500, type=SERVER_ERROR,
                    code="request_failed")


def shutting_down(reason: str = "the server is shutting down") -> APIError:
    """The HTTP 503 error of a request the engine can no longer serve (shutdown, or a failed engine)."""
    return APIError(f"{reason}; the request was not completed.", status=503, type=SERVER_ERROR,
                    code="service_unavailable")


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "null"}


def _field_path(loc: tuple[Any, ...] | list[Any]) -> str | None:
    """``("body", "messages", 0, "role")`` -> ``"messages.0.role"`` (union tags such as ``list[int]`` dropped)."""
    parts = [str(p) for p in loc[1 if loc and loc[0] == "body" else 0:]
             if not (isinstance(p, str) and ("[" in p or "-" in p or p.lower() in _TYPE_TAGS))]
    return ".".join(parts) or None


def from_validation_errors(errors: list[dict[str, Any]]) -> APIError:
    """The HTTP 400 error of a body FastAPI could not parse into a request model.

    Args:
        errors: Pydantic's error list (``RequestValidationError.errors()``); the first one is reported
            (a value of the wrong type for a union field gives one error per member of the union).

    Returns:
        An :class:`APIError` naming the field, what was wrong and the value sent.
    """
    if not errors:
        return APIError("the request body is invalid.")
    first = errors[0]
    if first.get("type") == "json_invalid":
        reason = (first.get("ctx") or {}).get("error", "")
        return APIError(f"the request body is not valid JSON ({reason}); send a JSON object.", param=None,
                        code="invalid_json")
    param = _field_path(tuple(first.get("loc", ())))
    if first.get("type") == "missing":
        message = f"{param or 'a field'} is required."
    else:
        got = first.get("input")
        shown = repr(got) if len(repr(got)) <= 80 else repr(got)[:77] + "..."
        message = f"{param or 'the body'}: {first.get('msg', 'invalid value')} (got {shown})."
    return APIError(message, param=param, code="invalid_type" if first.get("type") != "missing" else "missing")
