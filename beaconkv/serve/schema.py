"""The OpenAI request bodies the server accepts, and the checks of their fields.

:func:`parse_body` reads a raw body into :class:`ChatCompletionRequest` or
:class:`CompletionRequest`: JSON, then cheap size bounds on the raw value (no more prompts than
choices a call may have, no token-id list or conversation longer than the prompt capacity), then
the types (a value of the wrong type fails with HTTP 400). :mod:`beaconkv.serve.prepare` then checks what
types cannot say and makes the engine requests. The app runs both on worker threads: token-id prompts are
checked in Python (which lets the event loop run every few milliseconds), not in one long pydantic call.

Every field of OpenAI's two create-calls is either implemented, refused with HTTP 400 when set to
anything that would change the answer (:data:`REFUSED_FIELDS`), or accepted and ignored because it
cannot change the answer (:data:`IGNORED_FIELDS`: metadata and caching hints). vLLM's sampling
extensions beaconkv does not implement are refused the same way; other unknown fields are ignored,
as OpenAI-style clients send many.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError, WithJsonSchema

from ..engine import Engine
from .errors import APIError, from_validation_errors

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
        check_prompt(prompt, "prompt", engine)  # one prompt of token ids
    for ids in prompt:
        if isinstance(ids, list):
            check_prompt(ids, "prompt", engine)


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


def check_prompt(ids: Sequence[int], param: str, engine: Engine) -> None:
    """Refuses a token-id prompt longer than a slot takes (HTTP 400, ``context_length_exceeded``).

    Args:
        ids: The prompt's token ids.
        param: The field it came from (``prompt``, ``messages``).
        engine: The running engine (its prompt capacity).

    Raises:
        APIError: The prompt is longer than ``engine.prompt_capacity``.
    """
    if len(ids) > engine.prompt_capacity:
        raise APIError(f"the prompt has {len(ids)} tokens, more than this server's prompt capacity of "
                       f"{engine.prompt_capacity}; shorten it, or restart the server with --prompt-capacity >= "
                       f"{len(ids)}.", param=param, code="context_length_exceeded")


def refuse_unsupported(body: BaseModel) -> None:
    """Refuses a field of :data:`REFUSED_FIELDS` set to anything but its "off" value (HTTP 400, ``unsupported``).

    Raises:
        APIError: The first such field, naming the values it may take.
    """
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
