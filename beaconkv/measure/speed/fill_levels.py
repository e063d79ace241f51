"""Decode speed of a long generation from a few cache fill levels: measured, then integrated.

A 32K-token generation at batch 14 takes minutes to decode on any GPU, more than the few minutes a GPU check
may spend; and what a step costs depends only on what the cache holds at that step. So the speed of the
whole generation is read from a few points of it:

1. **fill**: :func:`fill_rows` puts every row of a :class:`~beaconkv.session.Session` in the state it has
   ``fill`` tokens into a generation — admitted with a prompt of that length (the policy's own bookkeeping:
   positions, protected prefix, evictable count), keys and values of every layer written through the cache's
   own prefill writes (random values, as the model's weights are: a step's speed does not depend on them),
   then the policy's after-prefill work;
2. **time**: :func:`time_window` decodes a window of steps through the real session (the same executor,
   CUDA graphs replayed) and times the whole window between two device synchronisations, so that the host's
   work overlaps the device's as in a real run; a window that crosses an eviction gives that eviction's cost
   over the steps around it;
3. **integrate**: :func:`integrate_generation` walks the generation step by step — the tokens held grow by
   one per step and, for an evicting policy, drop to the kept count at each eviction (the schedule's
   sawtooth) — and adds the step time linearly interpolated between the measured fills (constant beyond
   them) and one eviction's time per eviction. Tokens per second = ``batch · new_tokens / total``.

The decode step attends over the cache's whole fixed capacity (static shapes, for CUDA graphs), so a FullKV
step costs about the same empty or full; measuring at several fills shows whether it does.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ...sampling import RowSampling, SamplingParams
from ...session import Session
from .machine import sync

__all__ = ["FillPoint", "GenerationEstimate", "fill_rows", "integrate_generation", "time_window"]

FILL_CHUNK = 1024
"""Tokens per write when filling a cache: the random keys and values of one chunk of one layer are the only
temporary memory (``2 · batch · kv_heads · FILL_CHUNK · head_dim`` values)."""


@dataclass(frozen=True)
class FillPoint:
    """The decode speed at one fill level.

    Attributes:
        fill: Tokens each row held at the window's first step (prompt included).
        steps: Steps timed.
        ms_per_step: Mean milliseconds per step over the window (one token for every row).
    """

    fill: int
    steps: int
    ms_per_step: float


@dataclass
class GenerationEstimate:
    """A whole generation's decode time, integrated from measured fills (see the module docstring).

    Attributes:
        new_tokens: Tokens each row generates.
        batch: Rows.
        decode_s: Seconds of the decode steps.
        eviction_s: Seconds of the evictions (``evictions · eviction_ms``).
        evictions: Evictions per row over the generation.
        tokens_per_s: ``batch · new_tokens / (decode_s + eviction_s)``.
        method: How it was computed, in words.
        points: The measured fills.
    """

    new_tokens: int
    batch: int
    decode_s: float
    eviction_s: float
    evictions: int
    tokens_per_s: float
    method: str
    points: list[FillPoint] = field(default_factory=list)


def fill_rows(session: Session, fill: int, seed: int = 0, chunk: int = FILL_CHUNK) -> None:
    """Puts every row of ``session`` in the state it has after a prompt of ``fill`` tokens (see the module docstring).

    Rows already decoding are released first. Nothing is decoded; the policy's after-prefill work runs (it evicts
    a row whose evictable tokens reached its budget, as after a real prompt).

    Args:
        session: The session.
        fill: Tokens each row holds (at most the cache's capacity).
        seed: Seeds the random keys and values.
        chunk: Tokens written per call (bounds the temporary memory).

    Raises:
        ValueError: ``fill`` below 1 or above the capacity.
    """
    capacity = session.cache.capacity
    if not 1 <= fill <= capacity:
        raise ValueError(f"fill={fill} must be in 1 .. the cache's capacity {capacity}.")
    rows = list(range(session.batch))
    if any(session.state.live):
        session.release(rows)
    session.admit(rows, [fill] * len(rows))
    model, device = session.model, session.device
    cfg = model.config
    g = torch.Generator(device=device).manual_seed(seed)
    b, kv, d = session.batch, cfg.num_key_value_heads, cfg.head_dim
    with torch.inference_mode():
        for layer in range(cfg.num_hidden_layers):
            cache = session.cache[layer]
            for start in range(0, fill, chunk):
                n = min(chunk, fill - start)
                k = torch.randn(b, kv, n, d, dtype=model.dtype, device=device, generator=g)
                v = torch.randn(b, kv, n, d, dtype=model.dtype, device=device, generator=g)
                positions = torch.arange(start, start + n, device=device).expand(b, n)
                valid = torch.ones(b, n, dtype=torch.bool, device=device)
                write = cache.write_prefill if start == 0 else cache.write_chunk
                write(k, v, positions, valid)
    session.after_prefill(rows)


def time_window(session: Session, steps: int, tokens: torch.Tensor | None = None,
                sampling: RowSampling | None = None) -> tuple[float, torch.Tensor]:
    """Decodes ``steps`` steps of every row and times them together.

    Args:
        session: A session whose rows are live.
        steps: Steps in the window.
        tokens: ``(batch,)`` the first step's tokens (None: token 0 in every row).
        sampling: Each row's sampling (None: greedy).

    Returns:
        ``(seconds of the window, the next tokens)``.
    """
    device = session.device
    if tokens is None:
        tokens = torch.zeros(session.batch, dtype=torch.long, device=device)
    if sampling is None:
        sampling = RowSampling.of([SamplingParams()] * session.batch, device)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        tokens = session.step(tokens, sampling)
    sync(device)
    return time.perf_counter() - t0, tokens


def integrate_generation(points: Sequence[FillPoint], prompt: int, new_tokens: int, batch: int, *,
                         budget: int | None = None, kept: int | None = None,
                         eviction_ms: float = 0.0) -> GenerationEstimate:
    """A generation's decode time from the step times measured at a few fills (see the module docstring).

    Args:
        points: Measured fills (at least one).
        prompt: The prompt's tokens (protected: never evicted).
        new_tokens: Tokens each row generates.
        batch: Rows.
        budget: An evicting policy's evictable tokens at which it evicts (None: it never evicts).
        kept: The evictable tokens an eviction keeps.
        eviction_ms: Milliseconds of one eviction (of every row).

    Returns:
        The estimate.

    Raises:
        ValueError: No points, or ``budget`` without a ``kept`` below it.
    """
    if not points:
        raise ValueError("integrate_generation needs at least one measured fill.")
    if budget is not None and (kept is None or not 0 <= kept < budget):
        raise ValueError(f"kept={kept!r} must be in 0 .. budget-1 (budget {budget}) for an evicting policy.")
    ordered = sorted(points, key=lambda p: p.fill)
    xs = np.array([p.fill for p in ordered], dtype=np.float64)
    ys = np.array([p.ms_per_step for p in ordered], dtype=np.float64)
    if budget is None:
        fills = prompt + np.arange(new_tokens, dtype=np.float64)
        evictions = 0
    else:  # the sawtooth: evictable tokens grow by one per step; at the budget an eviction leaves `kept`
        evictable = np.empty(new_tokens, dtype=np.float64)
        held, evictions = 0, 0
        for n in range(new_tokens):
            evictable[n] = held
            held += 1
            if held >= budget:
                held, evictions = kept, evictions + 1
        fills = prompt + evictable
    decode_s = float(np.interp(fills, xs, ys).sum()) / 1e3
    eviction_s = evictions * eviction_ms / 1e3
    method = (f"decode ms/step measured at cache fills {', '.join(str(p.fill) for p in ordered)} "
              f"({', '.join(f'{p.ms_per_step:.2f}' for p in ordered)} ms; each the mean of a window of "
              f"{ordered[0].steps} replayed steps), linearly interpolated (constant beyond) and summed over the "
              f"{new_tokens} steps of the generation")
    if budget is not None:
        method += (f", the tokens held following the schedule's sawtooth (evict at {budget} evictable, keep {kept}), "
                   f"plus {evictions} evictions of {eviction_ms:.1f} ms each")
    total = decode_s + eviction_s
    return GenerationEstimate(new_tokens, batch, decode_s, eviction_s, evictions,
                              batch * new_tokens / total if total > 0 else math.inf, method, list(ordered))
