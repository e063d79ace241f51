"""The admission half of the :class:`~beaconkv.engine.Engine`: waiting requests into free slots.

At every step the engine admits what fits: each admitted request takes a slot and writes its sampling row
(:meth:`EngineAdmission._start`), the admitted prompts are prefilled together into their rows (one by one
if the batch fails, so that only a request whose own prefill fails fails), and each request's first token
is sampled from its prompt's last logits and emitted. A request whose own work fails ends alone, with
``finish_reason="error"``.

:class:`EngineAdmission` is a mixin of :class:`~beaconkv.engine.Engine` and runs on its state: the slots
and their sampling rows, the waiting queue, the session, the counters; the engine provides the failure and
emission paths it calls (``_fail``, ``_emit_isolated``, ``_deliver_safely``) and the noise and
log-probability readers (``_noise``, ``_read_logprobs``).
"""

from __future__ import annotations

import logging
import time

import torch
from torch import Tensor

from .detokenize import IncrementalDetokenizer
from .engine_requests import Completion, Event, Request, RunningRequest, TokenLogprob, stop_ends
from .sampling import SamplingParams, sample_rows

__all__ = ["EngineAdmission"]

logger = logging.getLogger("beaconkv.engine")


class EngineAdmission:
    """Admission of waiting requests into free slots: prefill and first token (mixed into the engine)."""

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

    def _start(self, waiting: tuple[int, Request, float, int], slot: int, events: list[Event]) -> RunningRequest | None:
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
            run = RunningRequest(rid, req, slot, submitted, submitted, gen, frozenset(eos), detok,
                           stop_ends=[(s, stop_ends(s)) for s in req.stop],
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

    def _first_tokens(self, runs: list[RunningRequest], logits: Tensor, events: list[Event]) -> None:
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

    def _sample_first(self, runs: list[RunningRequest], logits: Tensor, noise: Tensor | None,
                      ) -> tuple[list[RunningRequest], list[int], list[TokenLogprob | None]]:
        slots = [r.slot for r in runs]
        part = self._sampling.take(slots)
        first = sample_rows(logits, part, noise)
        self._sampling.put_counts(slots, part)
        self._tokens[torch.tensor(slots, device=self.device)] = first
        tokens = first.tolist()
        return runs, tokens, self._read_logprobs(part, runs, tokens)
