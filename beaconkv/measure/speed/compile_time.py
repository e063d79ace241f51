"""How long a first try waits for ``torch.compile``, and what the compiled step then costs.

The ``compile`` section of ``beaconkv bench`` answers three questions a user asks before trying a
policy compiled, each in a fresh Python process (what a user's first try is) with inductor's on-disk
cache in a folder of its own:

* **cold**: an empty cache — the first compiled ``generate`` of policy A (the decode step, the
  eviction, the policy's own graphs), then policy B in the same process;
* **rerun**: a new process on the cache the cold run left — policy A again;
* **speed**: the warm compiled ms per decode step of policy A, in each execution shape of the decode
  step — ``layerwise`` (one decoder layer's graph, called from Python for every layer: the CPU default), ``regions`` (one
  graph over the whole step whose layers are one nested compile region) and ``whole``
  (one graph, every layer traced: what CUDA graphs use) — alternating them ``--compile-repeats`` times,
  so that a busy machine slows every shape alike.

Compile seconds are :attr:`~beaconkv.generation.GenerationStats.compile_s` (the calls that
compiled), so the decode itself is not counted; the wall time of the first call is reported too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from ...execution.decode import DECODE_FUNCTIONS as decode_step_functions

if TYPE_CHECKING:
    from ...execution import CompileConfig

__all__ = ["COMPILE_PROMPT", "CompileRow", "add_compile_arguments", "markdown_compile", "run_compile_section",
           "shape_compile_config"]

SHAPES = ("layerwise", "regions", "whole")
"""The named decode-step shapes; ``layerwise-N`` (N decoder layers per graph, :attr:`CompileConfig.layer_block`)
is accepted too."""
_SHAPE_CONFIG = {"layerwise": {"layerwise": True}, "regions": {"regions": True}, "whole": {"layerwise": False}}
WRAPPER_SUFFIX = "@wrapper"
"""A shape name's suffix for graph calls through ``torch.compile``'s wrapper (``direct_calls=False``)."""


def shape_config(shape: str) -> dict[str, Any]:
    """The :class:`~beaconkv.execution.CompileConfig` fields of a shape name: one of :data:`SHAPES`, or
    ``layerwise-N`` for a layerwise step of up to N decoder layers per graph; with the suffix
    ``@wrapper``, every graph call goes through the ``torch.compile`` wrapper
    (:attr:`~beaconkv.execution.CompileConfig.direct_calls` off).

    Raises:
        ValueError: An unknown name, or N not a positive integer.
    """
    base = shape.removesuffix(WRAPPER_SUFFIX)
    fields = _SHAPE_CONFIG.get(base)
    block = base.removeprefix("layerwise-")
    if fields is None and block != base and block.isdigit() and int(block) >= 1:
        fields = {"layerwise": True, "layer_block": int(block)}
    if fields is not None:
        return dict(fields) if base == shape else {**fields, "direct_calls": False}
    raise ValueError(f"--compile-shapes: unknown shape {shape!r}; choose from {', '.join(SHAPES)} or layerwise-N "
                     f"(N decoder layers per graph, e.g. layerwise-5), each optionally with {WRAPPER_SUFFIX} "
                     "(graph calls through torch.compile's wrapper).")


def shape_compile_config(shape: str, backend: str = "inductor") -> CompileConfig:
    """The :class:`~beaconkv.execution.CompileConfig` that compiles the decode step in the named shape (see
    :func:`shape_config`) with ``backend``.

    Raises:
        ValueError: An unknown shape name.
    """
    from ...execution import CompileConfig

    return CompileConfig(backend=backend, **shape_config(shape))


DECODE_FUNCTIONS = frozenset(fn.__qualname__ for fn in decode_step_functions)
"""The device functions of a decode step, in any shape (:data:`beaconkv.execution.decode.DECODE_FUNCTIONS`), by
the names an executor counts them under."""
COMPILE_PROMPT = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                  "How many clips did Natalia sell altogether in April and May? Think step by step.")
"""The prompt every measured call generates from (a GSM8K question)."""


@dataclass(frozen=True)
class CompileRow:
    """One measured process.

    Attributes:
        run: ``"cold"`` (empty compile cache), ``"rerun"`` (the cache a cold run left) or ``"speed"``.
        shape: ``"layerwise"``, ``"regions"`` or ``"whole"`` (one of ``SHAPES``).
        policy: The policy's registry name.
        compile_s: Seconds its first compiled ``generate`` spent compiling (the decode step and the policy's
            work: its eviction, BeaconKV's query sampling).
        decode_compile_s: The part of ``compile_s`` spent on the decode step's graphs.
        first_call_s: Wall seconds of that call (prefill, compile and decode).
        ms_per_step: Warm compiled decode, ms per step (a second, fully compiled call).
        second_policy: Policy B, compiled in the same process after A (cold runs only).
        second_compile_s: Seconds B's first call spent compiling.
    """

    run: str
    shape: str
    policy: str
    compile_s: float
    first_call_s: float
    ms_per_step: float
    second_policy: str | None = None
    second_compile_s: float | None = None
    decode_compile_s: float | None = None


def add_compile_arguments(group: argparse._ArgumentGroup) -> None:
    """The ``--compile-*`` options of ``beaconkv bench`` (the ``compile`` section)."""
    group.add_argument("--compile-policies", default="beacon,snapkv",
                       help="policy A (first compile) and policy B (a second policy in the same process); "
                            "default beacon,snapkv")
    group.add_argument("--compile-budget", type=int, default=64, help="the policies' budget (default 64)")
    group.add_argument("--compile-tokens", type=int, default=96, help="tokens each call generates (default 96)")
    group.add_argument("--compile-repeats", type=int, default=3,
                       help="alternating speed runs of every shape (default 3)")
    group.add_argument("--compile-shapes", default="layerwise,regions,whole",
                       help="decode-step shapes to measure, of layerwise, regions, whole and layerwise-N (N decoder "
                            "layers per graph), each optionally with @wrapper (graph calls through torch.compile's "
                            "wrapper, not dispatched directly; default layerwise,regions,whole)")


def _child(argv: list[str]) -> int:
    """One measured process: ``python -m beaconkv.measure.speed.compile_time SPEC_JSON``; prints a JSON row.

    The spec's ``prompt`` is a chat message, or a list of token ids for a model without a tokenizer."""
    spec = json.loads(argv[0])
    import torch

    import beaconkv
    from beaconkv.policies import make_policy

    from ..fidelity.study import auto_n_recent

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    path = beaconkv.embedded_model_path() if spec["model"] in (None, "embedded") else spec["model"]
    model = beaconkv.load_model(path, dtype=spec["dtype"], device=spec["device"])
    ids = isinstance(spec["prompt"], list)  # token ids (a model without a tokenizer), else a chat message
    tok = None if ids else beaconkv.load_tokenizer(path)
    config = shape_compile_config(spec["shape"], spec["backend"])
    n = auto_n_recent(spec["budget"])

    def run(name: str) -> Any:
        policy = make_policy(name, budget=spec["budget"], n_recent=n, **({"n_beacon": n} if "beacon" in name else {}))
        return beaconkv.generate(model, tok, [spec["prompt"]], chat=not ids, max_new_tokens=spec["tokens"],
                                 eos_token_ids=[], policy=policy, compile=config)

    first, warm = run(spec["policy"]), run(spec["policy"])
    s = warm.stats
    row: dict[str, Any] = {"run": spec["run"], "shape": spec["shape"], "policy": spec["policy"],
                           "compile_s": first.stats.compile_s, "first_call_s": first.stats.wall_time_s,
                           "decode_compile_s": sum(v for k, v in first.policy_state.executor.compile_seconds.items()
                                                   if k in DECODE_FUNCTIONS),
                           "ms_per_step": 1e3 * (s.wall_time_s - s.prefill_s - s.compile_s) / s.decode_steps}
    if spec.get("second"):
        second = run(spec["second"])
        row.update(second_policy=spec["second"], second_compile_s=second.stats.compile_s)
    print(json.dumps(row), flush=True)
    return 0


def _measure(spec: dict[str, Any], cache_dir: str) -> CompileRow:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir}
    done = subprocess.run([sys.executable, "-m", "beaconkv.measure.speed.compile_time", json.dumps(spec)],
                          env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"compile measurement failed (exit {done.returncode}): {done.stderr[-2000:]}")
    return CompileRow(**json.loads(done.stdout.strip().splitlines()[-1]))


def run_compile_section(args: argparse.Namespace, model: str | None, device: str, dtype: str, prompt: str,
                        log: Callable[[str], None]) -> dict[str, Any]:
    """Runs the section (see the module docstring); returns its rows and summary, JSON-ready.

    Args:
        args: Parsed ``--compile-*`` options (see :func:`add_compile_arguments`), ``--threads`` and
            ``--compile-backend``.
        model: ``--model`` (None: the embedded model).
        device: Where to run.
        dtype: The model dtype.
        prompt: The prompt every call generates from.
        log: Progress messages.
    """
    policies = [p.strip() for p in args.compile_policies.split(",") if p.strip()]
    first, second = policies[0], (policies[1] if len(policies) > 1 else None)
    shapes = [s.strip() for s in args.compile_shapes.split(",") if s.strip()]
    for shape in shapes:
        shape_config(shape)  # a bad name fails before any process starts
    base = {"model": model, "device": device, "dtype": dtype, "threads": args.threads, "prompt": prompt,
            "budget": args.compile_budget, "tokens": args.compile_tokens, "backend": args.compile_backend,
            "policy": first}
    rows: list[CompileRow] = []
    with contextlib.ExitStack() as stack:
        caches = {shape: stack.enter_context(tempfile.TemporaryDirectory(prefix="beaconkv-inductor-"))
                  for shape in shapes}
        for shape in shapes:
            log(f"  {shape}: cold compile of {first}, then {second}, in a fresh process with an empty cache")
            rows.append(_measure({**base, "shape": shape, "run": "cold", "second": second}, caches[shape]))
            log(f"  {shape}: rerun of {first} in a new process on that cache")
            rows.append(_measure({**base, "shape": shape, "run": "rerun"}, caches[shape]))
        for i in range(args.compile_repeats):  # alternating: a busy machine slows every shape alike
            for shape in shapes:
                log(f"  speed run {i + 1}/{args.compile_repeats}: {shape}")
                rows.append(_measure({**base, "shape": shape, "run": "speed"}, caches[shape]))
    return {"rows": [asdict(r) for r in rows], "summary": _summary(rows)}


def _summary(rows: list[CompileRow]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for shape in dict.fromkeys(r.shape for r in rows):
        cold = [r for r in rows if r.shape == shape and r.run == "cold"]
        rerun = [r for r in rows if r.shape == shape and r.run == "rerun"]
        speed = [r.ms_per_step for r in rows if r.shape == shape and r.run in ("speed", "cold", "rerun")]
        if cold:
            out[shape] = {"first_compile_s": cold[0].compile_s, "first_call_s": cold[0].first_call_s,
                          "decode_compile_s": cold[0].decode_compile_s,
                          "second_policy_compile_s": cold[0].second_compile_s,
                          "rerun_compile_s": rerun[0].compile_s if rerun else None,
                          "ms_per_step_median": statistics.median(speed), "ms_per_step_min": min(speed),
                          "ms_per_step_max": max(speed), "speed_runs": len(speed)}
    return out


def markdown_compile(result: dict[str, Any]) -> str:
    """The section as a markdown table (one row per execution shape)."""
    lines = ["**Compile time** (fresh processes; cold = empty inductor cache; rerun = a new process on the cache "
             "the cold run left; ms/step: warm compiled decode, median [min–max] over every run of that shape)", "",
             "| shape | first compile s (decode step) | first call s | second policy s | rerun s | ms/step |",
             "|---|---:|---:|---:|---:|---|"]
    for shape, s in result["summary"].items():
        second = "—" if s["second_policy_compile_s"] is None else f"{s['second_policy_compile_s']:.1f}"
        rerun = "—" if s["rerun_compile_s"] is None else f"{s['rerun_compile_s']:.1f}"
        decode = "" if s.get("decode_compile_s") is None else f" ({s['decode_compile_s']:.1f})"
        lines.append(f"| {shape} | {s['first_compile_s']:.1f}{decode} | {s['first_call_s']:.1f} | {second} | {rerun} | "
                     f"{s['ms_per_step_median']:.1f} [{s['ms_per_step_min']:.1f}–{s['ms_per_step_max']:.1f}] "
                     f"({s['speed_runs']} runs) |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
