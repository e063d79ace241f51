"""The OpenAI request bodies the server accepts, and their translation into engine requests.

FastAPI parses a body into :class:`ChatCompletionRequest` or :class:`CompletionRequest` (types
only: a value of the wrong type fails there, with HTTP 400). :func:`prepare_chat` and
:func:`prepare_completion` then check what types cannot say — ranges, the model name, the limits
of the running engine — and encode the prompt, returning a :class:`PreparedRequest`: one
:class:`~beaconkv.engine.Request` per choice (``n`` choices per prompt, choice ``i`` seeded
``seed + i``). Every problem is an :class:`~beaconkv.serve.errors.APIError` naming the field, the
value and the fix, so the engine itself never sees a request it would refuse.

Fields OpenAI defines but beaconkv cannot honour (log-probabilities, ``echo``, tools, structured
output) are refused rather than silently ignored; unknown extra fields are ignored, as OpenAI-style
clients send many.
"""

from __future__ import annotations

import math

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from jinja2.exceptions import TemplateError
from pydantic import BaseModel, ConfigDict

from ..engine import Engine, EngineError, Request
from ..generation import encode_prompts
from ..sampling import SamplingParams
from ..tokenizer import Tokenizer
from .errors import APIError

MAX_CHOICES = 128
"""Most choices (``n`` times the number of prompts) one call may ask for."""
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tokenize"})
"""``chat_template_kwargs`` keys the server sets itself."""


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    """``stream_options`` of a streamed call.

    Attributes:
        include_usage: Send a last chunk (no choices) with the call's token usage.
    """

    include_usage: bool | None = False


class TextPart(_Body):
    """One part of a message's content given as a list (only text parts are supported).

    Attributes:
        type: ``"text"``.
        text: The text.
    """

    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    """One message of a conversation.

    Attributes:
        role: ``system``, ``developer`` (read as ``system``), ``user`` or ``assistant``.
        content: A string, or a list of text parts (joined with newlines).
        name: Ignored (accepted for compatibility).
    """

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def as_template_message(self) -> dict[str, str]:
        """The ``{"role", "content"}`` dict the chat template renders."""
        text = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class SamplingFields(_Body):
    """The fields both endpoints share (None means the default, as OpenAI's clients may send ``null``).

    Attributes:
        model: The served model's name (None: the served model).
        max_tokens: Most new tokens per choice (None: the server's ``--max-new-tokens``).
        temperature: 0 = greedy (default 1, as OpenAI's).
        top_p: Nucleus mass kept, in (0, 1] (default 1).
        top_k: Keep only the k most likely tokens (0 or -1 = off; a vLLM extension).
        seed: Seeds choice ``i`` with ``seed + i`` (None: the server's seed sequence).
        stop: A string or strings that end a choice; its text ends before the first one.
        n: Choices per prompt, each an independent request.
        stream: Send server-sent events as tokens come.
        stream_options: ``{"include_usage": true}`` adds a usage chunk at the end of a stream.
        ignore_eos: Generate ``max_tokens`` tokens whatever the model says (a vLLM extension).
        user: Ignored.
    """

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False
    user: str | None = None


class CompletionRequest(SamplingFields):
    """The body of ``POST /v1/completions``.

    Attributes:
        prompt: A text, a list of texts, token ids, or a list of token-id lists (each a prompt).
        echo: Not supported (must be false).
        logprobs: Not supported (must be null or 0).
        suffix: Not supported (must be null).
    """

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None


class ChatCompletionRequest(SamplingFields):
    """The body of ``POST /v1/chat/completions``.

    Attributes:
        messages: The conversation, rendered with the model's chat template.
        max_completion_tokens: OpenAI's newer name of ``max_tokens`` (wins when both are set).
        chat_template_kwargs: Variables of the chat template, e.g. ``{"enable_thinking": false}``
            (passed through as vLLM does).
        logprobs: Not supported (must be false).
        top_logprobs: Not supported (must be null).
        tools: Not supported (must be empty).
        response_format: Only ``{"type": "text"}``.
    """

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None


@dataclass
class PreparedRequest:
    """A checked call, ready to submit.

    Attributes:
        model: The served model name it asked for.
        requests: One engine request per choice (choice ``i`` is ``requests[i]``).
        prompt_tokens: Prompt tokens of the call, each distinct prompt counted once (``usage``).
        stream: Whether to answer with server-sent events.
        include_usage: Whether a stream ends with a usage chunk.
    """

    model: str
    requests: list[Request]
    prompt_tokens: int
    stream: bool
    include_usage: bool


def resolve_model(name: str | None, served: Sequence[str]) -> str:
    """The served model a call names.

    Args:
        name: The ``model`` field (None: the first served name).
        served: The names this server answers to.

    Raises:
        APIError: An unknown name (HTTP 400, code ``model_not_found``).
    """
    if name is None:
        return served[0]
    if name not in served:
        raise APIError(f"model={name!r} is not served here; this server serves {', '.join(map(repr, served))} "
                       "(see GET /v1/models).", param="model", code="model_not_found")
    return name


def _sampling(body: SamplingFields) -> SamplingParams:
    temperature = 1.0 if body.temperature is None else body.temperature
    top_p = 1.0 if body.top_p is None else body.top_p
    top_k = 0 if body.top_k in (None, -1) else body.top_k
    if not math.isfinite(temperature) or temperature < 0:
        raise APIError(f"temperature={temperature} must be a finite number >= 0 (0 = greedy).", param="temperature")
    if not 0 < top_p <= 1:  # false for NaN too
        raise APIError(f"top_p={top_p} must lie in (0, 1]; 1 keeps every token.", param="top_p")
    if top_k < 0:
        raise APIError(f"top_k={top_k} must be >= 0 (0 or -1 = off).", param="top_k")
    return SamplingParams(temperature, top_p, top_k)


def _stops(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not s for s in stops):
        raise APIError(f"stop={stop!r} holds an empty string; every stop string needs at least one character.",
                       param="stop")
    return stops


def _max_tokens(value: int | None, param: str, engine: Engine) -> int:
    if value is None:
        return engine.max_new_tokens
    if value < 1:
        raise APIError(f"{param}={value} must be >= 1.", param=param)
    if value > engine.max_new_tokens:
        raise APIError(f"{param}={value} is more than this server's limit of {engine.max_new_tokens} new tokens; "
                       f"ask for fewer, or restart the server with --max-new-tokens >= {value}.", param=param)
    return value


def _check_prompt(ids: Sequence[int], param: str, engine: Engine) -> None:
    if len(ids) > engine.prompt_capacity:
        raise APIError(f"the prompt has {len(ids)} tokens, more than this server's prompt capacity of "
                       f"{engine.prompt_capacity}; shorten it, or restart the server with --prompt-capacity >= "
                       f"{len(ids)}.", param=param, code="context_length_exceeded")


def _requests(body: SamplingFields, prompts: list[list[int]], max_tokens: int, prompt_param: str,
              engine: Engine, tag: str) -> list[Request]:
    n = 1 if body.n is None else body.n
    if n < 1:
        raise APIError(f"n={n} must be >= 1.", param="n")
    if n * len(prompts) > MAX_CHOICES:
        raise APIError(f"n={n} for {len(prompts)} prompt(s) asks for {n * len(prompts)} choices, more than "
                       f"{MAX_CHOICES}; split the call.", param="n")
    params, stops = _sampling(body), _stops(body.stop)
    eos = [] if body.ignore_eos else None
    out = []
    for ids in prompts:
        _check_prompt(ids, prompt_param, engine)
        for _ in range(n):
            i = len(out)
            seed = None if body.seed is None else (body.seed + i) % 2**63
            out.append(Request(ids, max_tokens, params, seed=seed, eos_token_ids=eos, stop=stops, tag=(tag, i)))
    for r in out[:: n]:  # one check per prompt: ids outside the vocabulary, anything else the engine refuses
        try:
            engine.validate(r)
        except EngineError as err:
            raise APIError(str(err), param=prompt_param) from None
    return out


def _stream_flags(body: SamplingFields) -> tuple[bool, bool]:
    stream = bool(body.stream)
    return stream, stream and bool(body.stream_options and body.stream_options.include_usage)


def prepare_chat(body: ChatCompletionRequest, tokenizer: Tokenizer, engine: Engine,
                 served: Sequence[str]) -> PreparedRequest:
    """Checks a chat call and renders its conversation with the chat template.

    Args:
        body: The parsed body.
        tokenizer: The served model's tokenizer (chat template included).
        engine: The running engine (its prompt capacity and token limit).
        served: The served model names.

    Returns:
        The call's engine requests and usage figures.

    Raises:
        APIError: An unknown model, an empty conversation, a value out of range, an unsupported
            feature, a prompt longer than a slot holds or more tokens than the server allows.
    """
    model = resolve_model(body.model, served)
    if not body.messages:
        raise APIError("messages is empty; send at least one {'role': 'user', 'content': ...} message.",
                       param="messages")
    if body.logprobs or body.top_logprobs:
        raise APIError("logprobs are not supported by beaconkv serve; leave logprobs and top_logprobs unset.",
                       param="logprobs", code="unsupported")
    if body.tools:
        raise APIError("tools are not supported by beaconkv serve; leave tools unset.", param="tools",
                       code="unsupported")
    if body.response_format and body.response_format.get("type", "text") != "text":
        raise APIError(f"response_format={body.response_format!r} is not supported; only {{'type': 'text'}} is.",
                       param="response_format", code="unsupported")
    options = dict(body.chat_template_kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(options))
    if reserved:
        raise APIError(f"chat_template_kwargs may not set {', '.join(reserved)}; the server sets it.",
                       param="chat_template_kwargs")
    max_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = _max_tokens(body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens,
                             max_param, engine)
    try:
        ids = encode_prompts(tokenizer, [[m.as_template_message() for m in body.messages]],
                             chat_template_kwargs=options)[0]
    except (ValueError, TypeError, TemplateError) as err:
        raise APIError(f"the conversation cannot be rendered with the chat template: {err}", param="messages") from None
    stream, usage = _stream_flags(body)
    return PreparedRequest(model, _requests(body, [ids], max_tokens, "messages", engine, "chat"), len(ids), stream, usage)


def prepare_completion(body: CompletionRequest, tokenizer: Tokenizer, engine: Engine,
                       served: Sequence[str]) -> PreparedRequest:
    """Checks a text-completion call and encodes its prompt(s) as they are (no chat template).

    Args:
        body: The parsed body.
        tokenizer: The served model's tokenizer.
        engine: The running engine (its prompt capacity and token limit).
        served: The served model names.

    Returns:
        The call's engine requests (``n`` per prompt, prompt by prompt) and usage figures.

    Raises:
        APIError: An unknown model, an empty prompt, a value out of range, an unsupported feature,
            a prompt longer than a slot holds or more tokens than the server allows.
    """
    model = resolve_model(body.model, served)
    if body.echo:
        raise APIError("echo is not supported by beaconkv serve; leave it false.", param="echo", code="unsupported")
    if body.logprobs:
        raise APIError("logprobs are not supported by beaconkv serve; leave logprobs unset.", param="logprobs",
                       code="unsupported")
    if body.suffix:
        raise APIError("suffix is not supported by beaconkv serve; leave it unset.", param="suffix",
                       code="unsupported")
    max_tokens = _max_tokens(body.max_tokens, "max_tokens", engine)
    try:
        prompts = encode_prompts(tokenizer, body.prompt)
    except (ValueError, TypeError) as err:
        raise APIError(str(err), param="prompt") from None
    stream, usage = _stream_flags(body)
    return PreparedRequest(model, _requests(body, prompts, max_tokens, "prompt", engine, "text"),
                           sum(len(p) for p in prompts), stream, usage)

