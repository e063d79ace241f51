"""``beaconkv serve --backend hf``: the server's engine over a transformers model whose cache is a
:class:`~beaconkv.hf.PolicyCache`.

:class:`HFEngine` is an :class:`~beaconkv.engine.Engine` (the interface the server drives: ``submit`` and
``cancel`` from any thread, ``step`` from the engine thread, ``idle``, ``running``, ``queued``, ``stats``,
``abort``, ``validate``; the queue, the checks and the token handling are the engine's own) whose step runs a
transformers model. What it runs is simpler than the native pool:

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

import time
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..detokenize import IncrementalDetokenizer
from ..engine import Completion, Engine, Event, Request, TokenLogprob
from ..engine_requests import RunningRequest, check_engine_sizes, stop_ends
from ..hf.cache import PolicyCache
from ..policies.base import EvictionPolicy, FullKV
from ..sampling import RowSampling, race_noise, sample_rows
from ..tokenizer import Tokenizer

__all__ = ["HFEngine"]

@dataclass
class _Run(RunningRequest):
    """A request in one of the engine's places (its ``slot``), with its own cache and sampling state."""

    cache: PolicyCache | None = None
    sampling: RowSampling | None = None


class HFEngine(Engine):
    """The server's engine over a transformers causal LM, each request in a :class:`~beaconkv.hf.PolicyCache`.

    An :class:`~beaconkv.engine.Engine` whose slots are places of concurrent requests: it keeps the engine's
    queue, checks, cancellations, token handling (stop strings, end-of-sequence ids, events) and fault isolation
    (``submit``, ``cancel``, ``validate``, ``abort``, ``running``, ``queued``, ``idle``, ``run``) and replaces what
    runs the model: :meth:`step` (a prefill forward per admitted request, then one forward of one token per
    running request) and what a finished request frees (its own cache).

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
        # not Engine.__init__: no session, no pool of slots; the attributes the inherited methods read
        self.config = model.config.get_text_config(decoder=True)
        check_engine_sizes(max_batch, prompt_capacity, max_new_tokens, prefill_chunk,
                           self.config.max_position_embeddings)
        self.model, self.tokenizer = model, tokenizer
        self.policy = policy if policy is not None else FullKV()
        self.max_batch, self.prompt_capacity, self.max_new_tokens = max_batch, prompt_capacity, max_new_tokens
        self.prefill_chunk, self.max_queue, self.on_step = prefill_chunk, max_queue, None
        self.device = next(model.parameters()).device
        self._start_queue(max_batch, seed)

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
        return sum(r.cache.store.nbytes() for r in self._slots if r is not None and r.cache.store is not None)

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
        for run in list(self._slots):
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

    # ------------------------------------------------------------------------------- internals
    def _admit(self, events: list[Event]) -> None:
        free = [p for p, r in enumerate(self._slots) if r is None]
        with self._lock:
            batch = [self._waiting.popleft() for _ in range(min(len(free), len(self._waiting)))]
        t0 = time.perf_counter()
        for waiting, place in zip(batch, free):
            try:
                run = self._begin(waiting, place)
            except Exception as err:  # its cache or sampling could not be made: it ends alone, no place taken
                rid, request, submitted, _ = waiting
                now = time.perf_counter()
                self.stats.finished += 1
                done = Completion(rid, [], "", "error", len(request.prompt), 0, now - submitted, 0.0, now - submitted,
                                  -1, request.tag, error=f"the request failed: it could not start ({err})",
                                  exception=err)
                self._deliver_safely(request, Event(rid, None, "", done), events)
                continue
            try:
                prompt = torch.tensor([list(map(int, run.request.prompt))], device=self.device)
                out = self.model(input_ids=prompt, cache=run.cache, use_cache=True, logits_to_keep=1)
                run.admitted = time.perf_counter()
                self._sample(run, out.logits[:, -1], events)
            except Exception as err:
                self._fail(run, f"its prefill failed ({type(err).__name__}: {err})", events, err)
        if batch:
            self.stats.prefill_s += time.perf_counter() - t0

    def _begin(self, waiting: tuple[int, Request, float, int], place: int) -> _Run:
        """Takes ``place`` for a waiting request: its generator, cache (allocated at its prefill) and sampling."""
        rid, request, submitted, seed = waiting
        generator = None
        if not request.sampling.greedy:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed)
        eos = request.eos_token_ids if request.eos_token_ids is not None else (
            self.tokenizer.eos_token_ids if self.tokenizer is not None else [])
        detok = IncrementalDetokenizer(self.tokenizer.decode) if self.tokenizer is not None else None
        run = _Run(rid, request, place, submitted, submitted, generator, frozenset(eos), detok,
                   stop_ends=[(stop, stop_ends(stop)) for stop in request.stop],
                   logprobs=[] if request.sampling.logprobs is not None else None,
                   cache=PolicyCache(self.model, self.policy, max_new_tokens=request.max_new_tokens,
                                     prefill_chunk=self.prefill_chunk),
                   sampling=RowSampling.of([request.sampling], self.device, vocab_size=self.vocab_size))
        self._slots[place] = run
        return run

    def _sample(self, run: _Run, logits: Tensor, events: list[Event]) -> None:
        """Chooses ``run``'s next token from its last logits and emits it (the engine's token handling)."""
        logits = logits.float()
        noise = None if run.generator is None else race_noise(1, logits.shape[-1], self.device, run.generator)
        token = int(sample_rows(logits, run.sampling, noise)[0])
        logprob = None
        k = run.request.sampling.logprobs
        if k is not None:
            s = run.sampling
            logprob = TokenLogprob(token, float(s.logprob[0]),
                                   list(zip(s.top_ids[0, :k].tolist(), s.top_logprobs[0, :k].tolist())))
        self._emit_isolated(run, token, logprob, time.perf_counter(), events)

    def _finish(self, run: _Run, reason: str, now: float) -> Completion:
        """Frees ``run``'s place and cache; its completion."""
        state = run.cache.state
        evictions = state.stats.evictions[0] if state is not None else 0
        self._slots[run.slot] = None
        self.stats.finished += 1
        self.stats.evictions += evictions
        text = "" if run.detok is None else (run.detok.text[: run.sent] if run.request.stop else run.detok.text)
        return Completion(run.id, list(run.tokens), text, reason, len(run.request.prompt), evictions,
                          run.admitted - run.submitted, (run.first_token or now) - run.submitted, now - run.submitted,
                          run.slot, run.request.tag, None if run.logprobs is None else list(run.logprobs))
