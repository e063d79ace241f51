"""Section 3 of ``beaconkv bench``: ms/step as the context grows, FullKV vs BeaconKV(budget)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...execution import CompileConfig
from ...generation import generate
from ...models.decoder import CausalLM
from ...policies.registry import make_policy
from .machine import BenchError, random_prompts
from .timing import StepRecorder, decode_ms_per_step, generate_ids


@dataclass
class CurvePoint:
    """ms/step at one context length for FullKV and BeaconKV.

    Attributes:
        context: Tokens in the sequence (prompt + generated) at the end of the measured window.
        full_ms: FullKV ms/step with a cache sized to ``context``.
        beacon_ms: BeaconKV ms/step over the window ending at ``context`` (evictions included).
        full_capacity: FullKV cache slots.
        beacon_capacity: BeaconKV cache slots.
    """

    context: int
    full_ms: float
    beacon_ms: float
    full_capacity: int
    beacon_capacity: int


def measure_cost_curve(
    model: CausalLM, contexts: Sequence[int], budget: int, window: int, prompt_tokens: int,
    compile_config: CompileConfig | None, repeats: int, log: Callable[[str], None] = print,
    settings: dict[str, Any] | None = None,
) -> list[CurvePoint]:
    """Section 3: ms/step as the context grows, FullKV vs BeaconKV(``budget``), batch 1.

    FullKV at context N: a prompt of ``N - window`` tokens, then ``window`` decode steps, so its cache
    holds ``N`` slots — what decoding to N tokens needs (its graphs are compiled first by a run with
    the same capacity and a one-token prompt). BeaconKV: one generation from a ``prompt_tokens``
    prompt to the largest context, its steps timed singly (the best of ``repeats`` runs per step);
    the point at N averages the ``window`` steps that end at N. ``window`` should be a multiple of
    ``budget - B_min`` so that evictions count in proportion; the compilations happen in the first
    steps and at the first eviction, before the first window when ``contexts[0] - window`` exceeds
    ``prompt_tokens + budget``. ``settings`` are BeaconKV's arguments beyond the budget (``n_recent``,
    ``--policy-arg``; None: its defaults). Each run and each point is announced through ``log``
    before it starts.
    """
    device = model.device
    vocab = model.config.vocab_size
    top = max(contexts)
    if min(contexts) < prompt_tokens + window:
        raise BenchError(f"contexts {list(contexts)} must be at least prompt_tokens + window = {prompt_tokens + window}.")
    best: list[float] | None = None
    capacity_b = 0
    for r in range(repeats):
        log(f"  BeaconKV({budget}) to {top} tokens, run {r + 1}/{repeats}: {top - prompt_tokens + 1} steps"
            + (" (the first ones compile)" if compile_config is not None and r == 0 else "") + "…")
        rec = StepRecorder(device)
        out = generate_ids(model, random_prompts(1, prompt_tokens, vocab), top - prompt_tokens + 1,
                           make_policy("beacon", budget=budget, **(settings or {})), compile_config, on_step=rec)
        capacity_b = out.stats.cache_capacity
        steps = rec.step_seconds()  # steps[i] wrote position prompt_tokens + i + 1: context prompt_tokens + i + 2
        best = steps if best is None else [min(a, b) for a, b in zip(best, steps)]
        log(f"  BeaconKV({budget}) to {top} tokens, run {r + 1}: {1e3 * sum(steps) / len(steps):.1f} ms/step mean")
    assert best is not None
    points = []
    for n in contexts:
        sel = [s for i, s in enumerate(best) if n - window < prompt_tokens + i + 2 <= n]
        beacon_ms = 1e3 * sum(sel) / len(sel)
        log(f"  context {n}: FullKV, {repeats} run(s) of {window} steps" + (" after compiling for this cache size"
                                                                          if compile_config is not None else "") + "…")
        if compile_config is not None:  # compile for capacity n: a 1-token prompt, a cache sized for n
            generate(model, None, [[3]], max_new_tokens=2, capacity_tokens=n - 1, eos_token_ids=[],
                     compile=compile_config)
        prompts = random_prompts(1, n - window, vocab)
        full_ms = min(decode_ms_per_step(generate_ids(model, prompts, window, None, compile_config))
                      for _ in range(repeats))
        points.append(CurvePoint(n, full_ms, beacon_ms, n, capacity_b))  # FullKV capacity: prompt + new = n
        log(f"  context {n}: FullKV {full_ms:.1f} ms/step (capacity {n}), BeaconKV({budget}) {beacon_ms:.1f} ms/step "
            f"(capacity {capacity_b})")
    return points


def plot_cost_curve(points: Sequence[CurvePoint], budget: int, title: str, path: Path) -> Path:
    """Draws ms/step against context length for FullKV and BeaconKV into ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [p.context for p in points]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(x, [p.full_ms for p in points], marker="o", label="FullKV (cache = context)")
    ax.plot(x, [p.beacon_ms for p in points], marker="o", lw=2.5, label=f"BeaconKV(budget={budget})")
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [str(v) for v in x])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("context (prompt + generated tokens)")
    ax.set_ylabel("ms / decode step")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
