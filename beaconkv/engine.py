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

Every request has its own sampling parameters, seed (its own generator draws its noise) and stop
conditions, and every row of the decode step is computed independently, so a request's greedy
tokens and kept positions are the same whether it runs alone, in a static batch, or admitted
mid-flight into a busy pool (tested for FullKV, BeaconKV and SnapKV). Text is detokenised
incrementally (:mod:`beaconkv.detokenize`).

The engine is driven from one thread (:meth:`Engine.step`, :meth:`Engine.run`); :meth:`Engine.submit`
and :meth:`Engine.cancel` may be called from others (the HTTP server does).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .detokenize import IncrementalDetokenizer
from .execution import CompileConfig
from .models.decoder import CausalLM
from .policies.base import EvictionPolicy, FullKV
from .sampling import RowSampling, SamplingParams, sample_rows
from .session import Session
from .storage import KVStorage
from .tokenizer import Tokenizer


class EngineError(ValueError):
    """A request the engine cannot take (a prompt longer than a slot holds, bad parameters)."""


class QueueFullError(RuntimeError):
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
        sampling: Temperature, top-p, top-k (greedy by default).
        seed: Seeds this request's own noise generator (None: the engine's seed sequence).
        eos_token_ids: Ids that end the request (included in its tokens); None: the tokenizer's.
        stop: Strings that end the request; the text ends before the first one (needs a tokenizer).
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
class Completion:
    """A finished request.

    Attributes:
        request_id: The id :meth:`Engine.submit` returned.
        token_ids: New tokens (ending with the end-of-sequence id when that ended it).
        text: Their text (special tokens skipped; cut before a stop string).
        finish_reason: ``"stop"`` (end-of-sequence id or stop string), ``"length"`` or ``"cancelled"``.
        prompt_tokens: Prompt length.
        evictions: Evictions of its slot while it ran.
        queued_s: Seconds from submit to admission.
        time_to_first_token_s: Seconds from submit to its first token.
        wall_s: Seconds from submit to the end.
        slot: The slot it ran in.
        tag: The request's ``tag``.
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


@dataclass
class Event:
    """What one step produced for one request.

    Attributes:
        request_id: The request.
        token_id: The new token (None for a cancellation).
        text: The new text it completes (may be empty).
        completion: Set when this event ends the request.
    """

    request_id: int
    token_id: int | None
    text: str
    completion: Completion | None = None


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
    tokens: list[int] = field(default_factory=list)
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
            (see :func:`~beaconkv.models.cpu_linear.choose_kernels`; for pools of 4+ slots on a CPU
            without native bfloat16, ``"auto"`` runs a bf16 model's weights with fp32 arithmetic and
            prepacks an fp32 model's linears, where that makes batching pay).
        compile: Compile the decode step and the policy's device work.
        max_queue: Most waiting requests before :meth:`submit` raises :class:`QueueFullError` (None: no limit).
        seed: Seeds the generators of requests submitted without a seed (request ``i`` gets ``seed + i``).
        on_step: Called as ``on_step(step, session)`` after every decode step, once the policy's work is
            done (measurement hooks).

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
    ) -> None:
        for name, value in (("max_batch", max_batch), ("prompt_capacity", prompt_capacity),
                            ("max_new_tokens", max_new_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise EngineError(f"{name}={value!r} must be an int >= 1.")
        limit = model.config.max_position_embeddings
        if prompt_capacity + max_new_tokens > limit:
            raise EngineError(f"prompt_capacity={prompt_capacity} + max_new_tokens={max_new_tokens} exceeds the "
                              f"model's max_position_embeddings={limit}; lower one of them.")
        self.model, self.tokenizer = model, tokenizer
        self.policy = policy if policy is not None else FullKV()
        self.max_batch, self.prompt_capacity, self.max_new_tokens = max_batch, prompt_capacity, max_new_tokens
        self.session = Session(
            model, self.policy, batch=max_batch,
            capacity=self.policy.capacity([prompt_capacity], max_new_tokens),
            max_tokens=prompt_capacity + max_new_tokens, kv_storage=kv_storage, cache_dtype=cache_dtype,
            compile=compile, kernels=kernels,
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
        self._sampling = RowSampling.of(self._params, self.device)
        self._tokens = torch.zeros(max_batch, dtype=torch.long, device=self.device)

    # ------------------------------------------------------------------------------- requests
    def validate(self, request: Request) -> None:
        """Checks a request against the pool (called by :meth:`submit`).

        Raises:
            EngineError: An empty prompt, one longer than a slot's prompt capacity, more new tokens
                than the engine allows, or stop strings without a tokenizer.
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
        vocab = self.model.config.vocab_size
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

        Returns:
            The events of this step (new tokens, text, completions), in slot order.
        """
        events: list[Event] = []
        self._apply_cancellations(events)
        self._admit(events)
        if self.running:
            t0 = time.perf_counter()
            nxt = self.session.step(self._tokens, self._sampling, self._noise(self._slots))
            tokens = nxt.tolist()  # the host needs them: stops, streaming, admissions
            if self.on_step is not None:
                self.on_step(self.stats.steps, self.session)
            self.stats.decode_s += time.perf_counter() - t0
            self.stats.steps += 1
            self.stats.busy_slot_steps += self.running
            self._tokens.copy_(nxt)
            now = time.perf_counter()
            for slot, run in enumerate(self._slots):
                if run is not None:
                    self._emit(run, tokens[slot], now, events)
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
        slots = free[: len(batch)]
        t0 = time.perf_counter()
        logits = self.session.prefill([list(map(int, req.prompt)) for _, req, _, _ in batch], rows=slots)
        admitted = time.perf_counter()
        for (rid, req, submitted, seed), slot in zip(batch, slots):
            gen = None
            if not req.sampling.greedy:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(seed)
            eos = req.eos_token_ids if req.eos_token_ids is not None else (
                self.tokenizer.eos_token_ids if self.tokenizer is not None else [])
            detok = IncrementalDetokenizer(self.tokenizer.decode) if self.tokenizer is not None else None
            self._slots[slot] = _Running(rid, req, slot, submitted, admitted, gen, frozenset(eos), detok)
            self._params[slot] = req.sampling
        for slot in slots:
            self._sampling.set_row(slot, self._params[slot], [self._params[s] for s in self._live_slots()])
        first = sample_rows(logits, _take_rows(self._sampling, slots), self._noise([self._slots[s] for s in slots]))
        self.stats.prefill_s += time.perf_counter() - t0
        self._tokens[torch.tensor(slots, device=self.device)] = first
        now = time.perf_counter()
        for slot, token in zip(slots, first.tolist()):
            self._emit(self._slots[slot], token, now, events)

    def _live_slots(self) -> list[int]:
        return [s for s, r in enumerate(self._slots) if r is not None]

    def _noise(self, runs: Sequence[_Running | None]) -> Tensor | None:
        """Race noise, one row per entry: a sampled request's row from its own generator, others 1.

        None when no entry samples (a greedy batch needs no noise).
        """
        if not any(run is not None and run.generator is not None for run in runs):
            return None
        noise = torch.ones(len(runs), self.model.config.vocab_size, dtype=torch.float32, device=self.device)
        for row, run in enumerate(runs):
            if run is not None and run.generator is not None:
                noise[row].exponential_(1.0, generator=run.generator)
        return noise

    def _emit(self, run: _Running, token: int, now: float, events: list[Event]) -> None:
        if not run.tokens:
            run.first_token = now
        run.tokens.append(token)
        self.stats.generated_tokens += 1
        text, stopped = "", False
        if run.detok is not None:
            run.detok.push(token)
            text, stopped = self._new_text(run)
        reason = None
        if stopped or token in run.stops:
            reason = "stop"
        elif len(run.tokens) >= run.request.max_new_tokens:
            reason = "length"
        ev = Event(run.id, token, text)
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
            hold = max((k for s in stops for k in range(1, len(s)) if full.endswith(s[:k])), default=0)
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
            run.request.tag,
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
            ev = Event(rid, None, "", comp)
            events.append(ev)
            if req.on_event is not None:
                req.on_event(ev)
        for run in list(self._slots):
            if run is not None and run.id in cancelled:
                self._deliver(run, Event(run.id, None, "", self._finish(run, "cancelled", now)), events)


def _take_rows(sampling: RowSampling, rows: list[int]) -> RowSampling:
    index = torch.tensor(rows, device=sampling.temperature.device)
    return RowSampling(sampling.temperature[index], sampling.top_p[index], sampling.top_k[index], sampling.mode)
