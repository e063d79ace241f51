"""The FastAPI application: OpenAI-compatible routes over an :class:`~beaconkv.serve.worker.EngineWorker`.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (JSON, or server-sent events with
``"stream": true``), ``GET /v1/models``, ``GET /health`` and ``GET /metrics`` (Prometheus text).

Before a request is read, a ``Host`` that is not one of the server's names gets 400 and a body not declared
``application/json`` gets 415 (:class:`~beaconkv.serve.browsers.BrowserGuard`: a web page cannot drive the
server); a body over ``max_request_bytes`` gets 413 and one slower than ``body_timeout_s`` gets 408
(:class:`~beaconkv.serve.limits.BodyLimit`). A call is then checked and encoded
(:mod:`beaconkv.serve.schema`, :mod:`beaconkv.serve.prepare`) on a small pool of threads
(:class:`~beaconkv.serve.prepare_pool.PreparePool`)
— tokenizing never holds the event loop, so ``/health`` answers during any request; an answer larger than
``max_answer_tokens`` and a prompt too long to fit are refused before anything is tokenized; the chat template
renders with a time limit, and is stopped when its client leaves — submitted to the engine thread as one group
of ``n`` choices, and answered from the group's events. An answer's JSON is built and serialised on a thread,
a slice at a time (:func:`~beaconkv.serve.responses.json_bytes`), never on the event loop. Every error has
OpenAI's body (:mod:`beaconkv.serve.errors`): 400 for a bad request — FastAPI's own validation errors
included, which it would answer with 422 — 404 for an unknown model, 408, 413 and 415 as above, 429 with
``Retry-After`` when the queue is full, 500 for a request the engine failed on (alone: the others and the
server go on), 503 when the engine has stopped. ``/health`` says ``degraded`` (503) while every prepare thread
has been stuck on one call for a second. A client that goes away has its choices cancelled, freeing their
slots at the next step: every waiting route watches the connection for ``http.disconnect`` (a non-streamed
call has nothing to send until it ends) and looks at least every ``poll_s`` seconds, and a stream also ends
when its generator is cancelled or closed.
"""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import Completion, Engine, EngineError, QueueFullError, TokenLogprob
from ..tokenizer import Tokenizer
from . import responses
from .browsers import LOCAL_HOSTS, BrowserGuard
from .errors import (
    INVALID_REQUEST,
    SERVER_ERROR,
    APIError,
    error_body,
    from_validation_errors,
    queue_full,
    request_failed,
    shutting_down,
)
from .limits import BodyLimit, RequestLimits, max_token_chars
from .metrics import CONTENT_TYPE, render, server_metrics
from .prepare_pool import SATURATED_AFTER_S, PrepareJob, PreparePool
from .prepare import PreparedRequest, prepare_chat, prepare_completion
from .schema import ChatCompletionRequest, CompletionRequest, SamplingFields, parse_body
from .special_tokens import SpecialTokenText
from .worker import EngineWorker, RequestGroup, WorkerStopped

CLIENT_CLOSED = 499
"""Status logged for a call whose client went away before its answer (nobody reads it)."""
_REFUSALS = {400: "invalid_request", 404: "model_not_found", 413: "too_large", 429: "queue_full", 503: "unavailable"}
_CLIENT_GONE = APIError("the client went away before its call was prepared", status=CLIENT_CLOSED, code="client_closed")


@dataclass
class ServeState:
    """What the routes share.

    Attributes:
        worker: The engine thread.
        tokenizer: The served model's tokenizer.
        served: The names the server answers to (the first is the default).
        poll_s: Seconds between checks that a waiting client is still connected.
        max_prompt_chars: Longest prompt text tokenized at all (longer ones cannot fit in the prompt capacity).
        pool: The threads that check, render and tokenize calls (off the event loop).
        token_text: The text of single tokens (log-probabilities).
        limits: What one request may cost.
        special_tokens: What becomes of special-token text in chat messages (None: it stays special).
    """

    worker: EngineWorker
    tokenizer: Tokenizer
    served: list[str]
    poll_s: float = 0.5
    max_prompt_chars: int | None = None
    pool: PreparePool = field(default_factory=PreparePool)
    token_text: responses.TokenText | None = None
    limits: RequestLimits = field(default_factory=RequestLimits)
    special_tokens: SpecialTokenText | None = None

    @property
    def engine(self) -> Engine:
        """The engine the worker steps."""
        return self.worker.engine

    async def prepare(self, prepare: Callable[..., PreparedRequest], model: type[SamplingFields],
                      raw: bytes, request: Request | None = None) -> PreparedRequest | None:
        """Parses a raw body (:func:`~beaconkv.serve.schema.parse_body`) and prepares it (``prepare_chat`` or
        ``prepare_completion``) on the pool, off the event loop.

        Args:
            prepare: ``prepare_chat`` or ``prepare_completion``.
            model: The body's model.
            raw: The body.
            request: The HTTP request, watched for its client leaving (None: not watched).

        Returns:
            The prepared call; None when the client left first (its work is stopped: a render under way is
            interrupted, a call still waiting for a thread never runs).

        Raises:
            APIError: The call cannot be served as sent (a render that ran out of time included).
        """
        def work(job: PrepareJob) -> PreparedRequest | APIError:
            try:
                body = parse_body(model, raw, self.engine)
                options: dict[str, Any] = dict(max_prompt_chars=self.max_prompt_chars,
                                               max_answer_tokens=self.limits.max_answer_tokens)
                if prepare is prepare_chat:
                    options.update(special_tokens=self.special_tokens, interruptible=job.interruptible)
                return prepare(body, self.tokenizer, self.engine, self.served, **options)
            except APIError as err:  # returned, not raised: its frames (they hold the parsed body) die on this thread,
                err.__traceback__ = None  # not on the event loop (freeing 10**5 objects there stalls every call)
                return err

        try:
            job = self.pool.submit(work)
        except RuntimeError as err:  # the pool is closed: the server is stopping
            raise shutting_down(str(err)) from None
        assert job.future is not None
        done = asyncio.wrap_future(job.future)
        done.add_done_callback(lambda f: f.cancelled() or f.exception())  # nobody may read it: no warning
        watch = _ClientWatch(request) if request is not None else None
        try:
            waiting = {done} if watch is None else {done, watch.task}
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if not done.done():  # the client left
                job.interrupt(_CLIENT_GONE)
                return None
            if done.cancelled():  # stopped while it waited for a thread (the server is stopping)
                raise job.stopped or shutting_down()
            result = done.result()
        except asyncio.CancelledError:  # the route is cancelled (a shutdown that ran out of patience)
            job.interrupt(shutting_down())
            raise
        finally:
            if watch is not None:
                watch.close()
        if isinstance(result, APIError):
            raise result
        return result

    def interrupt_all(self) -> None:
        """Stops every call being prepared (a server that is stopping): each answers 503."""
        self.pool.interrupt_all(shutting_down())


def create_app(worker: EngineWorker, tokenizer: Tokenizer, served_names: Sequence[str], *,
               poll_s: float = 0.5, limits: RequestLimits | None = None,
               allowed_hosts: Sequence[str] | None = LOCAL_HOSTS, special_tokens: str | None = "escape",
               prepare_threads: int = 2) -> FastAPI:
    """The server's application. Its lifespan starts the worker's thread and stops it at shutdown.

    Args:
        worker: The engine thread (not started yet).
        tokenizer: The served model's tokenizer.
        served_names: The model names requests may ask for (at least one).
        poll_s: Seconds between checks that a waiting client is still connected.
        limits: What one request may cost (body size and time, answer size, template time; the defaults of
            :class:`~beaconkv.serve.limits.RequestLimits` when None).
        allowed_hosts: The ``Host`` names requests may use (see :func:`~beaconkv.serve.browsers.host_allowed`;
            ``["*"]`` or None: any). The default, localhost's names, suits a client on this machine; FastAPI's
            ``TestClient`` then needs ``base_url="http://localhost"``.
        special_tokens: Special-token text in chat messages: ``"escape"`` (read as plain text), ``"refuse"``
            (HTTP 400), or None (tokenized as the special tokens it spells, as before).
        prepare_threads: Threads that check, render and tokenize calls.

    Raises:
        ValueError: ``served_names`` is empty, ``prepare_threads`` below 1, or an unknown ``special_tokens``.
    """
    if not served_names:
        raise ValueError("served_names is empty; give the model at least one name.")
    limits = limits if limits is not None else RequestLimits()
    state = ServeState(worker, tokenizer, list(served_names), poll_s,
                       max_prompt_chars=worker.engine.prompt_capacity * max_token_chars(tokenizer),
                       pool=PreparePool(prepare_threads, limits.template_timeout_s),
                       token_text=responses.TokenText(tokenizer), limits=limits,
                       special_tokens=None if special_tokens is None else SpecialTokenText(tokenizer, special_tokens))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        worker.start()
        try:
            yield
        finally:
            state.pool.close()
            await asyncio.to_thread(worker.stop)

    app = FastAPI(title="beaconkv", summary="OpenAI-compatible API over beaconkv's continuous-batching engine",
                  lifespan=lifespan)
    app.state.serve = state
    _add_error_handlers(app, state)
    counters = worker.counters

    def refused(reason: str) -> None:
        counters.refused[reason] = counters.refused.get(reason, 0) + 1

    app.add_middleware(BodyLimit, max_bytes=limits.max_request_bytes, on_refuse=refused,
                       timeout_s=limits.body_timeout_s)
    app.add_middleware(BrowserGuard, allowed_hosts=allowed_hosts, on_refuse=refused)  # the outer one: runs first

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while the engine thread runs; 503 ``degraded`` while every prepare thread has been stuck on one
        call for a second (new calls wait), 503 ``unavailable`` once the engine thread stopped (with the reason)."""
        if not worker.alive:
            return JSONResponse({"status": "unavailable", "reason": worker.stop_reason}, status_code=503)
        busy, waiting, stuck_s = state.pool.saturation()
        figures = {"running": state.engine.running, "queued": state.engine.queued, "preparing": busy,
                   "waiting_to_prepare": waiting}
        if stuck_s >= SATURATED_AFTER_S:
            reason = (f"all {state.pool.threads} prepare threads have been busy for {stuck_s:.1f} s (slow "
                      f"chat-template renders; each stops after --template-timeout "
                      f"{state.pool.template_timeout_s:g} s); {waiting} calls wait for them")
            return JSONResponse({"status": "degraded", "reason": reason, **figures}, status_code=503)
        return JSONResponse({"status": "ok", **figures})

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

    @app.post("/v1/chat/completions", openapi_extra=_request_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        """A chat completion: the conversation rendered with the chat template (body: ``ChatCompletionRequest``)."""
        prepared = await state.prepare(prepare_chat, ChatCompletionRequest, await request.body(), request)
        if prepared is None:
            return Response(status_code=CLIENT_CLOSED)
        return await _respond(state, prepared, request, chat=True)

    @app.post("/v1/completions", openapi_extra=_request_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        """A text completion of the prompt(s) as given (body: ``CompletionRequest``)."""
        prepared = await state.prepare(prepare_completion, CompletionRequest, await request.body(), request)
        if prepared is None:
            return Response(status_code=CLIENT_CLOSED)
        return await _respond(state, prepared, request, chat=False)

    def openapi() -> dict[str, Any]:
        """FastAPI's schema, with the two request bodies (parsed by the routes themselves) as components."""
        if app.openapi_schema is None:
            schema = FastAPI.openapi(app)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in (ChatCompletionRequest, CompletionRequest):
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


def _request_body(model: type[SamplingFields]) -> dict[str, Any]:
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def _add_error_handlers(app: FastAPI, state: ServeState) -> None:
    counters = state.worker.counters

    def answer(err: APIError) -> JSONResponse:
        reason = _REFUSALS.get(err.status)
        if reason is not None:
            counters.refused[reason] = counters.refused.get(reason, 0) + 1
        return ErrorResponse(err.body(), status_code=err.status, headers=err.headers or None)

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
        return ErrorResponse(error_body(message, kind, None, str(exc.status_code)), status_code=exc.status_code,
                             headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def server_error(_: Request, exc: Exception) -> JSONResponse:
        return ErrorResponse(error_body(f"internal server error ({type(exc).__name__}: {exc}).", SERVER_ERROR, None,
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
        return StreamingResponse(_stream(group, prepared, request, rid, created, chat, state),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    done = await _wait(group, request, state.poll_s)
    if done is None:
        return Response(status_code=CLIENT_CLOSED)
    failed = [c for c in done if c.finish_reason == "error"]
    if failed:
        raise request_failed(failed[0].error or "the request failed")
    build = responses.chat_completion if chat else responses.text_completion

    def answer() -> bytes:  # on a thread: an answer may hold 10**6 log-probabilities
        return responses.json_bytes(build(rid, created, prepared.model, done, prepared.prompt_tokens,
                                          state.token_text))

    return Response(await asyncio.to_thread(answer), media_type="application/json")


class ErrorResponse(JSONResponse):
    """An error's JSON, all ASCII: a message may quote what the client sent, lone surrogates included, and
    ``ensure_ascii`` escapes them (UTF-8 cannot encode them)."""

    def render(self, content: Any) -> bytes:
        """The JSON bytes (``\\uXXXX`` escapes for every non-ASCII character)."""
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


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
                  chat: bool, state: ServeState) -> AsyncIterator[str]:
    """The server-sent events of a streamed call; closing or cancelling it cancels the unfinished choices.

    A choice's log-probabilities ride with its text: a token whose text is held back (part of a
    character, or of a possible stop string) has its entry sent with the next chunk of that choice.
    """
    model, with_usage, poll_s, text_of = prepared.model, prepared.include_usage, state.poll_s, state.token_text
    pending: dict[int, list[TokenLogprob]] = defaultdict(list)
    offsets: dict[int, int] = defaultdict(int)

    def logprobs(index: int) -> dict[str, Any] | None:
        if prepared.logprobs is None or text_of is None:
            return None
        entries = pending.pop(index, [])
        if chat:
            return responses.chat_logprobs(entries, text_of)
        out = responses.text_logprobs(entries, text_of, offsets[index])
        offsets[index] += sum(len(t) for t in out["tokens"])
        return out

    def chunk(index: int, text: str, finish: str | None = None) -> str:
        if chat:
            delta = {"content": text} if text else {}
            return responses.sse(responses.chat_chunk(rid, created, model, index, delta, finish, with_usage,
                                                      logprobs(index)))
        return responses.sse(responses.text_chunk(rid, created, model, index, text, finish, with_usage,
                                                  logprobs(index)))

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
            if event.completion is not None and event.completion.finish_reason == "error":
                yield responses.sse(request_failed(event.completion.error or "the request failed").body(), ascii=True)
                yield responses.SSE_DONE
                return
            if event.logprob is not None:
                pending[group.index(event.request_id)].append(event.logprob)
            if event.text or event.completion is not None:
                finish = event.completion.finish_reason if event.completion is not None else None
                yield chunk(group.index(event.request_id), event.text, finish)
        if with_usage:
            generated = sum(len(c.token_ids) for c in group.completions.values())
            yield responses.sse(responses.usage_chunk("chat.completion.chunk" if chat else "text_completion", rid,
                                                      created, model, prepared.prompt_tokens, generated))
        yield responses.SSE_DONE
    except WorkerStopped as err:
        yield responses.sse(shutting_down(str(err)).body(), ascii=True)
        yield responses.SSE_DONE
    finally:
        watch.close()
        group.cancel()
