"""The paper's Table 4: peak memory, tokens/s and step latency of FullKV vs BeaconKV, each at the
largest batch that fits a memory limit.

The paper's setting is Qwen3-4B generating 32K tokens on an 80 GB A100 (FullKV: batch 14, 77.0 GB,
82.3 tok/s; BeaconKV at budget 2048: 13.3 GB, 356.4 tok/s). Here:

* **GPU**: a Qwen3-4B-*shaped* model with random weights (:func:`~beaconkv.models.random_weights.qwen3_4b_config`; nothing to
  download — speed and memory do not depend on the weights), bf16, caches sized for
  ``--generation-tokens`` (32768);
* **CPU scale**: the embedded SmolLM2-135M, a shorter generation and a smaller limit.

Procedure per policy: the cache a whole generation needs is allocated up front (FullKV:
``prompt + generation_tokens`` slots; BeaconKV: ``prompt + budget``), so its memory is the real
peak. The batch is the largest whose predicted peak fits the limit: cache bytes are exact,
everything else (weights, activations, workspace) is fitted from two short eager runs; on CUDA a
run that still runs out of memory retries with a smaller batch. Each policy then decodes from a
short prompt; step times are measured over whole eviction cycles of the steady state (BeaconKV:
after the budget filled and one eviction compiled; FullKV: as many steps), so compilation never
lands in a timed step. Memory: CUDA peak allocated over the run (weights included); on CPU the
peak resident memory of the run minus the resident memory before the model was loaded, each
policy in a fresh process and eagerly by default (the compiler's own memory would otherwise count).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ...arguments import model_path
from ...execution import CompileConfig
from ...generation import GenerationOutput, generate
from ...models.decoder import CausalLM
from ...models.loading import load_model
from ...models.random_weights import RANDOM_SHAPES, random_model
from ...policies.registry import make_policy
from .machine import DTYPES, PeakMemory, kv_bytes_per_token, random_prompts, rss_bytes
from .timing import StepRecorder

#: The paper's Table 4 (Qwen3-4B, 32K generation, A100 80 GB) for reference.
PAPER_TABLE4 = {"full": {"batch": 14, "peak_gb": 77.0, "tokens_per_s": 82.3},
                "beacon": {"budget": 2048, "peak_gb": 13.3, "tokens_per_s": 356.4}}


@dataclass
class Table4Row:
    """One policy of the table.

    Attributes:
        policy: ``full`` or ``beacon``.
        budget: BeaconKV's budget (None for FullKV).
        batch: The largest batch that fits (or the batch asked for).
        cache_capacity: Slots per (sequence, KV head).
        kv_cache_bytes: Keys and values allocated.
        peak_bytes: Peak memory (see the module docstring).
        predicted_bytes: The fitted prediction the batch was chosen with (0 for a fixed batch).
        ms_per_step: Steady-state decode latency per step (one token for every sequence).
        tokens_per_s: ``batch * 1000 / ms_per_step``.
        evictions: Evictions per sequence during the run.
        label: ``"largest batch"``, ``"FullKV's batch"`` or ``"fixed batch"``.
        base_bytes: The fitted memory that does not grow with the batch (0 for a fixed batch).
    """

    policy: str
    budget: int | None
    batch: int
    cache_capacity: int
    kv_cache_bytes: int
    peak_bytes: int
    predicted_bytes: int
    ms_per_step: float
    tokens_per_s: float
    evictions: int
    label: str = ""
    base_bytes: int = 0


def smaller_batch(row: Table4Row | dict[str, Any], memory_limit: float) -> int:
    """The batch to measure again when a fitted row's peak went over ``memory_limit``: its measured
    per-sequence memory above the fitted base, scaled to the limit (always smaller than the row's)."""
    r = row if isinstance(row, dict) else asdict(row)
    per_seq = max((r["peak_bytes"] - r["base_bytes"]) / r["batch"], 1.0)
    return max(1, min(r["batch"] - 1, int((memory_limit - r["base_bytes"]) // per_seq)))


def _oom_types() -> tuple[type[BaseException], ...]:
    return (torch.cuda.OutOfMemoryError,) if torch.cuda.is_available() else ()


def _timed_run(model: CausalLM, policy_name: str, budget: int, batch: int, prompt_tokens: int,
               generation_tokens: int, cycles: int, compile_config: CompileConfig | None,
               rss_zero: int) -> tuple[GenerationOutput, float, int]:
    """Decodes one policy with the cache of a ``generation_tokens`` generation; returns the output, the
    steady-state ms/step and the peak memory of the run (see the module docstring)."""
    device = model.device
    policy = make_policy(policy_name, budget=None if policy_name == "full" else budget)
    gap = budget - math.floor(policy.ratio * budget)
    # BeaconKV: fill the budget, one eviction cycle (compiles the eviction), then `cycles` timed
    # cycles; FullKV: a few warm-up steps (compile), then as many timed steps
    warm = budget - 1 + gap if policy_name != "full" else 8
    timed = cycles * gap
    rec = StepRecorder(device)
    with PeakMemory(device) as mem:
        out = generate(model, None, random_prompts(batch, prompt_tokens, model.config.vocab_size),
                       max_new_tokens=warm + timed + 1, capacity_tokens=max(generation_tokens, warm + timed + 1),
                       eos_token_ids=[], policy=policy, compile=compile_config or False, on_step=rec)
    durations, _, _ = rec.window(warm, warm + timed - 1)
    peak = mem.peak if device.type == "cuda" else mem.peak - rss_zero
    return out, 1e3 * sum(durations) / len(durations), peak


def _fit(model: CausalLM, policy_name: str, budget: int, prompt_tokens: int, probe: tuple[int, int],
         rss_zero: int) -> tuple[float, float]:
    """Fits ``peak - cache bytes = base + per_seq * batch`` from two short eager runs."""
    device = model.device
    pts = []
    for b in probe:
        policy = make_policy(policy_name, budget=None if policy_name == "full" else budget)
        with PeakMemory(device) as mem:
            out = generate(model, None, random_prompts(b, prompt_tokens, model.config.vocab_size),
                           max_new_tokens=4, eos_token_ids=[], policy=policy)
        peak = mem.peak if device.type == "cuda" else mem.peak - rss_zero
        pts.append((b, peak - out.stats.cache_bytes))
    (b1, m1), (b2, m2) = pts
    per_seq = max((m2 - m1) / (b2 - b1), 0.0)
    return m1 - per_seq * b1, per_seq


def measure_table4(
    model: CausalLM, budget: int, generation_tokens: int, memory_limit: float, prompt_tokens: int = 64,
    cycles: int = 2, batch: int | None = None, max_batch: int = 64, compile_config: CompileConfig | None = None,
    rss_zero: int = 0, policies: tuple[str, ...] = ("full", "beacon"), log: Callable[[str], None] = print,
) -> list[Table4Row]:
    """Measures FullKV and BeaconKV(``budget``) at the largest batch each fits in ``memory_limit`` bytes.

    Args:
        model: The model.
        budget: BeaconKV's budget.
        generation_tokens: Generation length the caches are sized for (FullKV: ``prompt + this``).
        memory_limit: Bytes available (CUDA: allocated; CPU: resident above ``rss_zero``).
        prompt_tokens: Prompt length.
        cycles: Timed eviction cycles (``budget - B_min`` steps each).
        batch: A fixed batch instead of the search.
        max_batch: Upper bound of the search.
        compile_config: Compile the steps (None: eager).
        rss_zero: CPU resident bytes before the model was loaded.
        policies: ``full``, ``beacon`` (its largest batch) and/or ``beacon@full`` (BeaconKV at FullKV's
            batch, measured before it: the memory it saves at equal work).
        log: Progress messages.

    Returns:
        One row per policy.
    """
    device = model.device
    dtype = model.dtype
    per_token = kv_bytes_per_token(model.config, dtype)
    rows = []
    full_batch = None
    for spec in policies:
        name, at_full = spec.split("@")[0], spec.endswith("@full")
        if at_full and batch is not None:
            continue  # at a fixed batch it is the plain BeaconKV row
        capacity = prompt_tokens + (generation_tokens if name == "full" else budget)
        predicted = 0
        b = full_batch if at_full and batch is None else batch
        if at_full and b is None:
            raise ValueError("policy 'beacon@full' needs FullKV measured first (or a fixed batch).")
        label = "fixed batch" if batch is not None else ("FullKV's batch" if at_full else "largest batch")
        if b is None:
            base, per_seq = _fit(model, name, budget, prompt_tokens, (1, 2) if device.type == "cuda" else (1, 4),
                                 rss_zero)
            seq_bytes = per_seq + capacity * per_token
            b = int(max(1, min(max_batch, (memory_limit - base) // seq_bytes)))
            predicted = int(base + b * seq_bytes)
            log(f"  {name}: base {base / 2**30:.2f} GiB + {seq_bytes / 2**20:.1f} MiB/sequence -> batch {b} "
                f"(predicted {predicted / 2**30:.2f} GiB of {memory_limit / 2**30:.2f})")
        while True:
            try:
                t0 = time.perf_counter()
                out, ms, peak = _timed_run(model, name, budget, b, prompt_tokens, generation_tokens, cycles,
                                           compile_config, rss_zero)
            except _oom_types():
                if batch is not None or b == 1:
                    raise
                b = max(1, int(b * 0.9))
                log(f"  {name}: out of memory, retrying with batch {b}")
                torch.cuda.empty_cache()
                continue
            if predicted and peak > memory_limit and b > 1 and device.type == "cuda":
                # the fit underestimated: scale the batch to the measured per-sequence memory, measure again
                # (on a CPU the resident peak of a process never drops: a fresh process retries instead)
                b = smaller_batch({"peak_bytes": peak, "base_bytes": base, "batch": b}, memory_limit)
                predicted = int(base + b * seq_bytes)
                log(f"  {name}: peak {peak / 2**30:.2f} GiB is over the limit, retrying with batch {b}")
                torch.cuda.empty_cache()
                continue
            break
        s = out.stats
        if name == "full":
            full_batch = b
        rows.append(Table4Row(name, None if name == "full" else budget, b, s.cache_capacity, s.cache_bytes, peak,
                              predicted, ms, b * 1e3 / ms, s.evictions[0], label, base if predicted else 0))
        log(f"  {name}: batch {b}, capacity {s.cache_capacity}, KV {s.cache_bytes / 2**30:.2f} GiB, peak "
            f"{peak / 2**30:.2f} GiB, {ms:.1f} ms/step, {b * 1e3 / ms:.1f} tok/s ({time.perf_counter() - t0:.0f} s)")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def markdown_table4(result: dict[str, Any]) -> str:
    """The table in the paper's layout, from :func:`run_table4_section`'s result."""
    rows = result["rows"]
    full = next((r for r in rows if r["policy"] == "full"), None)
    lines = [(f"**Table 4** ({result['model']}, {result['dtype']}, caches sized for a "
              f"{result['generation_tokens']}-token generation, memory limit {result['memory_limit_gib']:.1f} GiB, "
              f"{result['mode']}; memory = {result['memory']}):"), "",
             ("| method | batch | KV cache GiB | peak memory GiB | tokens/s | ms/step | memory vs FullKV "
              "| tokens/s vs FullKV |"),
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        name = "FullKV" if r["policy"] == "full" else f"BeaconKV ({r['budget']})"
        name += f", {r['label']}" if r.get("label") else ""
        mem_x = "—"
        if full and r is not full:
            ratio = full["peak_bytes"] / r["peak_bytes"]
            mem_x = f"{ratio:.1f}x less" if ratio >= 1 else f"{1 / ratio:.1f}x more"
        tps_x = f"{r['tokens_per_s'] / full['tokens_per_s']:.1f}x" if full and r is not full else "—"
        lines.append(f"| {name} | {r['batch']} | {r['kv_cache_bytes'] / 2**30:.2f} | {r['peak_bytes'] / 2**30:.2f} | "
                     f"{r['tokens_per_s']:.1f} | {r['ms_per_step']:.1f} | {mem_x} | {tps_x} |")
    lines += ["", ("Paper (Qwen3-4B, 32K tokens, A100 80 GB): FullKV batch 14, 77.0 GB, 82.3 tok/s; "
                   "BeaconKV(2048) 13.3 GB (5.8x less), 356.4 tok/s (4.3x).")]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- CLI
def add_table4_arguments(parser: argparse.ArgumentParser | Any, prefix: str = "") -> None:
    """Adds the Table-4 options (``--<prefix>model`` ...) to a parser or argument group.

    Args:
        parser: A parser or argument group.
        prefix: Prepended to every option name (``"table4-"`` inside ``beaconkv bench``).
    """
    p = prefix
    parser.add_argument(f"--{p}model", default="embedded",
                        help="'embedded' (SmolLM2-135M), 'qwen3-4b' (random weights, Qwen3-4B shape), 'qwen3-tiny' (a "
                             "tiny random Qwen3 shape: checks the commands on a CPU) or a checkpoint")
    parser.add_argument(f"--{p}dtype", default=None,
                        help="fp32, bf16 or fp16 (default: bf16 on CUDA, fp32 on CPU, where bf16 matmuls are slow)")
    parser.add_argument(f"--{p}generation-tokens", type=int, default=None,
                        help="generation the caches are sized for (default: 32768 on CUDA, 2048 on CPU)")
    parser.add_argument(f"--{p}budget", type=int, default=None, help="BeaconKV budget (default: 2048 CUDA, 256 CPU)")
    parser.add_argument(f"--{p}memory-limit-gb", type=float, default=None,
                        help="memory limit in GiB (default: 80 on CUDA, 1.0 on CPU)")
    parser.add_argument(f"--{p}batch", type=int, default=None, help="a fixed batch instead of the largest that fits")
    parser.add_argument(f"--{p}max-batch", type=int, default=64, help="upper bound of the batch search (default 64)")
    parser.add_argument(f"--{p}cycles", type=int, default=2, help="timed eviction cycles (default 2)")
    parser.add_argument(f"--{p}mode", choices=("auto", "eager", "compiled"), default="auto",
                        help="auto (default): compiled on CUDA; eager on CPU, where the in-process compiler's "
                             "memory would count in the peak RSS")
    parser.add_argument(f"--{p}policies", default="full,beacon@full,beacon",
                        help="comma-separated: full, beacon@full (BeaconKV at FullKV's batch), beacon (its largest "
                             "batch); default all three")
    parser.add_argument(f"--{p}in-process", action="store_true",
                        help="on CPU, measure in this process instead of a fresh one per policy")


def run_table4_section(args: argparse.Namespace, device: torch.device, compile_config: CompileConfig,
                       log: Callable[[str], None] = print, prefix: str = "") -> dict[str, Any]:
    """Runs the table from parsed arguments (see :func:`add_table4_arguments`; ``prefix`` with ``_``).

    On CPU each policy is measured in a fresh Python process (``python -m beaconkv.measure.speed.table4``),
    so that its peak resident memory is its own, unless ``--in-process``.

    Returns:
        A JSON-able dict: settings and ``rows``.
    """
    def opt(name: str) -> Any:
        return getattr(args, prefix + name)

    cuda = device.type == "cuda"
    names = tuple(n.strip() for n in opt("policies").split(",") if n.strip())
    if not cuda and not opt("in_process"):
        return _run_in_subprocesses(opt, names, log)
    rss_zero = 0 if cuda else rss_bytes()
    dname = opt("dtype") or ("bf16" if cuda else "fp32")
    dtype = DTYPES[dname]
    which = opt("model")
    if which in RANDOM_SHAPES:
        model, label = random_model(RANDOM_SHAPES[which](), dtype, device), f"{which}-shaped, random weights"
    else:
        model = load_model(model_path(which), dtype=dtype, device=device)
        label = "SmolLM2-135M (embedded)" if which == "embedded" else Path(which).name
    gen = opt("generation_tokens") or (32768 if cuda else 2048)
    budget = opt("budget") or (2048 if cuda else 256)
    limit = (opt("memory_limit_gb") or (80.0 if cuda else 1.0)) * 2**30
    mode = opt("mode") if opt("mode") != "auto" else ("compiled" if cuda else "eager")
    cc = compile_config if mode == "compiled" else None
    rows = measure_table4(model, budget, gen, limit, cycles=opt("cycles"), batch=opt("batch"),
                          max_batch=opt("max_batch"), compile_config=cc, rss_zero=rss_zero, policies=names, log=log)
    return {"model": label, "dtype": dname, "generation_tokens": gen, "budget": budget,
            "memory_limit_gib": limit / 2**30, "mode": mode,
            "memory": "peak allocated" if cuda else "peak RSS above the RSS before the model was loaded",
            "rows": [asdict(r) for r in rows]}


def _run_in_subprocesses(opt: Callable[[str], Any], names: tuple[str, ...],
                         log: Callable[[str], None]) -> dict[str, Any]:
    """Measures each policy in ``python -m beaconkv.measure.speed.table4 --in-process`` and merges the results."""
    flags = {"model": opt("model"), "dtype": opt("dtype"), "generation-tokens": opt("generation_tokens"),
             "budget": opt("budget"), "memory-limit-gb": opt("memory_limit_gb"), "batch": opt("batch"),
             "max-batch": opt("max_batch"), "cycles": opt("cycles"), "mode": opt("mode")}
    result: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    def measure(name: str, batch: int | None) -> dict[str, Any]:
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, "-m", "beaconkv.measure.speed.table4", "--device", "cpu", "--in-process",
                   "--policies", name, "--threads", str(torch.get_num_threads()), "--out", tmp]
            cmd += [x for k, v in {**flags, "batch": batch}.items() if v is not None for x in (f"--{k}", str(v))]
            log(f"  {name}: measuring in a fresh process" + (f" at batch {batch}" if batch else ""))
            done = subprocess.run(cmd, stdout=subprocess.DEVNULL, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"table 4 for {name} failed (exit {done.returncode}): {' '.join(cmd)}")
            return json.loads((Path(tmp) / "table4.json").read_text())

    limit = (opt("memory_limit_gb") or 1.0) * 2**30
    result: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    for name in names:
        if name.endswith("@full") and flags["batch"] is not None:
            continue  # at a fixed batch it is the plain BeaconKV row
        batch = flags["batch"]
        if name.endswith("@full") and batch is None:
            batch = next(r["batch"] for r in rows if r["policy"] == "full")
        result = measure(name.split("@")[0], batch)
        row = result["rows"][0]
        for _ in range(3):  # a fitted batch whose peak went over the limit: a smaller one, in a fresh process
            if not row["predicted_bytes"] or row["peak_bytes"] <= limit or row["batch"] == 1:
                break
            smaller = smaller_batch(row, limit)
            log(f"  {name}: peak {row['peak_bytes'] / 2**30:.2f} GiB at batch {row['batch']} is over the limit")
            per_seq = (row["peak_bytes"] - row["base_bytes"]) / row["batch"]
            result = measure(name, smaller)
            row = {**result["rows"][0], "base_bytes": row["base_bytes"],
                   "predicted_bytes": int(row["base_bytes"] + smaller * per_seq)}
        row["label"] = ("FullKV's batch" if name.endswith("@full") else
                        "fixed batch" if flags["batch"] is not None else "largest batch")
        rows.append(row)
    result["rows"] = rows
    return result


def main(argv: list[str] | None = None) -> int:
    """``python -m beaconkv.measure.speed.table4``: the table alone, printed as markdown (and JSON with ``--out``)."""
    parser = argparse.ArgumentParser(prog="python -m beaconkv.measure.speed.table4", description=__doc__.splitlines()[0])
    add_table4_arguments(parser)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--out", type=Path, default=None, help="write table4.json and table4.md here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    result = run_table4_section(args, device, CompileConfig(), lambda m: print(m, file=sys.stderr, flush=True))
    text = markdown_table4(result)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "table4.json").write_text(json.dumps(result, indent=1))
        (args.out / "table4.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
