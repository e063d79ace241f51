"""The FastAPI application: OpenAI-compatible routes over an :class:`~beaconkv.serve.worker.EngineWorker`.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (JSON, or server-sent events with
``"stream": true``), ``GET /v1/models``, ``GET /health`` and ``GET /metrics`` (Prometheus text).

A call is checked and encoded (:mod:`beaconkv.serve.schema`), submitted to the engine thread as one
group of ``n`` choices, and answered from the group's events. Every error has OpenAI's body
(:mod:`beaconkv.serve.errors`): 400 for a bad request — FastAPI's own validation errors included,
which it would answer with 422 — 429 with ``Retry-After`` when the queue is full, 503 when the
engine has stopped. A client that goes away has its choices cancelled, freeing their slots at the
next step: every waiting route watches the connection for ``http.disconnect`` (a non-streamed call
has nothing to send until it ends) and looks at least every ``poll_s`` seconds, and a stream also
ends when its generator is cancelled or closed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import Completion, Engine, EngineError, QueueFullError
from ..tokenizer import Tokenizer
from . import responses
from .errors import (
    INVALID_REQUEST,
    SERVER_ERROR,
    APIError,
    error_body,
    from_validation_errors,
    queue_full,
    shutting_down,
)
from .metrics import CONTENT_TYPE, render, server_metrics
from .schema import (
    ChatCompletionRequest,
    CompletionRequest,
    PreparedRequest,
    prepare_chat,
    prepare_completion,
)
from .worker import EngineWorker, RequestGroup, WorkerStopped

CLIENT_CLOSED = 499
"""Status logged for a call whose client went away before its answer (nobody reads it)."""
_REFUSALS = {400: "invalid_request", 429: "queue_full", 503: "unavailable"}


@dataclass
class ServeState:
    """What the routes share.

    Attributes:
        worker: The engine thread.
        tokenizer: The served model's tokenizer.
        served: The names the server answers to (the first is the default).
        poll_s: Seconds between checks that a waiting client is still connected.
    """

    worker: EngineWorker
    tokenizer: Tokenizer
    served: list[str]
    poll_s: float = 0.5

    @property
    def engine(self) -> Engine:
        """The engine the worker steps."""
        return self.worker.engine


def create_app(worker: EngineWorker, tokenizer: Tokenizer, served_names: Sequence[str], *,
               poll_s: float = 0.5) -> FastAPI:
    """The server's application. Its lifespan starts the worker's thread and stops it at shutdown.

    Args:
        worker: The engine thread (not started yet).
        tokenizer: The served model's tokenizer.
        served_names: The model names requests may ask for (at least one).
        poll_s: Seconds between checks that a waiting client is still connected.

    Raises:
        ValueError: ``served_names`` is empty.
    """
    if not served_names:
        raise ValueError("served_names is empty; give the model at least one name.")
    state = ServeState(worker, tokenizer, list(served_names), poll_s)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(worker.stop)

    app = FastAPI(title="beaconkv", summary="OpenAI-compatible API over beaconkv's continuous-batching engine",
                  lifespan=lifespan)
    app.state.serve = state
    _add_error_handlers(app, state)

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while the engine thread runs, 503 once it stopped (with the reason)."""
        if worker.alive:
            return JSONResponse({"status": "ok", "running": state.engine.running, "queued": state.engine.queued})
        return JSONResponse({"status": "unavailable", "reason": worker.stop_reason}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus text exposition of the pool and the counters."""
        return Response(render(server_metrics(state.engine, worker.meter, worker.counters)), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        """The served model names."""
        engine = state.engine
        return JSONResponse(responses.model_list(state.served, int(worker.counters.started),
                                                 engine.prompt_capacity + engine.max_new_tokens))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """A chat completion: the conversation rendered with the chat template."""
        return await _respond(state, prepare_chat(body, tokenizer, state.engine, state.served), request, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        """A text completion of the prompt(s) as given."""
        return await _respond(state, prepare_completion(body, tokenizer, state.engine, state.served), request,
                              chat=False)

    return app


def _add_error_handlers(app: FastAPI, state: ServeState) -> None:
    counters = state.worker.counters

    def answer(err: APIError) -> JSONResponse:
        reason = _REFUSALS.get(err.status)
        if reason is not None:
            counters.refused[reason] = counters.refused.get(reason, 0) + 1
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers or None)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return answer(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return answer(from_validation_errors(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = (f"{request.method} {request.url.path} is not an endpoint of this server; it serves "
                       "/v1/chat/completions, /v1/completions, /v1/models, /health and /metrics.")
        else:
            message = f"{request.method} {request.url.path}: {exc.detail}"
        kind = INVALID_REQUEST if exc.status_code < 500 else SERVER_ERROR
        return JSONResponse(error_body(message, kind, None, str(exc.status_code)), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def server_error(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"internal server error ({type(exc).__name__}: {exc}).", SERVER_ERROR, None,
                                       "internal_error"), status_code=500)


def _submit(state: ServeState, prepared: PreparedRequest) -> RequestGroup:
    try:
        return state.worker.submit(prepared.requests, asyncio.get_running_loop())
    except QueueFullError as err:
        raise queue_full(str(err), err.retry_after_s) from None
    except EngineError as err:
        raise APIError(str(err)) from None
    except WorkerStopped as err:
        raise shutting_down(str(err)) from None


async def _respond(state: ServeState, prepared: PreparedRequest, request: Request, chat: bool) -> Response:
    group = _submit(state, prepared)
    rid, created = responses.new_id("chatcmpl" if chat else "cmpl"), responses.now()
    if prepared.stream:
        return StreamingResponse(_stream(group, prepared, request, rid, created, chat, state.poll_s),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    done = await _wait(group, request, state.poll_s)
    if done is None:
        return Response(status_code=CLIENT_CLOSED)
    build = responses.chat_completion if chat else responses.text_completion
    return JSONResponse(build(rid, created, prepared.model, done, prepared.prompt_tokens))


class _ClientWatch:
    """Notices a client that went away: a task that waits for the connection's next ASGI message.

    Once the body is read, the next message of an HTTP connection is ``http.disconnect``; waiting
    for it in a task (as Starlette's own streaming listener does) notices it when it comes, with no
    polling of the connection.
    """

    def __init__(self, request: Request) -> None:
        self.task = asyncio.ensure_future(self._listen(request))

    @staticmethod
    async def _listen(request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    @property
    def gone(self) -> bool:
        """The client disconnected."""
        return self.task.done() and not self.task.cancelled()

    def close(self) -> None:
        """Stops watching."""
        self.task.cancel()


async def _wait(group: RequestGroup, request: Request, poll_s: float) -> list[Completion] | None:
    """Every choice's completion, in order; None when the client went away (the choices are cancelled)."""
    watch = _ClientWatch(request)
    try:
        while not group.finished:
            await group.next_event(poll_s)
            if watch.gone:
                return None
        return [group.completions[i] for i in range(len(group.ids))]
    except WorkerStopped as err:
        raise shutting_down(str(err)) from None
    finally:
        watch.close()
        group.cancel()  # nothing left to cancel unless the client went away or the route was cancelled


async def _stream(group: RequestGroup, prepared: PreparedRequest, request: Request, rid: str, created: int,
                  chat: bool, poll_s: float) -> AsyncIterator[str]:
    """The server-sent events of a streamed call; closing or cancelling it cancels the unfinished choices."""
    model, with_usage = prepared.model, prepared.include_usage

    def chunk(index: int, text: str, finish: str | None = None) -> str:
        if chat:
            delta = {"content": text} if text else {}
            return responses.sse(responses.chat_chunk(rid, created, model, index, delta, finish, with_usage))
        return responses.sse(responses.text_chunk(rid, created, model, index, text, finish, with_usage))

    watch = _ClientWatch(request)
    try:
        if chat:
            for i in range(len(group.ids)):
                yield responses.sse(responses.chat_chunk(rid, created, model, i, {"role": "assistant", "content": ""},
                                                         None, with_usage))
        while not group.finished:
            event = await group.next_event(poll_s)
            if watch.gone:
                return
            if event is None:
                continue
            if event.text or event.completion is not None:
                finish = event.completion.finish_reason if event.completion is not None else None
                yield chunk(group.index(event.request_id), event.text, finish)
        if with_usage:
            generated = sum(len(c.token_ids) for c in group.completions.values())
            yield responses.sse(responses.usage_chunk("chat.completion.chunk" if chat else "text_completion", rid,
                                                      created, model, prepared.prompt_tokens, generated))
        yield responses.SSE_DONE
    except WorkerStopped as err:
        yield responses.sse(shutting_down(str(err)).body())
        yield responses.SSE_DONE
    finally:
        watch.close()
        group.cancel()
