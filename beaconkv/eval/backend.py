"""What the evaluation loop needs from a model, :class:`GenerationBackend`, and how the core library provides it.

The loop runs every pending sample of a rank as one request of a continuous-batching engine, so a
long chain of thought never holds back the short ones: a finished sample leaves its cache slot at
once and the next sample takes it. A backend therefore provides

* a tokenizer that renders the chat template (``apply_chat_template``) and encodes the rendered
  prompt (``encode_prompt``), and
* ``make_engine(...)``, which makes an engine of a fixed pool of slots for the run: an object with
  the small interface :class:`EvalEngine` describes — ``submit`` / ``step`` / ``idle`` from
  :class:`beaconkv.engine.Engine`, plus :meth:`~EvalEngine.cache_figures`, the cache figures of a
  finished request that the results records hold.

:func:`load_backend` loads a checkpoint (a folder, a hub id, or ``"embedded"``) with
:func:`beaconkv.load_model` and :func:`beaconkv.load_tokenizer`; its engines are
:class:`CoreEvalEngine`, a :class:`~beaconkv.engine.Engine` that also reports those figures.
:func:`run_requests` submits requests and yields their completions in the order they finish. Tests
and other model runtimes inject their own backend instead, so the loop runs without a model.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..arguments import model_path
from ..decode_setup import DecodeSetup
from ..engine import Completion, Engine, Event, Request
from ..models.decoder import CausalLM
from ..models.loading import load_model, resolve_dtype
from ..policies import EvictionPolicy
from ..storage import KVStorage
from ..tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "CacheFigures",
    "CoreEvalEngine",
    "EvalEngine",
    "GenerationBackend",
    "load_backend",
    "make_core_engine",
    "resolve_device",
    "resolve_eval_dtype",
    "run_requests",
]


@dataclass(frozen=True)
class CacheFigures:
    """The KV cache figures of one finished request, as a results record holds them.

    Attributes:
        peak_tokens: Most tokens the request's slot held at once.
        capacity: Slots per KV head a cache for this request alone needs (its prompt and the
            engine's ``max_new_tokens`` under the policy), independent of the other requests.
    """

    peak_tokens: int
    capacity: int


class EvalEngine(Protocol):
    """What the evaluation loop drives: a fixed pool of slots that requests flow through.

    :class:`CoreEvalEngine` (a :class:`beaconkv.engine.Engine`) is the real one; a test backend
    provides its own. A request's tokens must depend only on the request (its prompt, sampling
    parameters and ``seed``), never on the requests sharing the pool.

    Attributes:
        max_new_tokens: Most new tokens a request may ask for (the loop asks for exactly this many).
    """

    max_new_tokens: int

    @property
    def idle(self) -> bool:
        """Nothing running and nothing waiting."""
        ...

    def submit(self, request: Request) -> int:
        """Queues a request and returns its id (see :meth:`beaconkv.engine.Engine.submit`)."""
        ...

    def step(self) -> list[Event]:
        """Advances every running request by one token; an event with ``completion`` ends one."""
        ...

    def cache_figures(self, completion: Completion) -> CacheFigures:
        """The cache figures of a finished request (see :class:`CacheFigures`)."""
        ...


class CoreEvalEngine(Engine):
    """A :class:`~beaconkv.engine.Engine` that also reports the cache figures of a finished request.

    Takes the arguments of :class:`~beaconkv.engine.Engine`.
    """

    def cache_figures(self, completion: Completion) -> CacheFigures:
        """The policy's figures for one request of this engine.

        The engine keeps one peak over all its slots, not one per request, so the peak is the
        policy's own bound (:meth:`~beaconkv.policies.base.EvictionPolicy.capacity`) for this prompt
        and the tokens the request wrote to the cache — every new token but the last, which ends it
        before being written: ``prompt + new - 1`` for FullKV, ``prefix + budget`` capped at that
        and never below the prompt for policies that evict when the budget fills. Exact for those;
        an upper bound for policies with their own cadence.

        Args:
            completion: A completion of this engine.

        Returns:
            The request's :class:`CacheFigures`.
        """
        prompt = [completion.prompt_tokens]
        written = max(len(completion.token_ids) - 1, 0)
        return CacheFigures(
            peak_tokens=self.policy.capacity(prompt, written, prefill_chunk=self.prefill_chunk),
            capacity=self.policy.capacity(prompt, self.max_new_tokens, prefill_chunk=self.prefill_chunk),
        )


@dataclass
class GenerationBackend:
    """What the loop needs from a model: a tokenizer and a maker of engines.

    Attributes:
        tokenizer: Has ``apply_chat_template(messages, add_generation_prompt=True, tokenize=False)``
            and ``encode_prompt(text) -> list[int]`` (like :class:`beaconkv.tokenizer.Tokenizer`).
        make_engine: ``make_engine(*, policy, max_batch, prompt_capacity, max_new_tokens, setup)`` returning an :class:`EvalEngine` with ``max_batch`` slots for
            prompts of up to ``prompt_capacity`` tokens; its ``max_new_tokens`` may be lower than
            asked when the model has no room for more positions. ``policy`` is one policy object
            (or ``None`` for FullKV) shared by every slot; ``setup`` is the run's
            :class:`~beaconkv.decode_setup.DecodeSetup` (storage, compile, chunked prefill).
        finish: Called once this rank has generated everything it will, before the ranks' final barrier
            (tensor parallelism: the ranks that mirror this one's engine stop); None: nothing to do.
    """

    tokenizer: Any
    make_engine: Callable[..., EvalEngine]
    finish: Callable[[], None] | None = None


def run_requests(engine: EvalEngine, requests: Iterable[Request]) -> Iterator[Completion]:
    """Submit ``requests`` to ``engine`` and yield each completion as soon as its request finishes.

    Args:
        engine: The engine (idle, or with requests of its own: theirs are not yielded).
        requests: The requests, all submitted before the first step.

    Yields:
        The completions of ``requests``, in the order they finish.

    Raises:
        RuntimeError: The engine went idle before every request finished (a broken engine).
        Exception: A request failed (``finish_reason == "error"``): its exception, raised again — a failed
            sample must not be graded as a wrong answer; the records written so far stay, and a resumed
            run generates the failed sample again.
    """
    ids = {engine.submit(request) for request in requests}
    while ids:
        if engine.idle:
            raise RuntimeError(f"the engine went idle with {len(ids)} submitted requests unfinished")
        for event in engine.step():
            if event.completion is not None and event.request_id in ids:
                ids.discard(event.request_id)
                if event.completion.finish_reason == "error":
                    raise event.completion.exception or RuntimeError(event.completion.error)
                yield event.completion


def resolve_device(device: str) -> str:
    """Turn ``"auto"`` into ``"cuda"`` when a GPU is present, else ``"cpu"``.

    Args:
        device: ``"auto"`` or a torch device string.

    Returns:
        The device string (unchanged unless ``"auto"``).
    """
    if device != "auto":
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_eval_dtype(dtype: str, device: str) -> torch.dtype:
    """Turn ``--dtype`` into a torch dtype: ``"auto"`` is bfloat16 on CUDA and float32 elsewhere.

    Args:
        dtype: ``"auto"``, ``"float32"``, ``"bfloat16"``, ``"float16"`` (or an alias such as ``bf16``).
        device: The resolved device.

    Returns:
        The dtype.

    Raises:
        ValueError: Unknown dtype name.
    """
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return resolve_dtype(dtype)


def make_core_engine(
    model: CausalLM,
    tokenizer: Tokenizer,
    *,
    policy: EvictionPolicy | None,
    max_batch: int,
    prompt_capacity: int,
    max_new_tokens: int,
    setup: DecodeSetup = DecodeSetup(),
    engine_class: type[CoreEvalEngine] = CoreEvalEngine,
) -> CoreEvalEngine:
    """Make the engine of a run with the core library (what :func:`load_backend`'s backend calls).

    When the longest prompt and ``max_new_tokens`` together exceed the model's positions,
    ``max_new_tokens`` is lowered to what fits, with a warning (as :func:`beaconkv.generate` does).

    Args:
        model: The loaded model.
        tokenizer: Its tokenizer (decodes texts; its end-of-sequence ids end requests).
        policy: The policy of every slot (``None``: FullKV).
        max_batch: Slots of the pool.
        prompt_capacity: Longest prompt of the run, in tokens.
        max_new_tokens: New tokens a request may generate.
        setup: The runtime options (storage, compile, chunked prefill, ...) of the run's engine.
        engine_class: The engine's class (tensor parallelism's rank 0 makes one whose steps its ranks mirror).

    Returns:
        The engine.

    Raises:
        ValueError: The longest prompt leaves the model no position for a new token.
    """
    limit = model.config.max_position_embeddings
    room = limit - prompt_capacity
    if room < 1:
        raise ValueError(
            f"the longest prompt has {prompt_capacity} tokens, and the model's "
            f"max_position_embeddings={limit} leaves no room for a new token; evaluate a model with "
            f"more positions or leave that problem out (--limit, or a --data file without it)"
        )
    if max_new_tokens > room:
        warnings.warn(
            f"max_new_tokens={max_new_tokens} capped to {room}: the longest prompt has "
            f"{prompt_capacity} tokens and the model's max_position_embeddings is {limit}",
            stacklevel=2,
        )
        max_new_tokens = room
    return engine_class(
        model,
        tokenizer,
        policy=policy,
        max_batch=max_batch,
        prompt_capacity=prompt_capacity,
        max_new_tokens=max_new_tokens,
        setup=setup,
    )


def load_backend(model: str, *, device: str, dtype: torch.dtype | str) -> GenerationBackend:
    """Load a model and tokenizer with the core library; its engines are :func:`make_core_engine`'s.

    Args:
        model: Checkpoint folder, hub id, or ``"embedded"``.
        device: Torch device string.
        dtype: Torch dtype of the weights (or its name).

    Returns:
        The :class:`GenerationBackend`.

    Raises:
        FileNotFoundError: The checkpoint folder does not exist or the hub id cannot be resolved.
    """
    path = model_path(model)
    loaded = load_model(path, dtype=dtype, device=device)  # its errors name the path and the fix
    tokenizer = load_tokenizer(path)
    return GenerationBackend(tokenizer, functools.partial(make_core_engine, loaded, tokenizer))
