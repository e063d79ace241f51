"""``beaconkv bench``: the command line of the speed benchmark (sections, quick mode, outputs).

Every log line carries the seconds elapsed since the start, and every long step (a compile, a
policy's run, a context of the cost curve) is announced before it starts, so a long run never
goes silent. ``--quick`` is a smoke run of every default section at tiny sizes (see
:data:`QUICK_COST`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import platform
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ...arguments import (
    WORKLOAD_BUDGETS,
    add_budget_argument,
    add_device_argument,
    add_model_argument,
    add_n_recent_argument,
    add_policy_arg_argument,
    add_threads_argument,
    int_list,
    model_path,
    policy_args_by_policy,
    str_list,
)
from ...execution import CompileConfig
from ...execution.compile_log import compile_logger
from ...models.config import ModelConfig
from ...models.loading import load_model, resolve_checkpoint, resolve_device
from ...policies.registry import make_policy
from .compile_time import COMPILE_PROMPT, add_compile_arguments, markdown_compile, run_compile_section
from .curve import measure_cost_curve, plot_cost_curve
from .engine_bench import EngineRow, add_engine_arguments, check_engine_arguments, markdown_engine, run_engine_section
from .hf_bench import HFBenchRow, add_hf_arguments, markdown_hf, measure_hf
from .machine import DTYPES, BenchError, cpu_name, streaming_bandwidth
from .policies import DEFAULT_POLICIES, measure_policies
from .report import markdown_report
from .table4 import add_table4_arguments, run_table4_section
from .targets import evaluate_targets
from .tensor_parallel import add_tp_arguments, markdown_tp, run_tp_section
from .throughput import measure_throughput

SECTIONS = ("throughput", "curve", "policies", "table4", "engine", "compile", "hf", "tp")

#: What ``--quick`` costs, measured with ``time beaconkv bench --quick`` on this project's 2-core CPU
#: (2 threads, the embedded model already converted): with inductor's on-disk cache filled by an
#: earlier run, and with it empty (the one compile is then done from scratch).
QUICK_COST = "about 40 s (75 s on a first run, while inductor compiles from scratch)"


def add_bench_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the ``beaconkv bench`` options to ``parser``.

    Args:
        parser: A parser (or subparser).

    Returns:
        The same parser.
    """
    parser.description = "Decode speed, bandwidth roofline, cost curve and memory of beaconkv vs transformers."
    g = parser.add_argument_group("model and machine")
    add_model_argument(g)
    add_device_argument(g)
    add_threads_argument(g)
    g.add_argument("--sections", type=str_list, default=["throughput", "curve", "policies"],
                   help=f"comma-separated subset of {','.join(SECTIONS)} (default: all but table4, engine, compile "
                        "and hf)")
    g.add_argument("--repeats", type=int, default=2, help="timed runs per figure; the best counts (default 2)")
    g.add_argument("--quick", action="store_true",
                   help=f"a smoke run of every default section at tiny sizes, {QUICK_COST}: fp32, batch 1, 8 "
                        "tokens, one compile (beaconkv's decode step; transformers' static compile skipped), curve "
                        "and policies eager at budget 32 (n_recent 4), two policies, no table4; its figures only "
                        "show that everything runs")
    t = parser.add_argument_group("throughput")
    t.add_argument("--dtypes", type=str_list, default=["fp32", "bf16"], help="comma-separated (default fp32,bf16)")
    t.add_argument("--batches", type=int_list, default=[1, 8], help="comma-separated (default 1,8)")
    t.add_argument("--prompt-tokens", type=int, default=64, help="prompt length (default 64)")
    t.add_argument("--new-tokens", type=int, default=64, help="decode steps timed (default 64)")
    t.add_argument("--no-transformers", action="store_true", help="skip transformers' generate")
    t.add_argument("--no-transformers-compile", action="store_true", help="skip transformers' static-cache compile")
    c = parser.add_argument_group("compilation")
    c.add_argument("--compile-backend", default="inductor", help="torch.compile backend (default inductor)")
    c.add_argument("--freezing", action="store_true", help="inductor freezing (CPU: measures whether it helps)")
    c.add_argument("--eager-sections", action="store_true",
                   help="run the curve and policy sections eagerly instead of compiled")
    k = parser.add_argument_group("cost curve and policies")
    add_budget_argument(k)
    add_n_recent_argument(k)
    add_policy_arg_argument(k)
    k.add_argument("--contexts", type=int_list, default=[512, 1024, 2048, 4096],
                   help="context lengths of the cost curve (default 512,1024,2048,4096)")
    k.add_argument("--curve-window", type=int, default=64, help="steps averaged per curve point (default 64)")
    k.add_argument("--policies", type=str_list, default=list(DEFAULT_POLICIES),
                   help=f"comma-separated (default {','.join(DEFAULT_POLICIES)}; FullKV always runs)")
    k.add_argument("--policy-batch", type=int, default=1, help="batch of the policy section (default 1)")
    k.add_argument("--policy-cycles", type=int, default=8,
                   help="eviction cycles timed per policy, after the first eviction (default 8)")
    k.add_argument("--policy-dtype", default=None,
                   help="dtype of the curve and policy sections (default: bf16 on CUDA, fp32 on CPU, where bf16 "
                        "prefill of 4K-token prompts takes minutes)")
    add_table4_arguments(parser.add_argument_group("table 4 (--sections ...,table4)"), prefix="table4-")
    add_engine_arguments(parser.add_argument_group(
        "engine: continuous batching vs static batches, BeaconKV vs FullKV at equal KV memory (--sections ...,engine)"))
    add_compile_arguments(parser.add_argument_group(
        "compile: cold compile, a second policy, a rerun in a new process, and compiled ms/step layer by layer "
        "vs whole-step (--sections ...,compile)"))
    add_hf_arguments(parser.add_argument_group(
        "hf: BeaconKV inside transformers (PolicyCache) vs transformers' DynamicCache vs beaconkv's decoder "
        "(--sections ...,hf)"))
    add_tp_arguments(parser.add_argument_group(
        "tp: tensor parallelism, N ranks x 1 thread vs 1 rank x N threads on the CPU (--sections ...,tp)"))
    parser.add_argument("--out", type=Path, default=Path("results/bench"), help="output directory (default results/bench)")
    return parser


def _apply_quick(args: argparse.Namespace) -> None:
    """``--quick``: every default section at tiny sizes, with one compile (see :data:`QUICK_COST`)."""
    args.dtypes, args.batches = args.dtypes[:1] if args.dtypes != ["fp32", "bf16"] else ["fp32"], args.batches[:1]
    args.new_tokens, args.prompt_tokens, args.repeats = 8, 16, 1
    # budget 32 evicts every 4 steps (n_recent 4 fits), so a few dozen eager steps show the evictions
    args.budget, args.n_recent, args.curve_window = 32, 4, 16
    args.contexts = [64, 96]
    args.policies = [p for p in args.policies if p in ("beacon", "snapkv")] or ["beacon"]
    args.policy_cycles, args.policy_dtype = 2, "fp32"
    args.no_transformers_compile, args.eager_sections = True, True
    args.sections = [s for s in args.sections if s not in ("table4", "engine")]


def run_bench(args: argparse.Namespace) -> int:
    """Runs ``beaconkv bench`` from parsed arguments; writes ``bench.json``, ``bench.md``, ``cost_curve.png``.

    Returns:
        0 on success.

    Raises:
        BenchError: Unknown sections or dtypes, ``--repeats < 1`` (checked before anything loads).
        beaconkv.policies.PolicyConfigError: An unknown policy, or a budget too small for ``n_recent``
            (checked before anything loads).
        FileNotFoundError: ``--model`` names no checkpoint (checked before anything runs).
    """
    t0 = time.perf_counter()
    with _compiles_in_the_log(lambda msg: _log(t0, msg)):
        return _run_bench(args, t0)


def _log(t0: float, msg: str) -> None:
    print(f"[{time.perf_counter() - t0:5.0f}s] {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _compiles_in_the_log(log: Callable[[str], None]) -> Iterator[None]:
    """While the bench runs, the compile lines (:data:`~beaconkv.execution.compile_log.compile_logger`) are
    log lines of the bench, with its elapsed seconds, instead of the command's plain ``beaconkv: ...`` lines."""

    class _Log(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            log(record.getMessage())

    saved = compile_logger.handlers[:], compile_logger.level, compile_logger.propagate
    compile_logger.handlers[:] = [_Log()]
    compile_logger.setLevel(logging.INFO)
    compile_logger.propagate = False
    try:
        yield
    finally:
        compile_logger.handlers[:], level, compile_logger.propagate = saved
        compile_logger.setLevel(level)


def _run_bench(args: argparse.Namespace, t0: float) -> int:
    args.budget = WORKLOAD_BUDGETS["bench"] if args.budget is None else args.budget
    if args.quick:
        _apply_quick(args)
    device = resolve_device(args.device)
    args.policy_dtype = args.policy_dtype or ("bf16" if device.type == "cuda" else "fp32")
    bad_sections = [s for s in args.sections if s not in SECTIONS]
    bad_dtypes = [d for d in [*args.dtypes, args.policy_dtype] if d not in DTYPES]
    if bad_sections:
        raise BenchError(f"--sections {','.join(bad_sections)} unknown; choose from {','.join(SECTIONS)}.")
    if bad_dtypes:
        raise BenchError(f"dtype {','.join(bad_dtypes)} unknown; choose from {','.join(DTYPES)}.")
    if args.repeats < 1:
        raise BenchError(f"--repeats={args.repeats} must be >= 1.")
    if "engine" in args.sections:
        check_engine_arguments(args)
    policy_kwargs: dict[str, dict[str, Any]] = {}
    if "curve" in args.sections or "policies" in args.sections:  # bad policy settings fail before anything runs
        names = {"beacon", *(args.policies if "policies" in args.sections else [])} - {"full"}
        policy_kwargs = _policy_kwargs(args, sorted(names))
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    path = resolve_checkpoint(model_path(args.model))  # a missing model fails here, before anything runs
    compile_config = CompileConfig(backend=args.compile_backend, freezing=args.freezing or None)
    section_compile = None if args.eager_sections else compile_config

    def log(msg: str) -> None:
        _log(t0, msg)

    log("measuring the streaming bandwidth…")
    stream = streaming_bandwidth(device, nbytes=(1 << 28) if args.quick else (1 << 30))
    config = ModelConfig.from_file(path)
    name = "SmolLM2-135M-Instruct (embedded)" if args.model in (None, "embedded") else (
        path.name if Path(args.model).expanduser().is_dir() else args.model)  # a hub id: not its cache folder
    params = sum(p.numel() for p in {id(p): p for p in load_model(path).parameters()}.values())
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "command": _command_line(args),
        "machine": {
            "device": device.type, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
            "stream_gbps": stream, "python": platform.python_version(),
        },
        "model": {"name": name, "path": str(path), "parameters": params, "config": asdict(config)},
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if not callable(v)
                     and not k.startswith("_")},
    }
    log(f"bench: {results['machine']['device_name']}, {results['machine']['threads']} thread(s), "
        f"streaming read {stream:.1f} GB/s; model {name}")
    if "throughput" in args.sections:
        log("throughput:")
        rows = measure_throughput(path, args.dtypes, args.batches, args.prompt_tokens, args.new_tokens, device,
                                  stream, compile_config, args.repeats, not args.no_transformers,
                                  not args.no_transformers_compile, log)
        results["throughput"] = [asdict(r) for r in rows]
    if "curve" in args.sections or "policies" in args.sections:
        model = load_model(path, dtype=DTYPES[args.policy_dtype], device=device)
        if "curve" in args.sections:
            log("cost curve:")
            points = measure_cost_curve(model, args.contexts, args.budget, args.curve_window, args.prompt_tokens,
                                        section_compile, args.repeats, log, settings=policy_kwargs["beacon"])
            results["curve"] = [asdict(p) for p in points]
            plot_cost_curve(points, args.budget, f"{name}, {args.policy_dtype}, batch 1, "
                            f"{'eager' if section_compile is None else 'compiled'}", args.out / "cost_curve.png")
        if "policies" in args.sections:
            log(f"policies at budget {args.budget}:")
            rows_p = measure_policies(model, args.policies, args.budget, args.policy_batch, args.prompt_tokens,
                                      args.policy_cycles, section_compile, args.repeats, log, settings=policy_kwargs)
            results["policies"] = [asdict(r) for r in rows_p]
        del model
    if "table4" in args.sections:
        log("table 4:")
        results["table4"] = run_table4_section(args, device, compile_config, log, prefix="table4_")
    if "engine" in args.sections:
        log("engine (continuous batching):")
        results["engine"] = run_engine_section(args, path, device, compile_config, log)
    if "hf" in args.sections:
        log(f"hf (PolicyCache, BeaconKV({args.hf_budget})):")
        from .throughput import load_hf_model

        dtype = DTYPES[args.policy_dtype]
        rows_hf = measure_hf(load_hf_model(path, dtype, device), load_model(path, dtype=dtype, device=device),
                             int_list(args.hf_tokens), int_list(args.hf_batches), args.hf_budget,
                             args.hf_prompt_tokens, log)
        results["hf"] = {"budget": args.hf_budget, "rows": [asdict(r) for r in rows_hf]}
    if "tp" in args.sections:
        log(f"tensor parallelism ({args.tp_ranks} ranks x 1 thread vs 1 rank x {args.tp_ranks} threads):")
        results["tp"] = run_tp_section(args, path, device, log)
    if "compile" in args.sections:
        log("compile time (fresh processes):")
        results["compile"] = run_compile_section(args, args.model, device.type, args.policy_dtype, COMPILE_PROMPT, log)
    results["targets"] = [asdict(t) for t in evaluate_targets(results)]
    results["wall_time_s"] = time.perf_counter() - t0
    (args.out / "bench.json").write_text(json.dumps(results, indent=1, default=str))
    report = markdown_report(results)
    if "engine" in results:
        from_rows = [EngineRow(**r) for r in results["engine"]["rows"]]
        report += "\n\n" + markdown_engine(from_rows, results["engine"]["workload"])
    if "compile" in results:
        report += "\n\n" + markdown_compile(results["compile"])
    if "tp" in results:
        report += "\n\n" + markdown_tp(results["tp"])
    if "hf" in results:
        report += "\n\n" + markdown_hf([HFBenchRow(**r) for r in results["hf"]["rows"]], results["hf"]["budget"])
    (args.out / "bench.md").write_text(report + "\n")
    print(report)
    log(f"wrote {args.out}/bench.json, bench.md" + (", cost_curve.png" if "curve" in results else "")
        + f" in {results['wall_time_s'] / 60:.1f} min")
    return 0


def _policy_kwargs(args: argparse.Namespace, names: list[str]) -> dict[str, dict[str, Any]]:
    """Each evicting policy's arguments beyond the budget: ``--n-recent`` (``auto``: the policy's own,
    lowered to what ``--budget`` allows) and its share of ``--policy-arg``; each is built once, so bad
    settings fail before anything runs."""
    shares = policy_args_by_policy(args, names)
    out = {}
    for name in names:
        kwargs = {**({} if args.n_recent is None else {"n_recent": args.n_recent}), **shares[name]}
        policy = make_policy(name, budget=args.budget, **kwargs)  # no n_recent: "auto", the policy fits it
        out[name] = {**kwargs, "n_recent": policy.n_recent}
    return out


def _command_line(args: argparse.Namespace) -> str:
    """The command as typed, when this process is ``beaconkv bench`` / ``python -m ...speed``."""
    argv = sys.argv[1:]
    if argv[:1] == ["bench"]:
        argv = argv[1:]
    elif not sys.argv[0].endswith(("speed", "beaconkv", "__main__.py")):
        return "beaconkv bench (called from Python" + (", --quick)" if args.quick else ")")
    return " ".join(["beaconkv bench", *argv])
