"""The OpenAI request bodies the server accepts, and their translation into engine requests.

:func:`parse_body` reads a raw body into :class:`ChatCompletionRequest` or
:class:`CompletionRequest`: JSON, then cheap size bounds on the raw value (no more prompts than
choices a call may have, no token-id list or conversation longer than the prompt capacity), then
the types (a value of the wrong type fails with HTTP 400). :func:`prepare_chat` and
:func:`prepare_completion` then check what types cannot say — ranges, the model name, the limits
of the running engine — and encode the prompt, returning a :class:`PreparedRequest`: one
:class:`~beaconkv.engine.Request` per choice (``n`` choices per prompt, choice ``i`` seeded
``seed + i``). Every problem is an :class:`~beaconkv.serve.errors.APIError` naming the field, the
value and the fix, so the engine itself never sees a request it would refuse. A call whose answer could
hold more than ``max_answer_tokens`` tokens (:func:`~beaconkv.serve.limits.check_answer_size`) is refused
before anything is rendered or tokenized; a prompt longer than ``max_prompt_chars`` characters (one that
cannot fit in the prompt capacity, see :func:`~beaconkv.serve.limits.max_token_chars`) is refused before it
is tokenized. A chat's special-token text in message contents is kept as text or refused
(:mod:`beaconkv.serve.special_tokens`), and its chat template renders through a stoppable call
(:meth:`~beaconkv.serve.prepare_pool.PrepareJob.interruptible`). The app runs all of this on worker threads:
token-id prompts are checked in Python (which lets the event loop run every few milliseconds), not in one
long pydantic call.

Every field of OpenAI's two create-calls is either implemented, refused with HTTP 400 when set to
anything that would change the answer (:data:`REFUSED_FIELDS`), or accepted and ignored because it
cannot change the answer (:data:`IGNORED_FIELDS`: metadata and caching hints). vLLM's sampling
extensions beaconkv does not implement are refused the same way; other unknown fields are ignored,
as OpenAI-style clients send many.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from jinja2.exceptions import TemplateError
from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError, WithJsonSchema

from ..engine import MAX_STOP_CHARS, MAX_STOP_STRINGS, Engine, EngineError, Request
from ..generation import encode_prompts
from ..sampling import MAX_LOGPROBS, SamplingError, SamplingParams
from ..tokenizer import Tokenizer
from .errors import APIError, from_validation_errors, model_not_found
from .limits import check_answer_size
from .special_tokens import SpecialTokenText

MAX_CHOICES = 128
"""Most choices (``n`` times the number of prompts) one call may ask for."""
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tokenize"})
"""``chat_template_kwargs`` keys the server sets itself."""
INT64 = (-(2**63), 2**63 - 1)
"""The range of ``seed`` (OpenAI's int64)."""

IGNORED_FIELDS = frozenset({
    "user", "store", "metadata", "service_tier", "safety_identifier", "prompt_cache_key", "prompt_cache_options",
    "prompt_cache_retention", "parallel_tool_calls",
})
"""OpenAI fields accepted and ignored: they tag, store or route a call, and cannot change its answer."""

REFUSED_FIELDS: dict[str, str] = {
    "echo": "false", "suffix": "null or empty", "best_of": "null or 1",
    "tools": "null or empty", "tool_choice": "null, 'none' or 'auto'", "functions": "null or empty",
    "function_call": "null, 'none' or 'auto'", "response_format": "null or {'type': 'text'}", "audio": "null",
    "modalities": "null or ['text']", "prediction": "null", "reasoning_effort": "null", "verbosity": "null",
    "web_search_options": "null", "moderation": "null",
    # vLLM's sampling extensions that beaconkv does not implement
    "repetition_penalty": "null or 1", "min_p": "null or 0", "min_tokens": "null or 0",
    "use_beam_search": "null or false", "length_penalty": "null or 1", "stop_token_ids": "null or empty",
    "prompt_logprobs": "null", "guided_json": "null", "guided_regex": "null", "guided_choice": "null",
    "guided_grammar": "null", "structured_outputs": "null",
}
"""Fields refused with HTTP 400 (code ``unsupported``) unless they hold the value given here, which
means "off" (OpenAI's features beaconkv does not have, and vLLM's sampling extensions)."""

_OFF: dict[str, tuple[Any, ...]] = {
    "echo": (None, False), "suffix": (None, ""), "best_of": (None, 1), "tools": (None, []),
    "tool_choice": (None, "none", "auto"), "functions": (None, []), "function_call": (None, "none", "auto"),
    "modalities": (None, ["text"]), "repetition_penalty": (None, 1, 1.0), "min_p": (None, 0, 0.0),
    "min_tokens": (None, 0), "use_beam_search": (None, False), "length_penalty": (None, 1, 1.0),
    "stop_token_ids": (None, []),
}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    """``stream_options`` of a streamed call.

    Attributes:
        include_usage: Send a last chunk (no choices) with the call's token usage.
        include_obfuscation: Ignored (OpenAI pads chunks with it; there is nothing to pad here).
    """

    include_usage: bool | None = False
    include_obfuscation: bool | None = None


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

    Accepted and ignored (see :data:`IGNORED_FIELDS`): ``user``, ``store``, ``metadata``,
    ``service_tier``, ``safety_identifier``, ``prompt_cache_key``, ``prompt_cache_options``,
    ``prompt_cache_retention``. vLLM extensions beaconkv does not implement, refused unless off
    (see :data:`REFUSED_FIELDS`): ``repetition_penalty``, ``min_p``, ``min_tokens``,
    ``use_beam_search``, ``length_penalty``, ``stop_token_ids``, ``prompt_logprobs``,
    ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``, ``structured_outputs``.

    Attributes:
        model: The served model's name (None: the served model; an unknown one gets HTTP 404).
        max_tokens: Most new tokens per choice (None: the server's ``--max-new-tokens``).
        temperature: 0 = greedy (default 1, as OpenAI's); below 1e-5 decodes greedily too; at most
            the largest float32.
        top_p: Nucleus mass kept, in (0, 1] (default 1).
        top_k: Keep only the k most likely tokens (0 or -1 = off; a vLLM extension), at most 2**63 - 1.
        presence_penalty: In [-2, 2]: subtracted from the logit of every token this choice generated.
        frequency_penalty: In [-2, 2]: times how often this choice generated a token, subtracted from its logit.
        logit_bias: ``{"token id": bias}``, bias in [-100, 100], added to those tokens' logits.
        seed: Seeds choice ``i`` with ``seed + i`` (None: the server's seed sequence); an int64.
        stop: A string or strings (at most 16, of at most 1024 characters) that end a choice; its text
            ends before the first one.
        n: Choices per prompt, each an independent request.
        stream: Send server-sent events as tokens come.
        stream_options: ``{"include_usage": true}`` adds a usage chunk at the end of a stream.
        ignore_eos: Generate ``max_tokens`` tokens whatever the model says (a vLLM extension).
    """

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False
    user: Any = None
    store: Any = None
    metadata: Any = None
    service_tier: Any = None
    safety_identifier: Any = None
    prompt_cache_key: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: Any = None
    repetition_penalty: Any = None
    min_p: Any = None
    min_tokens: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    stop_token_ids: Any = None
    prompt_logprobs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None


Prompt = str | list[str] | list[int] | list[list[int]]
"""What ``prompt`` may be: a text, a list of texts, token ids, or a list of token-id lists."""


class CompletionRequest(SamplingFields):
    """The body of ``POST /v1/completions``.

    Attributes:
        prompt: A text, a list of texts, token ids, or a list of token-id lists (each a prompt);
            checked by :func:`parse_body` (in Python: a list of 10**6 ids is no single long call).
        logprobs: The log-probabilities of each generated token and of the ``logprobs`` most likely
            ones (0 to 20; null: none).
        echo: Not supported (must be false).
        suffix: Not supported (must be null or empty).
        best_of: Not supported (must be null or 1).
    """

    prompt: Annotated[Any, WithJsonSchema(TypeAdapter(Prompt).json_schema())]
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None


class ChatCompletionRequest(SamplingFields):
    """The body of ``POST /v1/chat/completions``.

    Refused unless off (see :data:`REFUSED_FIELDS`): ``tools``, ``tool_choice``, ``functions``,
    ``function_call``, ``response_format``, ``audio``, ``modalities``, ``prediction``,
    ``reasoning_effort``, ``verbosity``, ``web_search_options``, ``moderation``. Ignored:
    ``parallel_tool_calls`` (no tools).

    Attributes:
        messages: The conversation, rendered with the model's chat template.
        max_completion_tokens: OpenAI's newer name of ``max_tokens`` (wins when both are set).
        chat_template_kwargs: Variables of the chat template, e.g. ``{"enable_thinking": false}``
            (passed through as vLLM does).
        logprobs: Return the log-probability of each generated token.
        top_logprobs: With ``logprobs``, also the ``top_logprobs`` most likely tokens at each one (0 to 20).
    """

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    parallel_tool_calls: Any = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    moderation: Any = None


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


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _prompt_value(value: Any) -> Prompt:
    """``prompt`` checked to be one of :data:`Prompt` (lists are walked in Python, a few ms at a time)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        if all(isinstance(p, str) for p in value) or all(type(p) is int for p in value):
            return value
        if all(isinstance(p, list) for p in value):
            for i, p in enumerate(value):
                bad = next((t for t in p if type(t) is not int), None)
                if bad is not None:
                    raise APIError(f"prompt.{i} holds {_shown(bad)}; a token-id prompt is a list of ints.",
                                   param="prompt", code="invalid_type")
            return value
    raise APIError(f"prompt={_shown(value)} must be a text, a list of texts, a list of token ids or a list of "
                   "token-id lists.", param="prompt", code="invalid_type")


def _check_sizes(raw: dict[str, Any], engine: Engine) -> None:
    """Bounds on the raw body that need no parsing into models: counts of prompts and messages, id-list lengths."""
    messages, prompt = raw.get("messages"), raw.get("prompt")
    if isinstance(messages, list) and len(messages) > engine.prompt_capacity:
        raise APIError(f"the conversation has {len(messages)} messages, more than this server's prompt capacity of "
                       f"{engine.prompt_capacity} tokens can hold (a chat template renders each message as one "
                       "token at least); shorten it, or restart the server with a larger --prompt-capacity.",
                       param="messages", code="context_length_exceeded")
    if not isinstance(prompt, list) or not prompt:
        return
    if isinstance(prompt[0], (str, list)) and len(prompt) > MAX_CHOICES:
        raise APIError(f"prompt holds {len(prompt)} prompts, more than the {MAX_CHOICES} choices a call may ask "
                       "for; split the call.", param="prompt")
    if isinstance(prompt[0], int):
        _check_prompt(prompt, "prompt", engine)  # one prompt of token ids
    for ids in prompt:
        if isinstance(ids, list):
            _check_prompt(ids, "prompt", engine)


_PARSING = threading.Lock()
"""One body at a time: ``json.loads`` and pydantic hold the GIL for a whole call (0.1 s per MiB of token ids),
and two threads parsing back to back would hold the event loop for both."""


def parse_body(model: type[SamplingFields], raw: bytes, engine: Engine) -> SamplingFields:
    """A raw request body as ``model`` (:class:`ChatCompletionRequest` or :class:`CompletionRequest`).

    JSON (``NaN`` and ``Infinity`` read as Python does, and then refused by the range checks), then
    :func:`_check_sizes` on the raw value, then the model's types, then ``prompt``'s. Thread-safe; the
    two steps that hold the GIL run one body at a time.

    Args:
        model: The body's model.
        raw: The body's bytes.
        engine: The running engine (the prompt capacity bounds the sizes).

    Raises:
        APIError: Not JSON, not an object, more prompts or messages or token ids than can be served,
            or a value of the wrong type (HTTP 400).
    """
    try:
        with _PARSING:
            value = json.loads(raw)
    except json.JSONDecodeError as err:
        raise APIError(f"the request body is not valid JSON ({err.msg} at position {err.pos}); send a JSON object.",
                       code="invalid_json") from None
    except (ValueError, RecursionError) as err:  # bad UTF-8, an integer of more than 4300 digits, deep nesting
        raise APIError(f"the request body is not valid JSON ({type(err).__name__}: {str(err)[:200]}); send a JSON "
                       "object.", code="invalid_json") from None
    if not isinstance(value, dict):
        raise APIError(f"the request body must be a JSON object, got {type(value).__name__} {_shown(value)}.",
                       code="invalid_type")
    _check_sizes(value, engine)
    try:
        with _PARSING:
            body = model.model_validate(value)
    except ValidationError as err:
        raise from_validation_errors(list(err.errors())) from None
    if isinstance(body, CompletionRequest):
        body.prompt = _prompt_value(body.prompt)
    return body


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


def _refuse_unsupported(body: BaseModel) -> None:
    for name, off in REFUSED_FIELDS.items():
        if name not in type(body).model_fields:
            continue
        value = getattr(body, name)
        if name == "response_format":
            ok = value is None or value.get("type", "text") == "text"
        else:
            ok = value in _OFF.get(name, (None,))
        if not ok:
            shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
            raise APIError(f"{name}={shown} is not supported by beaconkv serve; leave it {off}.", param=name,
                           code="unsupported")


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


def _check_prompt(ids: Sequence[int], param: str, engine: Engine) -> None:
    if len(ids) > engine.prompt_capacity:
        raise APIError(f"the prompt has {len(ids)} tokens, more than this server's prompt capacity of "
                       f"{engine.prompt_capacity}; shorten it, or restart the server with --prompt-capacity >= "
                       f"{len(ids)}.", param=param, code="context_length_exceeded")


def _requests(body: SamplingFields, prompts: list[list[int]], n: int, params: SamplingParams, max_tokens: int,
              prompt_param: str, engine: Engine, tag: str) -> list[Request]:
    stops, seed = _stops(body.stop), _seed(body.seed)
    eos = [] if body.ignore_eos else None
    out = []
    for ids in prompts:
        _check_prompt(ids, prompt_param, engine)
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
    _refuse_unsupported(body)
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
    _refuse_unsupported(body)
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
