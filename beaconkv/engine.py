"""Continuous batching: a fixed pool of cache slots that requests flow through.

Compression exists so that more sequences fit in memory at once; a static batch wastes that memory,
because a finished sequence keeps its slot until the longest one ends. :class:`Engine` allocates
one :class:`~beaconkv.session.Session` of ``max_batch`` slots once (each slot holds
``prompt_capacity + budget`` tokens per KV head), keeps waiting requests in a queue, and at every
step:

1. **admits** waiting requests into free slots: their prompts are prefilled together (one padded
   prefill) into those rows, the policy's state of each slot is reset, and each request's first
   token is sampled;
2. **decodes** one token for every slot — a single static-shape step (``max_batch`` rows), so the
   compiled graph (a CUDA graph on CUDA) is reused across admissions; idle slots write nothing that
   counts;
3. **finishes** requests: an end-of-sequence id, a stop string or ``max_new_tokens`` ends one, and
   its slot is released at once — it stops being evicted and counted, and the next request can take
   it at the next step.

Every request has its own sampling parameters (logit bias, penalties and log-probabilities
included), seed (its own generator draws its noise) and stop conditions, and every row of the
decode step is computed independently, so a request's greedy tokens and kept positions are the same
whether it runs alone, in a static batch, or admitted mid-flight into a busy pool (tested for
FullKV, BeaconKV and SnapKV). Text is detokenised incrementally (:mod:`beaconkv.detokenize`).

**Faults stay with their request.** Whatever one request's own work raises — writing its sampling
row, drawing its noise, its prefill (a batched prefill that fails is retried request by request),
sampling its first token, detokenising, its ``on_event`` callback — ends that request alone, with
``finish_reason="error"`` and the message in :attr:`Completion.error`; the other rows go on with the
very tokens they would have had without it. A decode step is one computation over every row, so a
step that raises ends every running request the same way (their slots are freed; the pool serves
the next requests). :meth:`Engine.step` itself does not raise for a request's fault.

The engine is driven from one thread (:meth:`Engine.step`, :meth:`Engine.run`); :meth:`Engine.submit`
and :meth:`Engine.cancel` may be called from others (the HTTP server does).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .decode_setup import DecodeSetup
from .detokenize import IncrementalDetokenizer
from .errors import BeaconKVError
from .execution import CompileConfig
from .models.decoder import CausalLM
from .policies.base import EvictionPolicy, FullKV
from .preparation import prepare_model
from .sampling import RowSampling, SamplingParams, sample_rows
from .session import Session
from .storage import KVStorage
from .tokenizer import Tokenizer


logger = logging.getLogger("beaconkv.engine")
"""Where the engine logs the failure of a request (with its traceback)."""

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
        request_id: The id :meth:`Engine.submit` returned.
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


@dataclass
class _Running:
    """A request in a slot."""

    id: int
    request: Request
    slot: int
    submitted: float
    admitted: float
    generator: torch.Generator | None
    stops: frozenset[int]
    detok: IncrementalDetokenizer | None
    stop_ends: list[tuple[str, dict[str, list[int]]]] = field(default_factory=list)  # see _stop_ends
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    sent: int = 0  # characters of detok.text already emitted
    first_token: float = 0.0


@dataclass
class EngineStats:
    """Counters of an engine since it was made.

    Attributes:
        steps: Decode steps run.
        generated_tokens: Tokens produced (first tokens included).
        finished: Requests finished (cancelled ones included).
        evictions: Evictions over all requests.
        busy_slot_steps: Sum over decode steps of the slots in use (utilisation = / (steps · max_batch)).
        prefill_s: Seconds in prefill.
        decode_s: Seconds in decode steps (policy work included).
        started: ``time.perf_counter()`` when the engine was made.
    """

    steps: int = 0
    generated_tokens: int = 0
    finished: int = 0
    evictions: int = 0
    busy_slot_steps: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    started: float = field(default_factory=time.perf_counter)


class Engine:
    """A pool of ``max_batch`` cache slots that requests flow through (continuous batching).

    Args:
        model: The model.
        tokenizer: Decodes text and stop strings (None: token ids only, no stop strings).
        policy: The eviction policy of every slot (settings only; the state is per slot). None = FullKV.
        max_batch: Slots (rows of every decode step).
        prompt_capacity: Longest prompt a slot takes.
        max_new_tokens: Most new tokens any request may ask for (sizes a FullKV slot, and the
            positions a request may reach).
        kv_storage: ``"dense"``, ``"int8"`` or a :class:`~beaconkv.storage.KVStorage` class.
        cache_dtype: Dtype a dense storage keeps keys and values in (None: the model's).
        kernels: Matmul kernels of the pool's steps: ``"auto"``, ``"model"``, ``"packed"`` or ``"bf16w"``
            (see :func:`~beaconkv.kernels.choice.choose_kernels`; for pools of 4+ slots on a CPU
            without native bfloat16, ``"auto"`` runs a bf16 model's weights with fp32 arithmetic and
            prepacks an fp32 model's linears, where that makes batching pay).
        compile: Compile the decode step and the policy's device work.
        max_queue: Most waiting requests before :meth:`submit` raises :class:`QueueFullError` (None: no limit).
        seed: Seeds the generators of requests submitted without a seed (request ``i`` gets ``seed + i``).
        on_step: Called as ``on_step(step, session)`` after every decode step, once the policy's work is
            done (measurement hooks).
        prefill_chunk: Prefill prompts longer than this in chunks of this many tokens, the policy evicting
            between chunks (:meth:`~beaconkv.session.Session.prefill`), so a slot holds at most
            ``n_prefix + budget + prefill_chunk`` tokens per KV head instead of the whole prompt (an int
            ``n_prefix`` makes the prompt evictable; with the whole prompt protected nothing changes).
            None: whole prompts.
        setup: ``kv_storage``, ``cache_dtype``, ``kernels``, ``compile``, ``prefill_chunk`` (and ``threads``,
            set when the engine is made) as one :class:`~beaconkv.decode_setup.DecodeSetup`, instead of the
            keywords (not with them).

    Attributes:
        prepared: What :func:`~beaconkv.preparation.prepare_model` made of ``model`` for this pool.
        model: The model the pool runs (``prepared.model``: the caller's, or its copy with other kernels).
        session: The pool's :class:`~beaconkv.session.Session`.

    Raises:
        EngineError: Sizes below 1 or beyond the model's positions.
    """

    def __init__(
        self,
        model: CausalLM,
        tokenizer: Tokenizer | None = None,
        *,
        policy: EvictionPolicy | None = None,
        max_batch: int = 8,
        prompt_capacity: int = 1024,
        max_new_tokens: int = 1024,
        kv_storage: str | type[KVStorage] = "dense",
        cache_dtype: torch.dtype | None = None,
        kernels: str = "auto",
        compile: bool | CompileConfig = False,
        max_queue: int | None = None,
        seed: int = 0,
        on_step: Callable[[int, Session], None] | None = None,
        prefill_chunk: int | None = None,
        setup: DecodeSetup | None = None,
    ) -> None:
        for name, value in (("max_batch", max_batch), ("prompt_capacity", prompt_capacity),
                            ("max_new_tokens", max_new_tokens), ("prefill_chunk", prefill_chunk)):
            if value is None and name == "prefill_chunk":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise EngineError(f"{name}={value!r} must be an int >= 1.")
        setup = DecodeSetup.of(setup, kv_storage=kv_storage, cache_dtype=cache_dtype, kernels=kernels,
                               compile=compile, prefill_chunk=prefill_chunk)
        setup.apply_threads()
        limit = model.config.max_position_embeddings
        if prompt_capacity + max_new_tokens > limit:
            raise EngineError(f"prompt_capacity={prompt_capacity} + max_new_tokens={max_new_tokens} exceeds the "
                              f"model's max_position_embeddings={limit}; lower one of them.")
        self.prepared = prepare_model(model, max_batch, setup)
        self.model, self.tokenizer = self.prepared.model, tokenizer
        self.policy = policy if policy is not None else FullKV()
        self.max_batch, self.prompt_capacity, self.max_new_tokens = max_batch, prompt_capacity, max_new_tokens
        self.prefill_chunk = setup.prefill_chunk
        self.session = Session.prepared(
            self.prepared, self.policy, batch=max_batch,
            capacity=self.policy.capacity([prompt_capacity], max_new_tokens, prefill_chunk=self.prefill_chunk),
            max_tokens=prompt_capacity + max_new_tokens,
        )
        self.device = self.session.device
        self.max_queue, self.on_step = max_queue, on_step
        self.stats = EngineStats()
        self._ids = itertools.count()
        self._seeds = itertools.count(seed)
        self._lock = threading.Lock()
        self._waiting: deque[tuple[int, Request, float, int]] = deque()
        self._cancelled: set[int] = set()
        self._slots: list[_Running | None] = [None] * max_batch
        self._params: list[SamplingParams] = [SamplingParams()] * max_batch
        self._sampling = RowSampling.of(self._params, self.device, vocab_size=self.vocab_size)
        self.session.decoder.prepare(self._sampling)  # written in place by every step (static under CUDA graphs)
        self._tokens = torch.zeros(max_batch, dtype=torch.long, device=self.device)

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size (token ids and logit-bias ids lie in ``0 .. vocab_size - 1``)."""
        return self.model.config.vocab_size

    # ------------------------------------------------------------------------------- requests
    def validate(self, request: Request) -> None:
        """Checks a request against the pool (called by :meth:`submit`).

        Raises:
            EngineError: An empty prompt, one longer than a slot's prompt capacity, more new tokens
                than the engine allows, sampling that is not a :class:`~beaconkv.sampling.SamplingParams`
                or biases a token outside the vocabulary, stop strings without a tokenizer, or more or
                longer stop strings than :data:`MAX_STOP_STRINGS` and :data:`MAX_STOP_CHARS`.
        """
        n = len(request.prompt)
        if n == 0:
            raise EngineError("the prompt is empty; every request needs at least one token.")
        if n > self.prompt_capacity:
            raise EngineError(f"the prompt has {n} tokens, more than a slot's prompt capacity of "
                              f"{self.prompt_capacity}; shorten it or make the engine with prompt_capacity >= {n}.")
        m = request.max_new_tokens
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise EngineError(f"max_new_tokens={m!r} must be an int >= 1.")
        if m > self.max_new_tokens:
            raise EngineError(f"max_new_tokens={m} is more than this engine's max_new_tokens={self.max_new_tokens}; "
                              "ask for fewer or make the engine with a larger max_new_tokens.")
        if request.stop and self.tokenizer is None:
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
        vocab = self.vocab_size
        if request.sampling.logit_bias and request.sampling.logit_bias[-1][0] >= vocab:
            raise EngineError(f"logit_bias names token {request.sampling.logit_bias[-1][0]}, outside the vocabulary "
                              f"0 .. {vocab - 1} of this model; bias this model's token ids.")
        bad = [(i, int(t)) for i, t in enumerate(request.prompt) if not 0 <= int(t) < vocab]
        if bad:
            i, t = bad[0]
            more = f", {len(bad)} bad ids in all" if len(bad) > 1 else ""
            raise EngineError(f"token id {t} is outside the vocabulary 0 .. {vocab - 1} of this model (prompt "
                              f"position {i}{more}); encode prompts with this model's tokenizer.")

    def submit(self, request: Request) -> int:
        """Queues a request; returns its id. Thread-safe.

        Raises:
            EngineError: See :meth:`validate`.
            QueueFullError: ``max_queue`` requests are already waiting.
        """
        self.validate(request)
        with self._lock:
            if self.max_queue is not None and len(self._waiting) >= self.max_queue:
                raise QueueFullError(f"{len(self._waiting)} requests are waiting (max_queue={self.max_queue}).",
                                     retry_after_s=self._retry_hint())
            rid = next(self._ids)
            seed = request.seed if request.seed is not None else next(self._seeds)
            self._waiting.append((rid, request, time.perf_counter(), seed))
        return rid

    def cancel(self, request_id: int) -> None:
        """Ends a request at the next step (a client that went away); its slot is freed then. Thread-safe."""
        with self._lock:
            self._cancelled.add(request_id)

    def _retry_hint(self) -> float:
        elapsed = time.perf_counter() - self.stats.started
        rate = self.stats.finished / elapsed if elapsed > 0 and self.stats.finished else 0.0
        return max(1.0, round(len(self._waiting) / rate, 1)) if rate else 1.0

    # ------------------------------------------------------------------------------- state
    @property
    def running(self) -> int:
        """Requests in slots."""
        return sum(r is not None for r in self._slots)

    @property
    def queued(self) -> int:
        """Requests waiting for a slot."""
        return len(self._waiting)

    @property
    def idle(self) -> bool:
        """Nothing running and nothing waiting."""
        return not self.running and not self._waiting

    @property
    def cache_bytes(self) -> int:
        """Bytes of the pool's keys and values (allocated once)."""
        return self.session.cache.nbytes()

    @property
    def slot_capacity(self) -> int:
        """Cache slots per (request, KV head)."""
        return self.session.cache.capacity

    # ------------------------------------------------------------------------------- steps
    @torch.inference_mode()
    def step(self) -> list[Event]:
        """Admits waiting requests, decodes one token for every running one, finishes what is done.

        A request whose own work fails ends with ``finish_reason="error"`` (see the module docstring);
        so does every running request when the decode step itself fails.

        Returns:
            The events of this step (new tokens, text, completions), in slot order.
        """
        events: list[Event] = []
        self._apply_cancellations(events)
        self._admit(events)
        if not self.running:
            return events
        t0 = time.perf_counter()
        noise = self._noise(self._slots, events)
        if not self.running:
            return events
        try:
            nxt = self.session.step(self._tokens, self._sampling, noise)
            tokens = nxt.tolist()  # the host needs them: stops, streaming, admissions
            logprobs = self._read_logprobs(self._sampling, self._slots, tokens)
        except Exception as err:  # one computation over every row: no single request to blame
            logger.exception("beaconkv engine: a decode step failed; its %d running requests fail", self.running)
            for run in list(self._slots):
                if run is not None:
                    self._fail(run, f"the decode step failed ({type(err).__name__}: {err})", events, err, log=False)
            return events
        if self.on_step is not None:
            self.on_step(self.stats.steps, self.session)
        self.stats.decode_s += time.perf_counter() - t0
        self.stats.steps += 1
        self.stats.busy_slot_steps += self.running
        self._tokens.copy_(nxt)
        now = time.perf_counter()
        for slot, run in enumerate(self._slots):
            if run is not None:
                self._emit_isolated(run, tokens[slot], logprobs[slot], now, events)
        return events

    def run(self, requests: Iterable[Request] = ()) -> list[Completion]:
        """Submits ``requests`` and steps until every request (these and earlier ones) finished.

        Returns:
            The completions of ``requests``, in their order.
        """
        ids = [self.submit(r) for r in requests]
        done: dict[int, Completion] = {}
        while not self.idle:
            for ev in self.step():
                if ev.completion is not None:
                    done[ev.request_id] = ev.completion
        return [done[i] for i in ids]

    # ------------------------------------------------------------------------------- internals
    def _admit(self, events: list[Event]) -> None:
        free = [s for s, r in enumerate(self._slots) if r is None]
        with self._lock:
            batch = [self._waiting.popleft() for _ in range(min(len(free), len(self._waiting)))]
        if not batch:
            return
        t0 = time.perf_counter()
        runs = [run for run in (self._start(waiting, slot, events) for waiting, slot in zip(batch, free))
                if run is not None]
        if not runs:
            return
        try:
            prefilled = [(runs, self.session.prefill([list(map(int, r.request.prompt)) for r in runs],
                                                     rows=[r.slot for r in runs], chunk=self.prefill_chunk))]
        except Exception as err:
            if len(runs) == 1:
                self._fail(runs[0], f"its prefill failed ({type(err).__name__}: {err})", events, err)
                return
            prefilled = []  # retry one by one: only a request whose own prefill fails fails
            for run in runs:
                try:
                    prefilled.append(([run], self.session.prefill([list(map(int, run.request.prompt))],
                                                                  rows=[run.slot], chunk=self.prefill_chunk)))
                except Exception as one:
                    self._fail(run, f"its prefill failed ({type(one).__name__}: {one})", events, one)
        admitted = time.perf_counter()
        for group, logits in prefilled:
            for run in group:
                run.admitted = admitted
            self._first_tokens(group, logits, events)
        self.stats.prefill_s += time.perf_counter() - t0

    def _start(self, waiting: tuple[int, Request, float, int], slot: int, events: list[Event]) -> _Running | None:
        """Takes a slot for a waiting request and writes its sampling row; None (and a failure event) if that fails."""
        rid, req, submitted, seed = waiting
        try:
            gen = None
            if not req.sampling.greedy:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(seed)
            eos = req.eos_token_ids if req.eos_token_ids is not None else (
                self.tokenizer.eos_token_ids if self.tokenizer is not None else [])
            detok = IncrementalDetokenizer(self.tokenizer.decode) if self.tokenizer is not None else None
            run = _Running(rid, req, slot, submitted, submitted, gen, frozenset(eos), detok,
                           stop_ends=[(s, _stop_ends(s)) for s in req.stop],
                           logprobs=[] if req.sampling.logprobs is not None else None)
            self._params[slot] = req.sampling
            self._sampling.set_row(slot, req.sampling, [self._params[s] for s in [*self._live_slots(), slot]])
        except Exception as err:
            self._params[slot] = SamplingParams()
            logger.exception("beaconkv engine: request %d could not start", rid)
            now = time.perf_counter()
            self.stats.finished += 1
            reason = f"its sampling could not be set up ({type(err).__name__}: {err})"
            comp = Completion(rid, [], "", "error", len(req.prompt), 0, now - submitted, 0.0, now - submitted, -1,
                              req.tag, error=f"the request failed: {reason}", exception=err)
            self._deliver_safely(req, Event(rid, None, "", comp), events)
            return None
        self._slots[slot] = run
        return run

    def _first_tokens(self, runs: list[_Running], logits: Tensor, events: list[Event]) -> None:
        """Samples the first token of freshly prefilled requests (one by one if the batch fails) and emits it."""
        noise = self._noise(runs, events)
        live = [(i, r) for i, r in enumerate(runs) if self._slots[r.slot] is r]
        if not live:
            return
        rows = torch.tensor([i for i, _ in live], device=logits.device)
        logits = logits[rows]
        noise = None if noise is None else noise[rows]
        runs = [r for _, r in live]
        try:
            picked = [self._sample_first(runs, logits, noise)]
        except Exception:
            picked = []
            for i, run in enumerate(runs):
                try:
                    picked.append(self._sample_first([run], logits[i : i + 1],
                                                     None if noise is None else noise[i : i + 1]))
                except Exception as err:
                    self._fail(run, f"its first token could not be sampled ({type(err).__name__}: {err})",
                               events, err)
        now = time.perf_counter()
        for group, tokens, logprobs in picked:
            for run, token, logprob in zip(group, tokens, logprobs):
                self._emit_isolated(run, token, logprob, now, events)

    def _sample_first(self, runs: list[_Running], logits: Tensor, noise: Tensor | None,
                      ) -> tuple[list[_Running], list[int], list[TokenLogprob | None]]:
        slots = [r.slot for r in runs]
        part = self._sampling.take(slots)
        first = sample_rows(logits, part, noise)
        self._sampling.put_counts(slots, part)
        self._tokens[torch.tensor(slots, device=self.device)] = first
        tokens = first.tolist()
        return runs, tokens, self._read_logprobs(part, runs, tokens)

    def _read_logprobs(self, sampling: RowSampling, runs: Sequence[_Running | None],
                       tokens: Sequence[int]) -> list[TokenLogprob | None]:
        """Each row's log-probabilities from ``sampling`` (after it chose ``tokens``), for the runs that asked."""
        if not sampling.mode.logprobs:
            return [None] * len(runs)
        chosen, top, ids = sampling.logprob.tolist(), sampling.top_logprobs.tolist(), sampling.top_ids.tolist()
        out: list[TokenLogprob | None] = []
        for row, run in enumerate(runs):
            k = None if run is None else run.request.sampling.logprobs
            out.append(None if k is None else TokenLogprob(tokens[row], chosen[row],
                                                           list(zip(ids[row][:k], top[row][:k]))))
        return out

    def _live_slots(self) -> list[int]:
        return [s for s, r in enumerate(self._slots) if r is not None]

    def _noise(self, runs: Sequence[_Running | None], events: list[Event]) -> Tensor | None:
        """Race noise, one row per entry: a sampled request's row from its own generator, others 1.

        None when no entry samples (a greedy batch needs no noise). A run whose draw fails fails.
        """
        if not any(run is not None and run.generator is not None for run in runs):
            return None
        noise = torch.ones(len(runs), self.vocab_size, dtype=torch.float32, device=self.device)
        for row, run in enumerate(runs):
            if run is not None and run.generator is not None:
                try:
                    noise[row].exponential_(1.0, generator=run.generator)
                except Exception as err:
                    noise[row] = 1.0
                    self._fail(run, f"its sampling noise could not be drawn ({type(err).__name__}: {err})",
                               events, err)
        return noise

    def _emit_isolated(self, run: _Running, token: int, logprob: TokenLogprob | None, now: float,
                       events: list[Event]) -> None:
        """:meth:`_emit`, failing only this request if its detokenising, stops or callback raise."""
        try:
            self._emit(run, token, logprob, now, events)
        except Exception as err:
            self._fail(run, f"its token could not be handled ({type(err).__name__}: {err})", events, err)

    def _fail(self, run: _Running, reason: str, events: list[Event], err: BaseException | None = None, *,
              log: bool = True) -> None:
        """Ends a running request with ``finish_reason="error"`` (if it has not ended already) and tells its owner."""
        if err is not None and log:
            logger.error("beaconkv engine: request %d failed: %s", run.id, reason, exc_info=err)
        if self._slots[run.slot] is not run:
            return
        comp = self._finish(run, "error", time.perf_counter())
        comp.error = f"the request failed: {reason}"
        comp.exception = err
        self._deliver_safely(run.request, Event(run.id, None, "", comp), events)

    def _deliver_safely(self, request: Request, ev: Event, events: list[Event]) -> None:
        events.append(ev)
        if request.on_event is not None:
            try:
                request.on_event(ev)
            except Exception:
                logger.exception("beaconkv engine: the on_event callback of request %d failed", ev.request_id)

    def abort(self, reason: str) -> list[Event]:
        """Ends every running request with ``finish_reason="error"`` (the caller of :meth:`step` hit a fault).

        Waiting requests stay queued. Call it from the thread that steps the engine.

        Args:
            reason: Why (becomes each :attr:`Completion.error`).

        Returns:
            The events of the ended requests (their callbacks were called too).
        """
        events: list[Event] = []
        for run in list(self._slots):
            if run is not None:
                self._fail(run, reason, events)
        return events

    def _emit(self, run: _Running, token: int, logprob: TokenLogprob | None, now: float, events: list[Event]) -> None:
        if not run.tokens:
            run.first_token = now
        run.tokens.append(token)
        self.stats.generated_tokens += 1
        if logprob is not None:
            run.logprobs.append(logprob)
        text, stopped = "", False
        if run.detok is not None:
            run.detok.push(token)
            text, stopped = self._new_text(run)
        reason = None
        if stopped or token in run.stops:
            reason = "stop"
        elif len(run.tokens) >= run.request.max_new_tokens:
            reason = "length"
        ev = Event(run.id, token, text, logprob=logprob)
        if reason is not None:
            ev.completion = self._finish(run, reason, now)
        self._deliver(run, ev, events)

    def _new_text(self, run: _Running) -> tuple[str, bool]:
        """Text to emit now and whether a stop string appeared (text held back while it may start one)."""
        full = run.detok.text
        stops = run.request.stop
        if stops:
            hit = [i for s in stops if (i := full.find(s, max(0, run.sent - len(s) + 1))) >= 0]
            if hit:
                end = min(hit)
                text, run.sent = full[run.sent : end], end
                return text, True
            # hold back the longest tail that begins a stop string: only prefixes ending in full's last character
            last = full[-1:]
            hold = max((next((k for k in ends.get(last, ()) if full.endswith(s[:k])), 0) for s, ends in run.stop_ends),
                       default=0)
            end = len(full) - hold
        else:
            end = len(full)
        text, run.sent = full[run.sent : max(end, run.sent)], max(end, run.sent)
        return text, False

    def _finish(self, run: _Running, reason: str, now: float) -> Completion:
        state = self.session.state
        evictions = state.stats.evictions[run.slot]
        self.session.release([run.slot])
        self._slots[run.slot] = None
        self._params[run.slot] = SamplingParams()
        self._sampling.set_row(run.slot, SamplingParams(), [self._params[s] for s in self._live_slots()])
        self.stats.finished += 1
        self.stats.evictions += evictions
        text = run.detok.text[: run.sent] if run.detok is not None and run.request.stop else (
            run.detok.text if run.detok is not None else "")
        return Completion(
            run.id, list(run.tokens), text, reason, len(run.request.prompt), evictions,
            run.admitted - run.submitted, (run.first_token or now) - run.submitted, now - run.submitted, run.slot,
            run.request.tag, None if run.logprobs is None else list(run.logprobs),
        )

    def _deliver(self, run: _Running, ev: Event, events: list[Event]) -> None:
        events.append(ev)
        if run.request.on_event is not None:
            run.request.on_event(ev)

    def _apply_cancellations(self, events: list[Event]) -> None:
        with self._lock:
            cancelled, self._cancelled = self._cancelled, set()
            waiting = [w for w in self._waiting if w[0] in cancelled]
            self._waiting = deque(w for w in self._waiting if w[0] not in cancelled)
        now = time.perf_counter()
        for rid, req, submitted, _ in waiting:
            self.stats.finished += 1
            comp = Completion(rid, [], "", "cancelled", len(req.prompt), 0, now - submitted, 0.0, now - submitted, -1,
                              req.tag)
            self._deliver_safely(req, Event(rid, None, "", comp), events)
        for run in list(self._slots):
            if run is not None and run.id in cancelled:
                self._deliver_safely(run.request, Event(run.id, None, "", self._finish(run, "cancelled", now)), events)


def _stop_ends(stop: str) -> dict[str, list[int]]:
    """``{c: [k, ...]}``: the lengths ``k < len(stop)`` of the prefixes of ``stop`` that end with ``c``,
    longest first (the text's tail can begin the stop string only with a prefix ending in its last character)."""
    out: dict[str, list[int]] = {}
    for k in range(len(stop) - 1, 0, -1):
        out.setdefault(stop[k - 1], []).append(k)
    return out
