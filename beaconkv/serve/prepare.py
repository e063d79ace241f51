"""A parsed request body checked against the running engine and turned into engine requests.

:func:`prepare_chat` and :func:`prepare_completion` take a body :func:`~beaconkv.serve.schema.parse_body` read
and check what types cannot say — ranges, the model name, the limits of the running engine — and encode the
prompt, returning a :class:`PreparedRequest`: one :class:`~beaconkv.engine.Request` per choice (``n`` choices per
prompt, choice ``i`` seeded ``seed + i``). Every problem is an :class:`~beaconkv.serve.errors.APIError` naming the
field, the value and the fix, so the engine itself never sees a request it would refuse. A call whose answer could
hold more than ``max_answer_tokens`` tokens (:func:`~beaconkv.serve.limits.check_answer_size`) is refused before
anything is rendered or tokenized; a prompt longer than ``max_prompt_chars`` characters is refused before it is
tokenized. A chat's special-token text in message contents is kept as text or refused
(:mod:`beaconkv.serve.special_tokens`), and its chat template renders through a stoppable call
(:meth:`~beaconkv.serve.prepare_pool.PrepareJob.interruptible`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from jinja2.exceptions import TemplateError

from ..engine import MAX_STOP_CHARS, MAX_STOP_STRINGS, Engine, EngineError, Request
from ..generation import encode_prompts
from ..sampling import MAX_LOGPROBS, SamplingError, SamplingParams
from ..tokenizer import Tokenizer
from .errors import APIError, model_not_found
from .limits import check_answer_size
from .schema import (
    INT64,
    MAX_CHOICES,
    RESERVED_TEMPLATE_KWARGS,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    check_prompt,
    refuse_unsupported,
)
from .special_tokens import SpecialTokenText

__all__ = ["PreparedRequest", "parse_logit_bias", "prepare_chat", "prepare_completion", "resolve_model"]


@dataclass
class PreparedRequest:
    """A checked call, ready to submit.

    Attributes:
        model: The served model name it asked for.
        requests: One engine request per choice (choice ``i`` is ``requests[i]``).
        prompt_tokens: Prompt tokens of the call, each distinct prompt counted once (``usage``).
        stream: Whether to answer with server-sent events.
        include_usage: Whether a stream ends with a usage chunk.
        logprobs: The alternatives asked for at each token (None: no log-probabilities).
    """

    model: str
    requests: list[Request]
    prompt_tokens: int
    stream: bool
    include_usage: bool
    logprobs: int | None = None


def resolve_model(name: str | None, served: Sequence[str]) -> str:
    """The served model a call names.

    Args:
        name: The ``model`` field (None: the first served name).
        served: The names this server answers to.

    Raises:
        APIError: An unknown name (HTTP 404, code ``model_not_found``, as OpenAI and vLLM answer).
    """
    if name is None:
        return served[0]
    if name not in served:
        raise model_not_found(name, served)
    return name


_TOKEN_ID = re.compile(r"[0-9]+")


def parse_logit_bias(value: dict[str, float] | None, vocab_size: int) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (token ids written as decimal strings, to biases) as ``{token id: bias}``.

    Args:
        value: ``{"50256": -100, ...}`` (None: no bias).
        vocab_size: Ids must lie in ``0 .. vocab_size - 1``.

    Raises:
        APIError: A key that is not a decimal token id, an id outside the vocabulary, or a token named
            twice (``"7"`` and ``"07"``).
    """
    out: dict[int, float] = {}
    for key, bias in (value or {}).items():
        if not _TOKEN_ID.fullmatch(key):
            shown = repr(key) if len(key) <= 40 else repr(key[:37] + "...")
            raise APIError(f"logit_bias key {shown} is not a token id; keys are token ids written as decimal "
                           "strings, e.g. {\"42\": -100}.", param="logit_bias")
        token = int(key)
        if token >= vocab_size:
            raise APIError(f"logit_bias key {key!r} is outside the vocabulary 0 .. {vocab_size - 1} of this model; "
                           "bias this model's token ids.", param="logit_bias")
        if token in out:
            raise APIError(f"logit_bias names token {token} twice; give each token once.", param="logit_bias")
        out[token] = bias
    return out


def _sampling(body: SamplingFields, logprobs: int | None, vocab_size: int) -> SamplingParams:
    top_k = 0 if body.top_k in (None, -1) else body.top_k
    try:
        return SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=top_k,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            logit_bias=parse_logit_bias(body.logit_bias, vocab_size),
            logprobs=logprobs,
        )
    except SamplingError as err:
        raise APIError(str(err), param=err.field.split("[")[0]) from None


def _stops(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not s for s in stops):
        raise APIError(f"stop={stop!r} holds an empty string; every stop string needs at least one character.",
                       param="stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise APIError(f"stop holds {len(stops)} strings, more than {MAX_STOP_STRINGS}; give fewer.", param="stop")
    long = [s for s in stops if len(s) > MAX_STOP_CHARS]
    if long:
        raise APIError(f"a stop string has {len(long[0])} characters, more than {MAX_STOP_CHARS}; shorten it.",
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


def _choices(body: SamplingFields, prompts: int) -> int:
    n = 1 if body.n is None else body.n
    if n < 1:
        raise APIError(f"n={n} must be >= 1.", param="n")
    if n * prompts > MAX_CHOICES:
        raise APIError(f"n={n} for {prompts} prompt(s) asks for {n * prompts} choices, more than "
                       f"{MAX_CHOICES}; split the call.", param="n")
    return n


def _seed(seed: int | None) -> int | None:
    lo, hi = INT64
    if seed is not None and not lo <= seed <= hi:
        raise APIError(f"seed={seed} is outside [{lo}, {hi}] (int64).", param="seed")
    return seed


def _check_text(text: str, param: str, engine: Engine, max_chars: int | None) -> None:
    """A text about to be tokenized: at most ``max_chars`` characters, and valid Unicode (JSON's ``"\\udc00"``
    escapes a lone surrogate, which no tokenizer takes)."""
    if max_chars is not None and len(text) > max_chars:
        raise APIError(f"the prompt has {len(text)} characters, more than {max_chars}: no text that long fits "
                       f"in this server's prompt capacity of {engine.prompt_capacity} tokens (a token of this "
                       f"tokenizer stands for at most {max_chars // engine.prompt_capacity} characters); shorten "
                       f"it, or restart the server with a larger --prompt-capacity.", param=param,
                       code="context_length_exceeded")
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise APIError(f"{param} holds a lone surrogate (U+{ord(text[err.start]):04X}, at character {err.start}), "
                           "which is not a character; send valid Unicode.", param=param) from None


def _requests(body: SamplingFields, prompts: list[list[int]], n: int, params: SamplingParams, max_tokens: int,
              prompt_param: str, engine: Engine, tag: str) -> list[Request]:
    stops, seed = _stops(body.stop), _seed(body.seed)
    eos = [] if body.ignore_eos else None
    out = []
    for ids in prompts:
        check_prompt(ids, prompt_param, engine)
        for _ in range(n):
            i = len(out)
            choice_seed = None if seed is None else (seed + i) % 2**63
            out.append(Request(ids, max_tokens, params, seed=choice_seed, eos_token_ids=eos, stop=stops,
                               tag=(tag, i)))
    for r in out[:: n]:  # one check per prompt: ids outside the vocabulary, anything else the engine refuses
        try:
            engine.validate(r)
        except EngineError as err:
            raise APIError(str(err), param=prompt_param) from None
    return out


def _stream_flags(body: SamplingFields) -> tuple[bool, bool]:
    stream = bool(body.stream)
    return stream, stream and bool(body.stream_options and body.stream_options.include_usage)


def _top_logprobs(value: int | None, param: str) -> int:
    if value is None:
        return 0
    if not 0 <= value <= MAX_LOGPROBS:
        raise APIError(f"{param}={value} is outside [0, {MAX_LOGPROBS}] (the most likely tokens reported at each "
                       "token).", param=param)
    return value


def prepare_chat(body: ChatCompletionRequest, tokenizer: Tokenizer, engine: Engine,
                 served: Sequence[str], *, max_prompt_chars: int | None = None, max_answer_tokens: int | None = None,
                 special_tokens: SpecialTokenText | None = None,
                 interruptible: Callable[..., Any] | None = None) -> PreparedRequest:
    """Checks a chat call and renders its conversation with the chat template.

    Args:
        body: The parsed body.
        tokenizer: The served model's tokenizer (chat template included).
        engine: The running engine (its prompt capacity, token limit and vocabulary).
        served: The served model names.
        max_prompt_chars: Longest rendered conversation, in characters, that is tokenized at all
            (None: no bound).
        max_answer_tokens: Most ``n x max_tokens x (1 + top_logprobs)`` (None: no bound).
        special_tokens: What becomes of special-token text in message contents (None: it is tokenized as the
            special tokens it spells, as the template's own text).
        interruptible: Runs the template's render, ``interruptible(render, messages)``, so that it can be stopped
            (:meth:`~beaconkv.serve.prepare_pool.PrepareJob.interruptible`; None: a plain call).

    Returns:
        The call's engine requests and usage figures.

    Raises:
        APIError: An unknown model (404), an empty conversation, a value out of range, an unsupported
            feature, an answer too large, special-token text refused, a render that ran out of time, a prompt
            longer than a slot holds or more tokens than the server allows (400).
    """
    model = resolve_model(body.model, served)
    if not body.messages:
        raise APIError("messages is empty; send at least one {'role': 'user', 'content': ...} message.",
                       param="messages")
    refuse_unsupported(body)
    top = _top_logprobs(body.top_logprobs, "top_logprobs")
    if top and not body.logprobs:
        raise APIError(f"top_logprobs={top} needs logprobs=true.", param="top_logprobs")
    options = dict(body.chat_template_kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(options))
    if reserved:
        raise APIError(f"chat_template_kwargs may not set {', '.join(reserved)}; the server sets it.",
                       param="chat_template_kwargs")
    max_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = _max_tokens(body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens,
                             max_param, engine)
    n = _choices(body, 1)
    logprobs = top if body.logprobs else None
    if max_answer_tokens is not None:
        check_answer_size(n, max_tokens, logprobs or 0, max_answer_tokens)
    params = _sampling(body, logprobs, engine.vocab_size)
    messages = [m.as_template_message() for m in body.messages]
    marked = None
    if special_tokens is not None:
        marked = special_tokens.mark(messages, tokenizer.chat_template or "", repr(options))

    def render(conversation: list[dict[str, Any]]) -> Any:
        return tokenizer.apply_chat_template(conversation, **options)

    try:
        # the template is third-party code run on the client's values: any failure of it is the request's
        conversation = marked.messages if marked is not None else messages
        text = render(conversation) if interruptible is None else interruptible(render, conversation)
    except (ValueError, TypeError, TemplateError, RecursionError, ArithmeticError, LookupError,
            AttributeError) as err:
        raise APIError(f"the conversation cannot be rendered with the chat template: {err}", param="messages") from None
    if not isinstance(text, str) or not text:
        raise APIError("the chat template rendered this conversation as an empty prompt.", param="messages")
    spans: list[tuple[int, int]] = []
    if marked is not None:
        text, spans = marked.restore(text)
    _check_text(text, "messages", engine, max_prompt_chars)
    ids = special_tokens.encode(text, spans) if special_tokens is not None and spans else tokenizer.encode_prompt(text)
    stream, usage = _stream_flags(body)
    return PreparedRequest(model, _requests(body, [ids], n, params, max_tokens, "messages", engine, "chat"), len(ids),
                           stream, usage, logprobs)


def _prompt_count(prompt: Any) -> int:
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return 1
    return len(prompt)


def prepare_completion(body: CompletionRequest, tokenizer: Tokenizer, engine: Engine,
                       served: Sequence[str], *, max_prompt_chars: int | None = None,
                       max_answer_tokens: int | None = None) -> PreparedRequest:
    """Checks a text-completion call and encodes its prompt(s) as they are (no chat template).

    Args:
        body: The parsed body.
        tokenizer: The served model's tokenizer.
        engine: The running engine (its prompt capacity, token limit and vocabulary).
        served: The served model names.
        max_prompt_chars: Longest text prompt, in characters, that is tokenized at all (None: no bound).
        max_answer_tokens: Most ``choices x max_tokens x (1 + logprobs)`` (None: no bound).

    Returns:
        The call's engine requests (``n`` per prompt, prompt by prompt) and usage figures.

    Raises:
        APIError: An unknown model (404), an empty prompt, a value out of range, an unsupported
            feature, an answer too large, a prompt longer than a slot holds or more tokens than the server
            allows (400).
    """
    model = resolve_model(body.model, served)
    refuse_unsupported(body)
    logprobs = None if body.logprobs is None else _top_logprobs(body.logprobs, "logprobs")
    max_tokens = _max_tokens(body.max_tokens, "max_tokens", engine)
    count = _prompt_count(body.prompt)
    n = _choices(body, count)  # before encoding: a call of 10**6 prompts costs nothing
    if max_answer_tokens is not None:
        check_answer_size(n * count, max_tokens, logprobs or 0, max_answer_tokens, n=n, prompts=count,
                          top_param="logprobs")
    params = _sampling(body, logprobs, engine.vocab_size)
    texts = [body.prompt] if isinstance(body.prompt, str) else [p for p in body.prompt if isinstance(p, str)]
    for text in texts:
        _check_text(text, "prompt", engine, max_prompt_chars)
    try:
        prompts = encode_prompts(tokenizer, body.prompt)
    except (ValueError, TypeError) as err:
        raise APIError(str(err), param="prompt") from None
    stream, usage = _stream_flags(body)
    return PreparedRequest(model, _requests(body, prompts, n, params, max_tokens, "prompt", engine, "text"),
                           sum(len(p) for p in prompts), stream, usage, logprobs)
