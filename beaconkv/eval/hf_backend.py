"""The evaluation harness on a transformers model: a :class:`~beaconkv.eval.backend.GenerationBackend` whose
engine runs each sample through ``model.generate`` with a :class:`~beaconkv.hf.PolicyCache`.

:func:`load_hf_backend` loads a checkpoint in transformers (any decoder, e.g. one beaconkv's own decoder does
not run) and beaconkv's tokenizer; pass it to :func:`beaconkv.eval.run` as ``backend=``. Its engine,
:class:`HFEvalEngine`, decodes one request at a time (transformers samples from one global generator, so a
request's tokens depend only on the request when it runs alone, as the loop requires), its ``seed`` seeding
torch's generator; the policy's cache figures are the ``PolicyCache``'s own.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from typing import Any

import torch

from ..arguments import model_path
from ..decode_setup import DecodeSetup
from ..engine import Completion, Event, Request
from ..hf.generation import generate_hf, load_hf_model
from ..policies import EvictionPolicy
from ..tokenizer import Tokenizer, load_tokenizer
from .backend import CacheFigures, GenerationBackend

__all__ = ["HFEvalEngine", "load_hf_backend"]


class HFEvalEngine:
    """An :class:`~beaconkv.eval.backend.EvalEngine` over a transformers model, one request per step.

    Args:
        model: A transformers causal LM.
        tokenizer: beaconkv's tokenizer of the checkpoint (texts, end-of-sequence ids).
        policy: The policy of every request (None: FullKV).
        max_batch: Accepted for the interface; requests run one at a time.
        prompt_capacity: Longest prompt of the run (bounds ``max_new_tokens`` by the model's positions).
        max_new_tokens: Most new tokens a request may generate.
        setup: The run's :class:`~beaconkv.decode_setup.DecodeSetup`: dense storage and no compile only
            (transformers' decode runs eagerly here); its ``prefill_chunk`` prefills longer prompts in chunks
            (``PolicyCache(..., prefill_chunk=)``).

    Raises:
        ValueError: A storage other than dense, ``compile``, or a prompt that leaves no position.
    """

    def __init__(self, model: Any, tokenizer: Tokenizer, *, policy: EvictionPolicy | None, max_batch: int,
                 prompt_capacity: int, max_new_tokens: int, setup: DecodeSetup = DecodeSetup()) -> None:
        prefill_chunk = setup.prefill_chunk
        if setup.kv_storage != "dense" or setup.compile:
            raise ValueError("the transformers backend stores keys and values densely and decodes eagerly; "
                             "run it with kv_storage='dense' and compile=False (--kv-storage dense, no --compile).")
        limit = model.config.get_text_config(decoder=True).max_position_embeddings
        if limit - prompt_capacity < 1:
            raise ValueError(f"the longest prompt has {prompt_capacity} tokens and the model's "
                             f"max_position_embeddings={limit} leaves no room for a new token.")
        self.model, self.tokenizer, self.policy, self.prefill_chunk = model, tokenizer, policy, prefill_chunk
        self.max_new_tokens = min(max_new_tokens, limit - prompt_capacity)
        self._queue: deque[tuple[int, Request, float]] = deque()
        self._figures: dict[int, CacheFigures] = {}
        self._next = 0

    @property
    def idle(self) -> bool:
        """Nothing waiting (a request runs to its end within one step)."""
        return not self._queue

    def submit(self, request: Request) -> int:
        """Queues ``request``; returns its id.

        Raises:
            ValueError: The request asks for stop strings or log-probabilities (not run by this backend).
        """
        if request.stop or request.sampling.logprobs is not None:
            raise ValueError("the transformers backend ends requests at end-of-sequence ids and returns no "
                             "log-probabilities; drop stop strings and logprobs.")
        rid, self._next = self._next, self._next + 1
        self._queue.append((rid, request, time.perf_counter()))
        return rid

    def step(self) -> list[Event]:
        """Runs the next queued request to its end: one event per new token, the last carrying its completion."""
        rid, request, submitted = self._queue.popleft()
        started = time.perf_counter()
        s = request.sampling
        out = generate_hf(self.model, None, [list(request.prompt)], policy=self.policy,
                          max_new_tokens=min(request.max_new_tokens, self.max_new_tokens), temperature=s.temperature,
                          top_p=s.top_p, top_k=s.top_k, seed=rid if request.seed is None else request.seed,
                          eos_token_ids=self.tokenizer.eos_token_ids if request.eos_token_ids is None
                          else list(request.eos_token_ids), prefill_chunk=self.prefill_chunk)
        ids, end = out.token_ids[0], time.perf_counter()
        done = Completion(rid, ids, self.tokenizer.decode(ids), out.finish_reasons[0], len(request.prompt),
                          out.stats.evictions[0], queued_s=started - submitted,
                          time_to_first_token_s=end - submitted, wall_s=end - submitted, slot=0, tag=request.tag)
        self._figures[rid] = CacheFigures(peak_tokens=out.stats.peak_cache_tokens, capacity=out.stats.cache_capacity)
        events = [Event(rid, t, "") for t in ids[:-1]] + [Event(rid, ids[-1] if ids else None, done.text, done)]
        if request.on_event is not None:
            for event in events:
                request.on_event(event)
        return events

    def cache_figures(self, completion: Completion) -> CacheFigures:
        """The ``PolicyCache``'s figures of a finished request (its peak and its capacity)."""
        return self._figures[completion.request_id]


def load_hf_backend(model: str, *, device: str = "auto", dtype: torch.dtype | str = "auto") -> GenerationBackend:
    """A checkpoint in transformers and its beaconkv tokenizer, as the evaluation loop's backend.

    Args:
        model: Checkpoint folder, hub id, or ``"embedded"``.
        device: ``auto``, ``cpu``, ``cuda``...
        dtype: The weights' dtype (or its name).

    Returns:
        The backend (pass it to :func:`beaconkv.eval.run` as ``backend=``).

    Raises:
        UnsupportedArchitectureError: An architecture a :class:`~beaconkv.hf.PolicyCache` does not serve
            (multi-head latent attention, a linear-attention hybrid, ...), refused from its config before the
            weights load (see :mod:`beaconkv.hf.support`).
    """
    path = model_path(model)
    loaded, tokenizer = load_hf_model(path, dtype=dtype, device=device), load_tokenizer(path)
    return GenerationBackend(tokenizer, functools.partial(HFEvalEngine, loaded, tokenizer))
