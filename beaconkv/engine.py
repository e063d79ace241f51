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

What a request is and gets back (:class:`~beaconkv.engine_requests.Request`,
:class:`~beaconkv.engine_requests.Completion`, ...; importable from here too) is
:mod:`beaconkv.engine_requests`; admission (prefill and first token) is :mod:`beaconkv.engine_admission`.
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
from .engine_admission import EngineAdmission
from .engine_requests import (  # noqa: F401 - importable from here as before
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    Completion,
    EngineError,
    Event,
    QueueFullError,
    Request,
    RunningRequest,
    TokenLogprob,
    check_engine_sizes,
    check_request,
)
from .execution import CompileConfig
from .models.decoder import CausalLM
from .policies.base import EvictionPolicy, FullKV
from .preparation import prepare_model
from .sampling import RowSampling, SamplingParams
from .session import Session
from .storage import KVStorage
from .tokenizer import Tokenizer

__all__ = ["Completion", "Engine", "EngineError", "EngineStats", "Event", "QueueFullError", "Request", "TokenLogprob"]

logger = logging.getLogger("beaconkv.engine")
"""Where the engine logs the failure of a request (with its traceback)."""


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


class Engine(EngineAdmission):
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
        check_engine_sizes(max_batch, prompt_capacity, max_new_tokens, prefill_chunk,
                           model.config.max_position_embeddings)
        setup = DecodeSetup.of(setup, kv_storage=kv_storage, cache_dtype=cache_dtype, kernels=kernels,
                               compile=compile, prefill_chunk=prefill_chunk)
        setup.apply_threads()
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
        self._start_queue(max_batch, seed)
        self._params: list[SamplingParams] = [SamplingParams()] * max_batch
        self._sampling = RowSampling.of(self._params, self.device, vocab_size=self.vocab_size)
        self.session.decoder.prepare(self._sampling)  # written in place by every step (static under CUDA graphs)
        self._tokens = torch.zeros(max_batch, dtype=torch.long, device=self.device)

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size (token ids and logit-bias ids lie in ``0 .. vocab_size - 1``)."""
        return self.model.config.vocab_size

    # ------------------------------------------------------------------------------- requests
    def _start_queue(self, max_batch: int, seed: int) -> None:
        """The request queue's state: statistics, ids, seeds, the lock, the waiting and cancelled requests and
        ``max_batch`` empty places (what every engine that reuses this one's queue sets up)."""
        self.stats = EngineStats()
        self._ids = itertools.count()
        self._seeds = itertools.count(seed)
        self._lock = threading.Lock()
        self._waiting: deque[tuple[int, Request, float, int]] = deque()
        self._cancelled: set[int] = set()
        self._slots: list[RunningRequest | None] = [None] * max_batch

    def validate(self, request: Request) -> None:
        """Checks a request against the pool (called by :meth:`submit`).

        Raises:
            EngineError: See :func:`~beaconkv.engine_requests.check_request`.
        """
        check_request(request, prompt_capacity=self.prompt_capacity, max_new_tokens=self.max_new_tokens,
                      vocab_size=self.vocab_size, has_tokenizer=self.tokenizer is not None)

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
    def _read_logprobs(self, sampling: RowSampling, runs: Sequence[RunningRequest | None],
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

    def _noise(self, runs: Sequence[RunningRequest | None], events: list[Event]) -> Tensor | None:
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

    def _emit_isolated(self, run: RunningRequest, token: int, logprob: TokenLogprob | None, now: float,
                       events: list[Event]) -> None:
        """:meth:`_emit`, failing only this request if its detokenising, stops or callback raise."""
        try:
            self._emit(run, token, logprob, now, events)
        except Exception as err:
            self._fail(run, f"its token could not be handled ({type(err).__name__}: {err})", events, err)

    def _fail(self, run: RunningRequest, reason: str, events: list[Event], err: BaseException | None = None, *,
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

    def _emit(self, run: RunningRequest, token: int, logprob: TokenLogprob | None, now: float,
              events: list[Event]) -> None:
        if not run.tokens:
            run.first_token = now
        run.tokens.append(token)
        self.stats.generated_tokens += 1
        if logprob is not None:
            run.logprobs.append(logprob)
        text, stopped = "", False
        if run.detok is not None:
            run.detok.push(token)
            text, stopped = run.new_text()
        reason = None
        if stopped or token in run.stops:
            reason = "stop"
        elif len(run.tokens) >= run.request.max_new_tokens:
            reason = "length"
        ev = Event(run.id, token, text, logprob=logprob)
        if reason is not None:
            ev.completion = self._finish(run, reason, now)
        self._deliver(run, ev, events)

    def _finish(self, run: RunningRequest, reason: str, now: float) -> Completion:
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

    def _deliver(self, run: RunningRequest, ev: Event, events: list[Event]) -> None:
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

