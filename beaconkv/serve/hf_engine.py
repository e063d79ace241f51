"""``beaconkv serve --backend hf``: the server's engine over a transformers model whose cache is a
:class:`~beaconkv.hf.PolicyCache`.

:class:`HFEngine` has the part of the native :class:`~beaconkv.engine.Engine`'s interface the server drives
(:class:`~beaconkv.serve.worker.EngineWorker` and the routes): ``submit`` and ``cancel`` from any thread,
``step`` from the engine thread, ``idle``, ``running``, ``queued``, ``stats``, ``abort``, ``validate``. What it
runs is simpler than the native pool:

* **Concurrent, not batched.** Up to ``max_batch`` requests run at once, each with a ``PolicyCache`` of its
  own; a step admits waiting requests into free places (one prefill forward each, then their first token) and
  decodes one token for every running request, one forward of one token each. Nothing is padded and no request
  waits for another's end, but the forwards are not fused: throughput grows with ``max_batch`` only as far as
  the device overlaps small forwards (on a CPU: not at all).
* **transformers' eager decode step.** No ``--compile``, dense keys and values, the model's own matmuls.
* **beaconkv's sampling.** Tokens are chosen by :func:`~beaconkv.sampling.sample_rows` from the model's logits,
  so temperature, top-p, top-k, logit bias, penalties, log-probabilities and per-request seeds behave as with
  the native engine; a greedy request's tokens are the ones ``model.generate(..., cache=PolicyCache(...))``
  gives (tested). Stop strings and end-of-sequence ids end a request as they do there.

Faults stay with their request: whatever one request's forward, sampling or text handling raises ends that
request with ``finish_reason="error"``; the others go on.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..detokenize import IncrementalDetokenizer
from ..engine import Completion, EngineError, EngineStats, Event, QueueFullError, Request, TokenLogprob
from ..engine_requests import RunningRequest, check_request, stop_ends
from ..hf.cache import PolicyCache
from ..policies.base import EvictionPolicy, FullKV
from ..sampling import RowSampling, race_noise, sample_rows
from ..tokenizer import Tokenizer

__all__ = ["HFEngine"]

logger = logging.getLogger("beaconkv.serve")


@dataclass
class _Run(RunningRequest):
    """A request in one of the engine's places (its ``slot``), with its own cache and sampling state."""

    cache: PolicyCache | None = None
    sampling: RowSampling | None = None


class HFEngine:
    """The server's engine over a transformers causal LM, each request in a :class:`~beaconkv.hf.PolicyCache`.

    Args:
        model: A transformers causal LM (see :func:`~beaconkv.hf.generation.load_hf_model`).
        tokenizer: beaconkv's tokenizer of the checkpoint (text, stop strings, end-of-sequence ids).
        policy: The eviction policy of every request (settings; each cache has its own state). None: FullKV.
        max_batch: Requests running at once (each its own cache and forwards).
        prompt_capacity: Longest prompt a request may have.
        max_new_tokens: Most new tokens a request may ask for.
        max_queue: Most waiting requests before :meth:`submit` raises :class:`~beaconkv.engine.QueueFullError`
            (None: no limit).
        seed: Seeds the generators of requests submitted without a seed (request ``i`` gets ``seed + i``).
        prefill_chunk: Prefill prompts longer than this in chunks, the policy evicting between them
            (``PolicyCache(..., prefill_chunk=)``). None: whole prompts.

    Raises:
        EngineError: Sizes below 1 or beyond the model's positions.
    """

    def __init__(self, model: nn.Module, tokenizer: Tokenizer | None = None, *, policy: EvictionPolicy | None = None,
                 max_batch: int = 8, prompt_capacity: int = 1024, max_new_tokens: int = 1024,
                 max_queue: int | None = None, seed: int = 0, prefill_chunk: int | None = None) -> None:
        for name, value in (("max_batch", max_batch), ("prompt_capacity", prompt_capacity),
                            ("max_new_tokens", max_new_tokens), ("prefill_chunk", prefill_chunk)):
            if value is None and name == "prefill_chunk":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise EngineError(f"{name}={value!r} must be an int >= 1.")
        self.config = model.config.get_text_config(decoder=True)
        limit = self.config.max_position_embeddings
        if prompt_capacity + max_new_tokens > limit:
            raise EngineError(f"prompt_capacity={prompt_capacity} + max_new_tokens={max_new_tokens} exceeds the "
                              f"model's max_position_embeddings={limit}; lower one of them.")
        self.model, self.tokenizer = model, tokenizer
        self.policy = policy if policy is not None else FullKV()
        self.max_batch, self.prompt_capacity, self.max_new_tokens = max_batch, prompt_capacity, max_new_tokens
        self.prefill_chunk, self.max_queue = prefill_chunk, max_queue
        self.device = next(model.parameters()).device
        self.stats = EngineStats()
        self._ids = itertools.count()
        self._seeds = itertools.count(seed)
        self._lock = threading.Lock()
        self._waiting: deque[tuple[int, Request, float, int]] = deque()
        self._cancelled: set[int] = set()
        self._places: list[_Run | None] = [None] * max_batch

    # ------------------------------------------------------------------------------- sizes
    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size (token ids and logit-bias ids lie in ``0 .. vocab_size - 1``)."""
        return self.config.vocab_size

    @property
    def slot_capacity(self) -> int:
        """Cache slots per (request, KV head) a request with the longest prompt gets."""
        return self.policy.capacity([self.prompt_capacity], self.max_new_tokens, prefill_chunk=self.prefill_chunk)

    @property
    def cache_bytes(self) -> int:
        """Bytes of the running requests' keys and values (each cache is allocated at its prefill)."""
        return sum(r.cache.store.nbytes() for r in self._places if r is not None and r.cache.store is not None)

    @property
    def running(self) -> int:
        """Requests running."""
        return sum(r is not None for r in self._places)

    @property
    def queued(self) -> int:
        """Requests waiting for a place."""
        return len(self._waiting)

    @property
    def idle(self) -> bool:
        """Nothing running and nothing waiting."""
        return not self.running and not self._waiting

    # ------------------------------------------------------------------------------- requests
    def validate(self, request: Request) -> None:
        """Checks a request as the native engine does (:func:`~beaconkv.engine_requests.check_request`).

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
                raise QueueFullError(f"{len(self._waiting)} requests are waiting (max_queue={self.max_queue}).")
            rid = next(self._ids)
            seed = request.seed if request.seed is not None else next(self._seeds)
            self._waiting.append((rid, request, time.perf_counter(), seed))
        return rid

    def cancel(self, request_id: int) -> None:
        """Ends a request at the next step (a client that went away). Thread-safe."""
        with self._lock:
            self._cancelled.add(request_id)

    # ------------------------------------------------------------------------------- steps
    @torch.inference_mode()
    def step(self) -> list[Event]:
        """Admits waiting requests (prefill and first token), decodes one token for every running request,
        finishes what is done.

        Returns:
            The events of this step, in place order.
        """
        events: list[Event] = []
        self._apply_cancellations(events)
        self._admit(events)
        if not self.running:
            return events
        t0 = time.perf_counter()
        self.stats.busy_slot_steps += self.running
        for run in list(self._places):
            if run is None:
                continue
            try:
                token = torch.tensor([[run.tokens[-1]]], device=self.device)
                position = torch.tensor([[len(run.request.prompt) + len(run.tokens) - 1]], device=self.device)
                out = self.model(input_ids=token, position_ids=position, cache=run.cache, use_cache=True)
                self._sample(run, out.logits[:, -1], events)
            except Exception as err:
                self._fail(run, f"its decode step failed ({type(err).__name__}: {err})", events, err)
        self.stats.decode_s += time.perf_counter() - t0
        self.stats.steps += 1
        return events

    def abort(self, reason: str) -> list[Event]:
        """Ends every running request with ``finish_reason="error"`` (the caller of :meth:`step` hit a fault).

        Returns:
            The events of the ended requests (their callbacks were called too).
        """
        events: list[Event] = []
        for run in list(self._places):
            if run is not None:
                self._fail(run, reason, events)
        return events

    # ------------------------------------------------------------------------------- internals
    def _admit(self, events: list[Event]) -> None:
        free = [p for p, r in enumerate(self._places) if r is None]
        with self._lock:
            batch = [self._waiting.popleft() for _ in range(min(len(free), len(self._waiting)))]
        t0 = time.perf_counter()
        for (rid, request, submitted, seed), place in zip(batch, free):
            run = None
            try:
                run = self._start(rid, request, submitted, seed, place)
                prompt = torch.tensor([list(map(int, request.prompt))], device=self.device)
                out = self.model(input_ids=prompt, cache=run.cache, use_cache=True, logits_to_keep=1)
                run.admitted = time.perf_counter()
                self._sample(run, out.logits[:, -1], events)
            except Exception as err:
                reason = f"its prefill failed ({type(err).__name__}: {err})"
                if run is not None:
                    self._fail(run, reason, events, err)
                else:
                    self._refuse(rid, request, submitted, reason, err, events)
        if batch:
            self.stats.prefill_s += time.perf_counter() - t0

    def _start(self, rid: int, request: Request, submitted: float, seed: int, place: int) -> _Run:
        generator = None
        if not request.sampling.greedy:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed)
        eos = request.eos_token_ids if request.eos_token_ids is not None else (
            self.tokenizer.eos_token_ids if self.tokenizer is not None else [])
        cache = PolicyCache(self.model, self.policy, max_new_tokens=request.max_new_tokens,
                            prefill_chunk=self.prefill_chunk)
        sampling = RowSampling.of([request.sampling], self.device, vocab_size=self.vocab_size)
        detok = IncrementalDetokenizer(self.tokenizer.decode) if self.tokenizer is not None else None
        run = _Run(rid, request, place, submitted, submitted, generator, frozenset(eos), detok,
                   stop_ends=[(stop, stop_ends(stop)) for stop in request.stop],
                   logprobs=[] if request.sampling.logprobs is not None else None, cache=cache, sampling=sampling)
        self._places[place] = run
        return run

    def _sample(self, run: _Run, logits: Tensor, events: list[Event]) -> None:
        """Chooses ``run``'s next token from its last logits and emits it."""
        logits = logits.float()
        noise = None if run.generator is None else race_noise(1, logits.shape[-1], self.device, run.generator)
        token = int(sample_rows(logits, run.sampling, noise)[0])
        logprob = None
        k = run.request.sampling.logprobs
        if k is not None:
            s = run.sampling
            logprob = TokenLogprob(token, float(s.logprob[0]),
                                   list(zip(s.top_ids[0, :k].tolist(), s.top_logprobs[0, :k].tolist())))
        self._emit(run, token, logprob, events)

    def _emit(self, run: _Run, token: int, logprob: TokenLogprob | None, events: list[Event]) -> None:
        now = time.perf_counter()
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
        reason = "stop" if stopped or token in run.stops else (
            "length" if len(run.tokens) >= run.request.max_new_tokens else None)
        event = Event(run.id, token, text, logprob=logprob)
        if reason is not None:
            event.completion = self._finish(run, reason, now)
        self._deliver(run.request, event, events)

    def _finish(self, run: _Run, reason: str, now: float) -> Completion:
        state = run.cache.state
        evictions = state.stats.evictions[0] if state is not None else 0
        self._places[run.slot] = None
        self.stats.finished += 1
        self.stats.evictions += evictions
        text = "" if run.detok is None else (run.detok.text[: run.sent] if run.request.stop else run.detok.text)
        return Completion(run.id, list(run.tokens), text, reason, len(run.request.prompt), evictions,
                          run.admitted - run.submitted, (run.first_token or now) - run.submitted, now - run.submitted,
                          run.slot, run.request.tag, None if run.logprobs is None else list(run.logprobs))

    def _fail(self, run: _Run, reason: str, events: list[Event], err: BaseException | None = None) -> None:
        if err is not None:
            logger.error("beaconkv serve (hf): request %d failed: %s", run.id, reason, exc_info=err)
        if self._places[run.slot] is not run:
            return
        done = self._finish(run, "error", time.perf_counter())
        done.error, done.exception = f"the request failed: {reason}", err
        self._deliver(run.request, Event(run.id, None, "", done), events, guard=True)

    def _refuse(self, rid: int, request: Request, submitted: float, reason: str, err: BaseException,
                events: list[Event]) -> None:
        """Ends a request that could not start (no place was taken)."""
        logger.error("beaconkv serve (hf): request %d could not start: %s", rid, reason, exc_info=err)
        now = time.perf_counter()
        self.stats.finished += 1
        done = Completion(rid, [], "", "error", len(request.prompt), 0, now - submitted, 0.0, now - submitted, -1,
                          request.tag, error=f"the request failed: {reason}", exception=err)
        self._deliver(request, Event(rid, None, "", done), events, guard=True)

    def _deliver(self, request: Request, event: Event, events: list[Event], guard: bool = False) -> None:
        events.append(event)
        if request.on_event is None:
            return
        if not guard:
            request.on_event(event)
            return
        try:
            request.on_event(event)
        except Exception:
            logger.exception("beaconkv serve (hf): the on_event callback of request %d failed", event.request_id)

    def _apply_cancellations(self, events: list[Event]) -> None:
        with self._lock:
            cancelled, self._cancelled = self._cancelled, set()
            waiting = [w for w in self._waiting if w[0] in cancelled]
            self._waiting = deque(w for w in self._waiting if w[0] not in cancelled)
        now = time.perf_counter()
        for rid, request, submitted, _ in waiting:
            self.stats.finished += 1
            done = Completion(rid, [], "", "cancelled", len(request.prompt), 0, now - submitted, 0.0,
                              now - submitted, -1, request.tag)
            self._deliver(request, Event(rid, None, "", done), events, guard=True)
        for run in list(self._places):
            if run is not None and run.id in cancelled:
                self._deliver(run.request, Event(run.id, None, "", self._finish(run, "cancelled", now)), events,
                              guard=True)

