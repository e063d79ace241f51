"""The paper's Table 4 for a whole 32K-token generation: peak memory and tokens/s of FullKV and BeaconKV(2048) at
batch 14, then at the largest batch each fits in 90% of the device — the first stage of ``scripts/gpu_check.sh``.

The paper (Qwen3-4B, a 32K-token generation, batch 14, an A100 80 GB): FullKV 77.0 GB, 82.3 tok/s; BeaconKV at
budget 2048 13.3 GB, 356.4 tok/s (5.8x less memory, 4.3x the throughput); at equal memory, batch 192 against 14.

Per (policy, batch), one :class:`~beaconkv.session.Session` sized for the whole generation (FullKV:
``prompt + new_tokens`` slots; BeaconKV: ``n_prefix + budget``), run through the default execution (on CUDA the
eager step and the evictions recorded as CUDA graphs):

* **tokens/s** of the whole generation from a few cache fill levels (:mod:`.fill_levels`): FullKV at the start,
  a third, two thirds and the end of the generation; BeaconKV after an eviction, just below its budget, and one
  eviction's cost, integrated over the schedule's sawtooth;
* **peak memory**: ``torch.cuda.max_memory_allocated`` from the session's creation to its last step (weights,
  cache, the policy's state, graph memory and activations; the first fill is a real prefill of the prompt);
  beside it the prediction of :func:`~beaconkv.measure.memory.memory_plan` from the config alone, flagged when
  they differ by more than :data:`PEAK_TOLERANCE`. On a CPU (the rehearsal) nothing measures a peak: the
  prediction stands alone;
* **the largest batch** of each policy is :func:`~beaconkv.measure.memory.memory_plan`'s for 90% of the device
  (:data:`MEMORY_FRACTION`), measured the same way; one whose measured peak is over that memory is measured again
  at the batch its measured bytes per sequence allow.

Each measurement starts only if its estimated time fits what the deadline leaves (:class:`Deadline`); a line is
printed as soon as each figure exists, and ``table4.json`` is rewritten after each row.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ...execution import CompileConfig
from ...measure.memory import memory_plan
from ...models.decoder import CausalLM
from ...policies.base import EvictionPolicy, FullKV
from ...policies.registry import make_policy
from ...session import Session
from .engine_bench import policy_settings
from .fill_levels import FillPoint, fill_rows, integrate_generation, time_window
from .machine import random_prompts
from .table4 import PAPER_TABLE4

__all__ = ["MEMORY_FRACTION", "PEAK_TOLERANCE", "Deadline", "Table4Measurement", "Table4Setting", "compare_peak",
           "make_table4_policy", "markdown_table4_generation", "measure_policy", "run_table4_generation"]

MEMORY_FRACTION = 0.9
"""The share of the device's memory the largest batch is planned in (the issue's 90%)."""
PEAK_TOLERANCE = 0.10
"""A measured peak further than this from :func:`~beaconkv.measure.memory.memory_plan`'s prediction is flagged."""


class Deadline:
    """Seconds left until a fixed moment, and whether a piece of work of a given estimate still fits.

    Args:
        at: The moment (``time.time()`` seconds); None: no deadline.
        clock: The clock (``time.time``; tests pass a fake one).
    """

    def __init__(self, at: float | None, clock: Callable[[], float] = time.time) -> None:
        self.at, self.clock = at, clock

    def left(self) -> float:
        """Seconds left (infinite without a deadline; never below 0)."""
        return math.inf if self.at is None else max(0.0, self.at - self.clock())

    def fits(self, need_s: float) -> bool:
        """Whether ``need_s`` seconds of work fit what is left."""
        return need_s <= self.left()

    def skipped(self, need_s: float) -> str:
        """The line that says a piece of work was skipped: ``skipped: would need ~N s, M s left``."""
        need = f"{need_s:.0f}" if need_s >= 10 else f"{need_s:.1f}"
        return f"skipped: would need ~{need} s, {self.left():.0f} s left"


@dataclass(frozen=True)
class Table4Setting:
    """What the stage measures.

    Attributes:
        batch: The paper's batch (14).
        new_tokens: Tokens each sequence generates (32768).
        prompt: Prompt tokens (64; protected, never evicted).
        budget: BeaconKV's budget (2048).
        window: Steps timed per fill level.
        fractions: Fills of a FullKV generation measured, as fractions of it (0: just after the prompt).
        device_memory: Bytes the largest batch is planned in before :data:`MEMORY_FRACTION` (None: the device's own;
            on a CPU without it the largest-batch part is skipped).
        max_batch: Most sequences the largest-batch part measures.
    """

    batch: int = 14
    new_tokens: int = 32768
    prompt: int = 64
    budget: int = 2048
    window: int = 8
    fractions: tuple[float, ...] = (0.0, 1 / 3, 2 / 3, 1.0)
    device_memory: int | None = None
    max_batch: int = 512


@dataclass
class Table4Measurement:
    """One policy at one batch.

    Attributes:
        policy: ``"full"`` or ``"beacon"``.
        budget: BeaconKV's budget (None for FullKV).
        batch: Sequences.
        label: ``"batch N"`` (the paper's) or ``"largest batch"``.
        cache_capacity: Slots per (sequence, KV head).
        kv_cache_bytes: Keys and values allocated.
        peak_bytes: Measured peak (``torch.cuda.max_memory_allocated``; None on a CPU).
        predicted_peak_bytes: :func:`~beaconkv.measure.memory.memory_plan`'s peak.
        peak_error: ``measured / predicted - 1`` (None without a measurement).
        peak_flagged: ``|peak_error| > PEAK_TOLERANCE``.
        tokens_per_s: The whole generation's tokens per second (integrated; see :mod:`.fill_levels`).
        ms_per_step: Mean step time at each measured fill, ``{fill: ms}``.
        eviction_ms: One eviction's milliseconds (None for FullKV).
        evictions: Evictions per sequence over the generation.
        decode_s: Seconds the generation's decode takes (evictions included).
        wall_s: Seconds this measurement took.
        method: How tokens/s was computed.
        executor: The decode step's executor (``GraphExecutor``: recorded CUDA graphs; ``EagerExecutor``...).
    """

    policy: str
    budget: int | None
    batch: int
    label: str
    cache_capacity: int
    kv_cache_bytes: int
    peak_bytes: int | None
    predicted_peak_bytes: int
    peak_error: float | None
    peak_flagged: bool
    tokens_per_s: float
    ms_per_step: dict[int, float] = field(default_factory=dict)
    eviction_ms: float | None = None
    evictions: int = 0
    decode_s: float = 0.0
    wall_s: float = 0.0
    method: str = ""
    executor: str = ""

    def line(self) -> str:
        """One printed line: the row's figures, the prediction beside the measured peak."""
        name = "FullKV" if self.policy == "full" else f"BeaconKV({self.budget})"
        if self.peak_bytes is None:
            peak = f"peak not measured on this device (predicted {self.predicted_peak_bytes / 2**30:.2f} GiB)"
        else:
            peak = (f"peak {self.peak_bytes / 2**30:.2f} GiB (predicted {self.predicted_peak_bytes / 2**30:.2f}, "
                    f"{100 * self.peak_error:+.1f}%{' FLAGGED: over 10% off' if self.peak_flagged else ''})")
        evict = f", eviction {self.eviction_ms:.1f} ms x {self.evictions}" if self.eviction_ms is not None else ""
        steps = ", ".join(f"{ms:.2f}" for ms in self.ms_per_step.values())
        return (f"{name} [{self.label}] batch {self.batch}: {self.tokens_per_s:.1f} tok/s over the generation "
                f"({self.decode_s:.0f} s; ms/step at fills {', '.join(map(str, self.ms_per_step))}: {steps}{evict}), "
                f"KV {self.kv_cache_bytes / 2**30:.2f} GiB, {peak} [{self.wall_s:.0f} s]")


def compare_peak(measured: int | None, predicted: int) -> tuple[float | None, bool]:
    """``(measured / predicted - 1, flagged)``: flagged when more than :data:`PEAK_TOLERANCE` apart."""
    if measured is None:
        return None, False
    error = measured / predicted - 1
    return error, abs(error) > PEAK_TOLERANCE


def make_table4_policy(name: str, setting: Table4Setting) -> EvictionPolicy:
    """FullKV, or BeaconKV at the setting's budget with the prompt protected (``n_prefix`` = the prompt: the
    default, made explicit so that a fill past the prompt counts as generated tokens); its ``n_recent`` scaled
    down below budget 128 as everywhere in the benchmarks (:func:`~.engine_bench.policy_settings`)."""
    if name == "full":
        return FullKV()
    return make_policy(name, **policy_settings(setting.budget), n_prefix=setting.prompt)


def _fills(setting: Table4Setting, capacity: int) -> list[int]:
    """FullKV's measured fills: the fractions of the generation, each leaving room for its window."""
    last = capacity - setting.window - 2
    return sorted({min(setting.prompt + round(f * setting.new_tokens), last) for f in setting.fractions})


def measure_policy(model: CausalLM, name: str, batch: int, setting: Table4Setting, label: str,
                   compile_config: bool | CompileConfig, log: Callable[[str], None] = print) -> Table4Measurement:
    """Measures one policy at one batch (see the module docstring).

    Args:
        model: The model.
        name: ``"full"`` or ``"beacon"``.
        batch: Sequences.
        setting: The stage's setting.
        label: The row's label.
        compile_config: The session's execution (``True``: the default, CUDA graphs on CUDA).
        log: Progress lines.

    Returns:
        The row.
    """
    t0 = time.perf_counter()
    device = model.device
    cuda = device.type == "cuda"
    policy = make_table4_policy(name, setting)
    predicted = memory_plan(model.config, [policy], batch, setting.new_tokens, prompt=setting.prompt,
                            dtype=model.dtype)[0]
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    session = Session.for_prompts(model, policy, [setting.prompt] * batch, setting.new_tokens, compile=compile_config)
    w = setting.window
    points: list[FillPoint] = []
    session.prefill(random_prompts(batch, setting.prompt, model.config.vocab_size))  # the real path, once
    time_window(session, 3)  # the step runs eagerly, is recorded, then replayed (graphs: one shape per session)
    budget = kept = None
    eviction_ms = None
    if not policy.evicts:
        for i, fill in enumerate(_fills(setting, session.cache.capacity)):
            if fill != setting.prompt or i:  # the first point: where the real prompt and the warm-up left the rows
                fill_rows(session, fill, seed=i)
                time_window(session, 1)
            held = _held(session)
            seconds, _ = time_window(session, w)
            points.append(FillPoint(held, w, 1e3 * seconds / w))
    else:
        top = setting.prompt + setting.budget - 1  # one step to the budget: that step evicts
        for i in range(3):  # evictions of every row: eager, recorded, replayed (and the step's warm-up)
            fill_rows(session, top, seed=10 + i)
            time_window(session, 1)
        kept = session.state.count[0]
        budget = setting.budget
        room = budget - kept - 2  # steps before the next eviction
        if room < 2:
            raise ValueError(f"BeaconKV({budget}) keeps {kept}: too few steps between evictions to time a window.")
        w = min(w, room)
        seconds, _ = time_window(session, w)  # just after an eviction
        points.append(FillPoint(setting.prompt + kept, w, 1e3 * seconds / w))
        fill_rows(session, top - w, seed=20)  # just below the budget
        seconds, _ = time_window(session, w)
        points.append(FillPoint(top - w, w, 1e3 * seconds / w))
        fill_rows(session, top, seed=21)  # a window whose first step evicts
        seconds, _ = time_window(session, w)
        # the window's steps at their fills (the first at the budget, the rest after the eviction), interpolated
        # between the two points; what the window took beyond them is the eviction (never below 0: noise)
        expected = _interpolate(points, [top] + [setting.prompt + kept + j for j in range(w - 1)])
        eviction_ms = max(0.0, 1e3 * seconds - expected)
    estimate = integrate_generation(points, setting.prompt, setting.new_tokens, batch, budget=budget, kept=kept,
                                    eviction_ms=eviction_ms or 0.0)
    peak = torch.cuda.max_memory_allocated(device) if cuda else None
    error, flagged = compare_peak(peak, predicted.peak_bytes)
    row = Table4Measurement(
        name, None if name == "full" else setting.budget, batch, label, session.cache.capacity, session.cache.nbytes(),
        peak, predicted.peak_bytes, error, flagged, estimate.tokens_per_s,
        {p.fill: round(p.ms_per_step, 3) for p in estimate.points}, eviction_ms, estimate.evictions,
        estimate.decode_s + estimate.eviction_s, time.perf_counter() - t0, estimate.method,
        type(session.decoder).__name__)
    del session
    if cuda:
        torch.cuda.empty_cache()
    return row


def _held(session: Session) -> int:
    """Tokens the first row holds now (its protected prefix and its evictable tokens)."""
    return session.state.prefix[0] + session.state.count[0]


def _interpolate(points: list[FillPoint], fills: list[int]) -> float:
    """Milliseconds of steps at ``fills``, interpolated between the measured points."""
    import numpy as np

    ordered = sorted(points, key=lambda p: p.fill)
    return float(np.interp(fills, [p.fill for p in ordered], [p.ms_per_step for p in ordered]).sum())


def _step_bytes(row: Any) -> int:
    """What one decode step reads, roughly: the weights and the cache (a plan's :class:`MemoryRow`)."""
    return row.weights_bytes + row.kv_bytes


def _oom_types() -> tuple[type[BaseException], ...]:
    return (torch.cuda.OutOfMemoryError,) if torch.cuda.is_available() else ()


def run_table4_generation(model: CausalLM, setting: Table4Setting, compile_config: bool | CompileConfig,
                          deadline: Deadline, first_estimate_s: dict[str, float], log: Callable[[str], None] = print,
                          out: Path | None = None, label: str = "",
                          largest_deadline: Deadline | None = None) -> dict[str, Any]:
    """The stage: predictions first, then FullKV and BeaconKV at the paper's batch, then at each one's largest batch.

    Args:
        model: The model (the Qwen3-4B shape on a GPU).
        setting: What to measure.
        compile_config: The sessions' execution.
        deadline: Each measurement starts only if its estimate fits.
        first_estimate_s: Seconds a policy's first measurement is expected to take, by name (later ones are scaled
            from the same policy's last: by the bytes a step reads).
        log: Lines, printed as soon as they exist.
        out: Where ``table4.json`` is rewritten after each row (None: nowhere).
        label: The model's description.
        largest_deadline: What the largest-batch measurements must fit (earlier than ``deadline`` by what the later
            stages need: the paper's batch comes first); None: ``deadline``.

    Returns:
        The JSON-able result: settings, predictions, rows, skipped parts and the paper's figures.
    """
    device = model.device
    cuda = device.type == "cuda"
    memory = setting.device_memory
    if memory is None and cuda:
        memory = torch.cuda.get_device_properties(device).total_memory
    names = ("full", "beacon")
    result: dict[str, Any] = {
        "model": label, "dtype": str(model.dtype).removeprefix("torch."), "device": str(device),
        "setting": asdict(setting), "device_memory_bytes": memory, "memory_fraction": MEMORY_FRACTION,
        "execution": ("default (CUDA graphs of the eager step on CUDA)" if compile_config is True
                      else repr(compile_config)),
        "predicted": [], "rows": [], "skipped": [], "paper": PAPER_TABLE4}

    def save() -> None:
        if out is not None:
            out.write_text(json.dumps(result, indent=1, default=str))

    plan = memory_plan(model.config, [make_table4_policy(n, setting) for n in names], setting.batch,
                       setting.new_tokens, prompt=setting.prompt, dtype=model.dtype, device_memory=memory,
                       memory_fraction=MEMORY_FRACTION)
    for name, row in zip(names, plan):
        fits = "" if row.max_batch is None else (
            f"; largest batch in {MEMORY_FRACTION:.0%} of {memory / 2**30:.1f} GiB: {row.max_batch}")
        log(f"predicted {name}: batch {setting.batch}, KV {row.kv_bytes / 2**30:.2f} GiB, peak "
            f"{row.peak_bytes / 2**30:.2f} GiB{fits}")
        result["predicted"].append({k: v for k, v in asdict(row).items() if k != "workspace"})
    save()
    parts = [(name, setting.batch, f"batch {setting.batch}") for name in names]
    for name, row in zip(names, plan):
        if row.max_batch is None:
            result["skipped"].append({"part": f"{name} [largest batch]", "why": "no device memory given"})
            log(f"{name} [largest batch]: skipped: no device memory to plan in (a CPU run without --device-memory)")
        elif row.max_batch < 1:
            result["skipped"].append({"part": f"{name} [largest batch]", "why": "not one sequence fits"})
            log(f"{name} [largest batch]: skipped: not one sequence fits {MEMORY_FRACTION:.0%} of the device")
        else:
            parts.append((name, min(row.max_batch, setting.max_batch), "largest batch"))
    last: dict[str, tuple[Table4Measurement, Any]] = {}  # each policy's last row and its plan at that batch
    usable = None if memory is None else MEMORY_FRACTION * memory
    queue = list(parts)
    while queue:
        name, batch, part = queue.pop(0)
        planned = memory_plan(model.config, [make_table4_policy(name, setting)], batch, setting.new_tokens,
                              prompt=setting.prompt, dtype=model.dtype)[0]
        if name in last:
            row0, plan0 = last[name]
            need = 1.3 * row0.wall_s * max(1.0, _step_bytes(planned) / _step_bytes(plan0))
        else:
            need = first_estimate_s.get(name, 60.0)
        limit = largest_deadline if part == "largest batch" and largest_deadline is not None else deadline
        if not limit.fits(need):
            log(f"{name} [{part}] batch {batch}: {limit.skipped(need)}")
            result["skipped"].append({"part": f"{name} [{part}] batch {batch}", "need_s": round(need, 1),
                                      "left_s": round(limit.left(), 1)})
            save()
            continue
        try:
            row = measure_policy(model, name, batch, setting, part, compile_config, log)
        except _oom_types():
            torch.cuda.empty_cache()
            smaller = max(1, int(batch * 0.9))
            log(f"{name} [{part}] batch {batch}: out of memory" + (f"; trying batch {smaller}" if batch > 1 else ""))
            result["skipped"].append({"part": f"{name} [{part}] batch {batch}", "why": "out of memory"})
            if part == "largest batch" and batch > 1:
                queue.insert(0, (name, smaller, part))
            save()
            continue
        log(row.line())
        result["rows"].append(asdict(row))
        last[name] = (row, planned)
        save()
        if (part == "largest batch" and usable is not None and row.peak_bytes is not None and row.peak_bytes > usable
                and batch > 1):
            per_seq = max((row.peak_bytes - planned.weights_bytes) / batch, 1.0)
            smaller = max(1, min(batch - 1, int((usable - planned.weights_bytes) // per_seq)))
            log(f"{name} [largest batch]: measured peak {row.peak_bytes / 2**30:.2f} GiB is over "
                f"{usable / 2**30:.2f} GiB: measuring batch {smaller}")
            queue.insert(0, (name, smaller, part))
    return result


def markdown_table4_generation(result: dict[str, Any]) -> str:
    """The rows in the paper's layout (memory and throughput against FullKV at the paper's batch)."""
    s = result["setting"]
    rows = result["rows"]
    full = next((r for r in rows if r["policy"] == "full" and r["label"] == f"batch {s['batch']}"), None)
    lines = [f"**Table 4** ({result['model']}, {result['dtype']}, {result['device']}, prompt {s['prompt']} + "
             f"{s['new_tokens']} generated tokens; tokens/s integrated over the generation from cache fill levels; "
             "peak = torch.cuda.max_memory_allocated, beside memory_plan's prediction):", "",
             "| method | batch | peak GiB | predicted GiB | error | tokens/s | memory vs FullKV | tokens/s vs FullKV |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        name = ("FullKV" if r["policy"] == "full" else f"BeaconKV ({r['budget']})") + f", {r['label']}"
        peak = "—" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**30:.2f}"
        error = "—" if r["peak_error"] is None else f"{100 * r['peak_error']:+.1f}%"
        error += " (over 10%)" if r["peak_flagged"] else ""
        mem_x = tps_x = "—"
        if full is not None and r is not full:
            if r["peak_bytes"] and full["peak_bytes"]:
                mem_x = f"{full['peak_bytes'] / r['peak_bytes']:.1f}x less"
            tps_x = f"{r['tokens_per_s'] / full['tokens_per_s']:.1f}x"
        lines.append(f"| {name} | {r['batch']} | {peak} | {r['predicted_peak_bytes'] / 2**30:.2f} | {error} | "
                     f"{r['tokens_per_s']:.1f} | {mem_x} | {tps_x} |")
    for skipped in result["skipped"]:
        lines.append(f"| {skipped['part']}: skipped ({skipped.get('why') or 'deadline'}) | | | | | | | |")
    lines += ["", "Paper (Qwen3-4B, 32K tokens, A100 80 GB): FullKV batch 14, 77.0 GB, 82.3 tok/s; BeaconKV(2048) "
              "13.3 GB (5.8x less), 356.4 tok/s (4.3x); at equal memory batch 192 against 14."]
    return "\n".join(lines)
