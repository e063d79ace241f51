"""What a request of the :class:`~beaconkv.engine.Engine` is, what it gets back, and its record while it runs.

:class:`Request` is what a caller submits, :class:`Event` what each step produces for it (streaming) and
:class:`Completion` its result; :func:`check_request` is the check :meth:`~beaconkv.engine.Engine.submit`
runs, and :class:`RunningRequest` the engine's record of a request in a slot, which also holds back the
text that may begin a stop string (:meth:`RunningRequest.new_text`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .detokenize import IncrementalDetokenizer
from .errors import BeaconKVError
from .sampling import SamplingParams

__all__ = ["MAX_STOP_CHARS", "MAX_STOP_STRINGS", "Completion", "EngineError", "Event", "QueueFullError", "Request",
           "RunningRequest", "TokenLogprob", "check_engine_sizes", "check_request", "stop_ends"]

MAX_STOP_STRINGS = 16
"""Most stop strings one request may have (each is looked for after every token)."""
MAX_STOP_CHARS = 1024
"""Longest stop string, in characters."""


class EngineError(BeaconKVError, ValueError):
    """A request the engine cannot take (a prompt longer than a slot holds, bad parameters)."""


class QueueFullError(BeaconKVError, RuntimeError):
    """The waiting queue is at its limit; retry later.

    Attributes:
        retry_after_s: A hint of when a slot may be free (seconds).
    """

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass
class Request:
    """One generation request.

    Attributes:
        prompt: Prompt token ids (already rendered with a chat template if wanted).
        max_new_tokens: Most new tokens.
        sampling: Temperature, top-p, top-k, logit bias, penalties and log-probabilities (greedy by default).
        seed: Seeds this request's own noise generator (None: the engine's seed sequence).
        eos_token_ids: Ids that end the request (included in its tokens); None: the tokenizer's.
        stop: Strings that end the request; the text ends before the first one (needs a tokenizer; at most
            :data:`MAX_STOP_STRINGS` of at most :data:`MAX_STOP_CHARS` characters).
        on_event: Called with every :class:`Event` of this request (streaming), on the engine's thread.
        tag: Anything the caller wants back in the :class:`Completion`.
    """

    prompt: Sequence[int]
    max_new_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None
    eos_token_ids: Sequence[int] | None = None
    stop: Sequence[str] = ()
    on_event: Callable[[Event], None] | None = None
    tag: object = None


@dataclass
class TokenLogprob:
    """The model's log-probabilities at one generated token (raw logits: before bias, penalties, temperature).

    Attributes:
        token_id: The chosen token.
        logprob: Its log-probability.
        top: The ``k`` most likely tokens (``k`` = the request's ``sampling.logprobs``) as
            ``(token id, log-probability)`` pairs, most likely first.
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Completion:
    """A finished request.

    Attributes:
        request_id: The id :meth:`~beaconkv.engine.Engine.submit` returned.
        token_ids: New tokens (ending with the end-of-sequence id when that ended it).
        text: Their text (special tokens skipped; cut before a stop string).
        finish_reason: ``"stop"`` (end-of-sequence id or stop string), ``"length"``, ``"cancelled"``, or
            ``"error"`` (the request failed; see ``error``).
        prompt_tokens: Prompt length.
        evictions: Evictions of its slot while it ran.
        queued_s: Seconds from submit to admission.
        time_to_first_token_s: Seconds from submit to its first token.
        wall_s: Seconds from submit to the end.
        slot: The slot it ran in (-1: never admitted).
        tag: The request's ``tag``.
        logprobs: One entry per new token when the request asked for ``sampling.logprobs`` (else None).
        error: Why the request failed (``finish_reason == "error"``), else None.
        exception: The exception that made it fail, when there was one (:func:`beaconkv.generate` raises it
            again: a library call fails loudly, where a server answers the one request with an error).
    """

    request_id: int
    token_ids: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int
    evictions: int
    queued_s: float
    time_to_first_token_s: float
    wall_s: float
    slot: int
    tag: object = None
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    exception: BaseException | None = field(default=None, repr=False, compare=False)


@dataclass
class Event:
    """What one step produced for one request.

    Attributes:
        request_id: The request.
        token_id: The new token (None for a cancellation or a failure).
        text: The new text it completes (may be empty).
        completion: Set when this event ends the request.
        logprob: The new token's log-probabilities, when the request asked for them.
    """

    request_id: int
    token_id: int | None
    text: str
    completion: Completion | None = None
    logprob: TokenLogprob | None = None


def check_engine_sizes(max_batch: int, prompt_capacity: int, max_new_tokens: int, prefill_chunk: int | None,
                       max_positions: int) -> None:
    """Checks an engine's sizes (what :class:`~beaconkv.engine.Engine` and the transformers engine of the server
    are made with).

    Args:
        max_batch: Requests decoded at once.
        prompt_capacity: Longest prompt, in tokens.
        max_new_tokens: Most new tokens of a request.
        prefill_chunk: Tokens per prefill chunk (None: whole prompts).
        max_positions: The model's ``max_position_embeddings``.

    Raises:
        EngineError: A size that is not an int >= 1, or a prompt and answer beyond the model's positions; the
            message names the value.
    """
    for name, value in (("max_batch", max_batch), ("prompt_capacity", prompt_capacity),
                        ("max_new_tokens", max_new_tokens), ("prefill_chunk", prefill_chunk)):
        if value is None and name == "prefill_chunk":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise EngineError(f"{name}={value!r} must be an int >= 1.")
    if prompt_capacity + max_new_tokens > max_positions:
        raise EngineError(f"prompt_capacity={prompt_capacity} + max_new_tokens={max_new_tokens} exceeds the "
                          f"model's max_position_embeddings={max_positions}; lower one of them.")


def check_request(request: Request, *, prompt_capacity: int, max_new_tokens: int, vocab_size: int,
                  has_tokenizer: bool) -> None:
    """Checks a request against a pool's limits (what :meth:`~beaconkv.engine.Engine.validate` asks).

    Args:
        request: The request.
        prompt_capacity: Longest prompt a slot takes.
        max_new_tokens: Most new tokens a request may ask for.
        vocab_size: The model's vocabulary size.
        has_tokenizer: Whether the engine has a tokenizer (stop strings need one).

    Raises:
        EngineError: An empty prompt, one longer than a slot's prompt capacity, more new tokens
            than the engine allows, sampling that is not a :class:`~beaconkv.sampling.SamplingParams`
            or biases a token outside the vocabulary, stop strings without a tokenizer, or more or
            longer stop strings than :data:`MAX_STOP_STRINGS` and :data:`MAX_STOP_CHARS`.
    """
    n = len(request.prompt)
    if n == 0:
        raise EngineError("the prompt is empty; every request needs at least one token.")
    if n > prompt_capacity:
        raise EngineError(f"the prompt has {n} tokens, more than a slot's prompt capacity of "
                          f"{prompt_capacity}; shorten it or make the engine with prompt_capacity >= {n}.")
    m = request.max_new_tokens
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise EngineError(f"max_new_tokens={m!r} must be an int >= 1.")
    if m > max_new_tokens:
        raise EngineError(f"max_new_tokens={m} is more than this engine's max_new_tokens={max_new_tokens}; "
                          "ask for fewer or make the engine with a larger max_new_tokens.")
    if request.stop and not has_tokenizer:
        raise EngineError("stop strings need a tokenizer; make the engine with one, or use eos_token_ids.")
    stops = list(request.stop)
    if len(stops) > MAX_STOP_STRINGS:
        raise EngineError(f"{len(stops)} stop strings are more than {MAX_STOP_STRINGS}; give fewer.")
    bad_stop = [s for s in stops if not isinstance(s, str) or not s or len(s) > MAX_STOP_CHARS]
    if bad_stop:
        shown = repr(bad_stop[0]) if len(repr(bad_stop[0])) <= 60 else repr(bad_stop[0])[:57] + "..."
        raise EngineError(f"stop string {shown} must be a non-empty string of at most {MAX_STOP_CHARS} "
                          "characters.")
    if not isinstance(request.sampling, SamplingParams):
        raise EngineError(f"sampling={request.sampling!r} must be a beaconkv.sampling.SamplingParams.")
    vocab = vocab_size
    if request.sampling.logit_bias and request.sampling.logit_bias[-1][0] >= vocab:
        raise EngineError(f"logit_bias names token {request.sampling.logit_bias[-1][0]}, outside the vocabulary "
                          f"0 .. {vocab - 1} of this model; bias this model's token ids.")
    bad = [(i, int(t)) for i, t in enumerate(request.prompt) if not 0 <= int(t) < vocab]
    if bad:
        i, t = bad[0]
        more = f", {len(bad)} bad ids in all" if len(bad) > 1 else ""
        raise EngineError(f"token id {t} is outside the vocabulary 0 .. {vocab - 1} of this model (prompt "
                          f"position {i}{more}); encode prompts with this model's tokenizer.")


@dataclass
class RunningRequest:
    """A request in a slot of the engine: what it was given, and what it produced so far.

    Attributes:
        id: Its request id.
        request: The request.
        slot: Its slot.
        submitted: ``time.perf_counter()`` at submit.
        admitted: ``time.perf_counter()`` at admission.
        generator: Its own noise generator (None: greedy).
        stops: Ids that end it.
        detok: Its incremental detokenizer (None without a tokenizer).
        stop_ends: ``(stop string, stop_ends(stop string))`` per stop string.
        tokens: Its new tokens.
        logprobs: Their log-probabilities, when it asked for them.
        sent: Characters of ``detok.text`` already emitted.
        first_token: ``time.perf_counter()`` at its first token (0: none yet).
    """

    id: int
    request: Request
    slot: int
    submitted: float
    admitted: float
    generator: torch.Generator | None
    stops: frozenset[int]
    detok: IncrementalDetokenizer | None
    stop_ends: list[tuple[str, dict[str, list[int]]]] = field(default_factory=list)  # see stop_ends
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    sent: int = 0  # characters of detok.text already emitted
    first_token: float = 0.0

    def new_text(self) -> tuple[str, bool]:
        """Text to emit now and whether a stop string appeared (text held back while it may start one)."""
        full = self.detok.text
        stops = self.request.stop
        if stops:
            hit = [i for s in stops if (i := full.find(s, max(0, self.sent - len(s) + 1))) >= 0]
            if hit:
                end = min(hit)
                text, self.sent = full[self.sent : end], end
                return text, True
            # hold back the longest tail that begins a stop string: only prefixes ending in full's last character
            last = full[-1:]
            hold = max((next((k for k in ends.get(last, ()) if full.endswith(s[:k])), 0)
                        for s, ends in self.stop_ends), default=0)
            end = len(full) - hold
        else:
            end = len(full)
        text, self.sent = full[self.sent : max(end, self.sent)], max(end, self.sent)
        return text, False


def stop_ends(stop: str) -> dict[str, list[int]]:
    """``{c: [k, ...]}``: the lengths ``k < len(stop)`` of the prefixes of ``stop`` that end with ``c``,
    longest first (the text's tail can begin the stop string only with a prefix ending in its last character)."""
    out: dict[str, list[int]] = {}
    for k in range(len(stop) - 1, 0, -1):
        out.setdefault(stop[k - 1], []).append(k)
    return out
