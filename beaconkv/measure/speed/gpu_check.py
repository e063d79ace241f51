"""The GPU check (``scripts/gpu_check.sh``): figures first, every stage under one global deadline.

A lent GPU comes for a few minutes and one call; this runs, in order:

1. ``table4`` — the paper's Table 4 on the Qwen3-4B shape (random weights, bf16): FullKV against BeaconKV(2048) at
   batch 14, peak memory beside :func:`~beaconkv.measure.memory.memory_plan`'s prediction, tokens/s of a 32K-token
   generation integrated from cache fill levels, then each policy at the largest batch 90% of the device holds
   (:mod:`.table4_generation`);
2. ``engine`` — the engine section of ``beaconkv bench`` on the same shape at one KV-memory limit: continuous
   batching against static batches, BeaconKV against FullKV (:mod:`.engine_bench`, random prompt ids);
3. ``cuda_tests`` — the tests marked ``cuda`` (transformers parity, recorded CUDA graphs and inductor against
   eager, every policy under CUDA's sync debug mode), on 8 pytest workers where pytest-xdist is installed;
4. ``tensor_parallel`` — ``python -m beaconkv.measure.distributed_check``: a random Qwen3 generated in one process and over
   2 ranks with NCCL (gloo with ``--device cpu``), tokens and kept positions compared for three policies; with
   fewer than 2 GPUs it says it skipped tensor parallelism (the stage's status and the summary say so too);
5. ``graph_vs_compile`` — the recorded CUDA graphs against inductor's compiled shapes on the SmolLM2-135M shape
   (:mod:`.graph_decode`): whether inductor beats the default; its cold compiles take minutes, so the default
   deadline leaves no room for it.

Each stage runs in a process of its own (a CUDA error or an out-of-memory cannot spoil the next one), prints its
lines as soon as they exist and writes its JSON under the output folder (``table4.json``, ``engine.json``,
``cuda_tests.json``, ``tensor_parallel.json``, ``graph_vs_compile.json``; ``gpu_check.json`` sums up). Before a
stage starts, its estimated time is compared with what the deadline (``--deadline-s``, default 450 s from the
script's start) leaves: a stage that would not fit prints ``skipped: would need ~N s, M s left``; inside
``table4`` every measurement is checked the same way, the largest-batch ones against the time the later stages
need; a stage still running at the deadline is stopped. A stage whose packages are missing is skipped with their
names (this installs nothing).

``--device cpu --smoke`` runs the same stages, order and deadline logic at tiny shapes on a CPU (the recorded
graphs through :class:`~beaconkv.execution.OpReplayRecorder`); ``make test`` runs it (``tests/test_gpu_check.py``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["CUDA_TEST_FILES", "DEFAULT_DEADLINE_S", "OPTIONAL", "STAGES", "STAGE_PACKAGES", "StagePlan",
           "build_parser", "cuda_tests_command", "main", "orchestrate", "run_engine_stage",
           "run_graph_vs_compile_stage", "run_table4_stage", "stage_estimate", "stage_plans",
           "tensor_parallel_command"]

STAGES = ("table4", "engine", "cuda_tests", "tensor_parallel", "graph_vs_compile")
"""The stages, in the order they run."""
DEFAULT_DEADLINE_S = 450.0
"""Seconds from the script's start to the end of the last stage (a device call allows 8 minutes)."""
ROOT = Path(__file__).resolve().parents[3]
"""The project's folder (the tests the ``cuda_tests`` stage runs live under it)."""
CUDA_TEST_FILES = ("tests/test_compile.py", "tests/execution/test_sync.py", "tests/measure/test_table4_generation.py",
                   "tests/execution/test_cuda_graphs.py")
"""The test files of the ``cuda_tests`` stage (``-m cuda``); the smoke run takes the last one only."""
OPTIONAL = frozenset({"graph_vs_compile"})
"""Stages that run only with time to spare: no earlier stage keeps time for them."""
STAGE_PACKAGES = {"table4": ("torch", "numpy"), "engine": ("torch", "numpy"),
                  "cuda_tests": ("pytest", "hypothesis", "transformers"), "tensor_parallel": ("torch", "safetensors"),
                  "graph_vs_compile": ("torch",)}
"""What each stage imports beyond beaconkv's own dependencies."""


@dataclass(frozen=True)
class StagePlan:
    """One stage as this run will try it.

    Attributes:
        name: One of :data:`STAGES`.
        estimate_s: Seconds it is expected to take (decides whether it starts).
        missing: Packages it needs that are not installed (it is skipped when any are).
    """

    name: str
    estimate_s: float
    missing: tuple[str, ...] = ()


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def stage_estimate(name: str, device: str, smoke: bool, xdist: bool = True) -> float:
    """Seconds a stage is expected to take, from the GPU run that sized them (an H200: the 112 CUDA tests took
    110 s on 8 workers) and the CPU rehearsal on a busy 2-core machine, with room to spare.

    Args:
        name: The stage.
        device: ``"cuda"`` or ``"cpu"``.
        smoke: Tiny shapes.
        xdist: pytest-xdist is installed (the CUDA tests run on 8 workers).
    """
    if smoke:
        return {"table4": 20.0, "engine": 30.0, "cuda_tests": 45.0, "tensor_parallel": 40.0,
                "graph_vs_compile": 60.0}[name]
    if name == "cuda_tests":
        return 120.0 if xdist else 420.0
    return {"table4": 120.0, "engine": 100.0, "tensor_parallel": 60.0, "graph_vs_compile": 300.0}[name]


def stage_plans(names: Sequence[str], device: str, smoke: bool) -> list[StagePlan]:
    """Each selected stage's estimate and missing packages, in :data:`STAGES` order."""
    xdist = _installed("xdist")
    return [StagePlan(n, stage_estimate(n, device, smoke, xdist),
                      tuple(p for p in STAGE_PACKAGES[n] if not _installed(p))) for n in STAGES if n in names]


# --------------------------------------------------------------------------------------------- stages
def _setting(args: argparse.Namespace) -> Any:
    from .table4_generation import Table4Setting

    if args.smoke:
        return Table4Setting(batch=2, new_tokens=512, prompt=16, budget=64, window=4, device_memory=64 << 20,
                             max_batch=6)
    return Table4Setting()


def _execution(args: argparse.Namespace) -> Any:
    """The default execution on CUDA (recorded CUDA graphs); on a CPU the same executor through the op-replay
    recorder (the rehearsal's stand-in)."""
    from ...execution import CompileConfig

    return True if args.device == "cuda" else CompileConfig(strategy="graphs", recorder="op_replay")


def _model(args: argparse.Namespace, shape: str) -> tuple[Any, str]:
    import torch

    from ...models.random_weights import RANDOM_SHAPES, random_model

    name = "qwen3-tiny" if args.smoke else shape
    dtype = torch.float32 if args.smoke and args.device == "cpu" else torch.bfloat16
    t0 = time.perf_counter()
    model = random_model(RANDOM_SHAPES[name](), dtype, args.device)
    print(f"model: {name}, random weights, {str(dtype).removeprefix('torch.')}, built in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    return model, f"{name}-shaped, random weights"


def _device_line(device: str) -> str:
    import torch

    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        return (f"{torch.cuda.get_device_name(0)}, {props.total_memory / 2**30:.1f} GiB, torch {torch.__version__}, "
                f"CUDA {torch.version.cuda}")
    return f"CPU ({os.cpu_count()} cores), torch {torch.__version__}"


def run_table4_stage(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    """Stage 1 (see the module docstring)."""
    from .table4_generation import Deadline, markdown_table4_generation, run_table4_generation

    device = _device_line(args.device)
    log(f"device: {device}")
    model, label = _model(args, "qwen3-4b")
    first = {"full": 8.0, "beacon": 8.0} if args.smoke else {"full": 50.0, "beacon": 35.0}
    result = run_table4_generation(
        model, _setting(args), _execution(args), Deadline(args.deadline_at), first, log, args.out / "table4.json",
        label, largest_deadline=Deadline(None if args.deadline_at is None else args.deadline_at - args.reserve_s))
    result["device"] = device
    log("")
    log(markdown_table4_generation(result))
    return result


def run_engine_stage(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    """Stage 2 (see the module docstring)."""
    from .engine_bench import engine_targets, markdown_engine, measure_engine
    from .machine import kv_bytes_per_token

    model, label = _model(args, "qwen3-4b")
    if args.smoke:  # lengths past the budget: the BeaconKV pools evict
        requests, min_new, max_new, prompt, budget, full_slots, max_slots = 6, 40, 96, 32, 32, 2, 6
    else:
        requests, min_new, max_new, prompt, budget, full_slots, max_slots = 12, 64, 384, 128, 256, 4, 64
    limit = full_slots * (prompt + max_new) * kv_bytes_per_token(model.config, model.dtype)
    rows, workload = measure_engine(model, None, requests, min_new, max_new, limit, budget, max_slots,
                                    _execution(args), log=log, prompt_tokens=prompt, kernels="model")
    log("")
    log(markdown_engine(rows, workload))
    return {"model": label, "rows": [asdict(r) for r in rows], "workload": workload, "ratios": engine_targets(rows)}


def run_graph_vs_compile_stage(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    """Stage 4 (see the module docstring)."""
    from .graph_decode import graph_decode_configs, measure_graph_decode

    model, label = _model(args, "smollm2-135m")
    shapes = "graphs,whole" if args.smoke else "graphs,regions"
    configs = graph_decode_configs(shapes, "aot_eager" if args.smoke else "inductor",
                                   recorder="cuda" if args.device == "cuda" else "op_replay")
    rows = []
    for row in measure_graph_decode(model, 2 if args.smoke else 8, 16 if args.smoke else 64,
                                    48 if args.smoke else 256, 32 if args.smoke else 128, configs,
                                    n_recent=4 if args.smoke else 16):
        log(row.line())
        rows.append(asdict(row))
    return {"model": label, "rows": rows}


def _pytest_summary(text: str) -> dict[str, int]:
    """The counts of pytest's last summary line (``3 passed, 1 skipped in 2.0s``)."""
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    lines = [line for line in text.splitlines() if re.search(r"\b(passed|failed|skipped|error|errors)\b", line)]
    if lines:
        for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)", lines[-1]):
            counts["errors" if word.startswith("error") else word] += int(n)
    return counts


def cuda_tests_command(args: argparse.Namespace, python: str = sys.executable) -> list[str]:
    """The pytest command of stage 3: the tests marked ``cuda`` (the smoke run: one file, its CPU twins)."""
    files = CUDA_TEST_FILES[-1:] if args.smoke else CUDA_TEST_FILES
    workers = ["-n", "8"] if not args.smoke and _installed("xdist") else (["-n", "0"] if _installed("xdist") else [])
    return [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda", *workers, *files]


def tensor_parallel_command(args: argparse.Namespace, python: str = sys.executable) -> list[str]:
    """The command of the ``tensor_parallel`` stage: :mod:`beaconkv.measure.distributed_check` over 2 ranks (the smoke run:
    24 new tokens at budget 16, one thread per rank)."""
    smoke = ["--max-new-tokens", "24", "--budget", "16", "--threads", "1"] if args.smoke else []
    return [python, "-m", "beaconkv.measure.distributed_check", "--device", args.device, "--ranks", "2", *smoke]


def _tensor_parallel_result(output: str) -> str:
    """The check's verdict line (``tensor parallelism: passed`` / ``skipped (...)`` / ``FAILED: ...``)."""
    lines = [line.strip() for line in output.splitlines() if line.startswith("tensor parallelism: ")]
    return lines[-1] if lines else "tensor parallelism: no verdict (see tensor_parallel.log)"


# --------------------------------------------------------------------------------------------- driver
def _stream(command: list[str], log_path: Path, timeout_s: float, env: dict[str, str]) -> tuple[int | str, str]:
    """Runs ``command`` with its lines printed as they come (and kept in ``log_path``); stops it at ``timeout_s``
    (an interrupt, then a kill 10 s later).

    Returns:
        ``(exit status or "timeout", its output)``.
    """
    lines: list[str] = []
    with log_path.open("w", encoding="utf-8") as log:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                                env=env, start_new_session=True)

        def pump() -> None:
            for line in proc.stdout:
                print(line, end="", flush=True)
                log.write(line)
                lines.append(line)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        status: int | str
        try:
            status = proc.wait(max(timeout_s, 0.0))
        except subprocess.TimeoutExpired:
            status = "timeout"
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        reader.join(10)
    return status, "".join(lines)


def _run_stage_process(args: argparse.Namespace, name: str, timeout_s: float,
                       reserve_s: float) -> tuple[int | str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
           "PYTHONUNBUFFERED": "1"}
    if name == "cuda_tests":
        return _stream(cuda_tests_command(args), args.out / f"{name}.log", timeout_s, env)
    if name == "tensor_parallel":
        return _stream(tensor_parallel_command(args), args.out / f"{name}.log", timeout_s, env)
    command = [sys.executable, "-m", "beaconkv.measure.speed.gpu_check", "--stage", name, "--device", args.device,
               "--out", str(args.out), "--reserve-s", str(reserve_s)]
    if args.deadline_at is not None:
        command += ["--deadline-at", repr(args.deadline_at)]
    if args.smoke:
        command.append("--smoke")
    return _stream(command, args.out / f"{name}.log", timeout_s, env)


def _summary(args: argparse.Namespace, report: dict[str, Any]) -> None:
    smoke = ", smoke" if args.smoke else ""
    print(f"\n================ GPU check summary ({report['device']}{smoke}) ================")
    for stage in report["stages"]:
        detail = f" in {stage['wall_s']:.0f} s" if "wall_s" in stage else ""
        print(f"  {stage['name']}: {stage['status']}{detail}")
    def read(name: str) -> dict[str, Any]:  # this run's results (a skipped stage's file holds its status only)
        path = args.out / f"{name}.json"
        ran = any(s["name"] == name and "wall_s" in s for s in report["stages"])
        return json.loads(path.read_text()) if ran and path.is_file() else {}

    table = read("table4")
    if table.get("rows") is not None:
        from .table4_generation import markdown_table4_generation

        print("\n" + markdown_table4_generation(table))
    ratios = read("engine").get("ratios")
    if ratios:
        print("\n  engine: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    counts = read("cuda_tests").get("counts")
    if counts:
        print("  tests: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    verdict = read("tensor_parallel").get("result")
    if verdict:
        print(f"  {verdict}")
    print(f"  total {report['wall_s']:.0f} s of a {args.deadline_s:.0f} s deadline; output in {args.out}")


def orchestrate(args: argparse.Namespace) -> int:
    """Runs the selected stages in order under the deadline (see the module docstring); returns the exit status:
    0 when no stage failed (skipped ones included), 1 otherwise, 3 when the device asked for is not there."""
    import torch

    started = args.started_at if args.started_at is not None else time.time()
    args.deadline_at = started + args.deadline_s
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu_check: refused: --device cuda, but torch {torch.__version__} (CUDA {torch.version.cuda}) sees no "
              "CUDA device; run the CPU rehearsal with --device cpu --smoke", file=sys.stderr)
        return 3
    args.out.mkdir(parents=True, exist_ok=True)
    names = [n.strip() for n in args.only.split(",")] if args.only else list(STAGES)
    plans = stage_plans(names, args.device, args.smoke)
    gpu = shutil.which("nvidia-smi")
    device = f"torch {torch.__version__}, CUDA {torch.version.cuda}" if args.device == "cuda" else "CPU"
    if args.device == "cuda" and gpu:  # the name without a CUDA context in this process (the stages need the memory)
        query = subprocess.run([gpu, "--query-gpu=name,memory.total", "--format=csv,noheader"], capture_output=True,
                               text=True, check=False)
        device = f"{query.stdout.strip().splitlines()[0] if query.stdout.strip() else 'a GPU'}, {device}"
    print(f"GPU check on {device}: stages {', '.join(p.name for p in plans)}; deadline {args.deadline_s:.0f} s "
          f"({max(0.0, args.deadline_at - time.time()):.0f} s left)", flush=True)
    report: dict[str, Any] = {"device": device, "smoke": args.smoke, "deadline_s": args.deadline_s, "stages": []}
    failed = False
    for i, plan in enumerate(plans):
        left = max(0.0, args.deadline_at - time.time())
        entry: dict[str, Any] = {"name": plan.name, "estimate_s": plan.estimate_s}
        if plan.missing:
            entry["status"] = f"skipped: missing {', '.join(plan.missing)} (this check installs nothing)"
        elif plan.estimate_s > left:
            entry["status"] = f"skipped: would need ~{plan.estimate_s:.0f} s, {left:.0f} s left"
        if "status" in entry:
            print(f"=== {plan.name}: {entry['status']}", flush=True)
            (args.out / f"{plan.name}.json").write_text(json.dumps({"status": entry["status"]}, indent=1))
            report["stages"].append(entry)
            continue
        reserve = sum(p.estimate_s for p in plans[i + 1:] if not p.missing and p.name not in OPTIONAL)
        print(f"=== {plan.name} (estimate ~{plan.estimate_s:.0f} s, {left:.0f} s left)", flush=True)
        t0 = time.time()
        status, output = _run_stage_process(args, plan.name, left, reserve)
        entry["wall_s"] = time.time() - t0
        entry["status"] = "ok" if status == 0 else ("stopped at the deadline" if status == "timeout"
                                                     else f"FAILED (exit {status})")
        failed |= status != 0
        if plan.name == "tensor_parallel":
            verdict = _tensor_parallel_result(output)
            if status == 0 and verdict.startswith("tensor parallelism: skipped"):
                entry["status"] = verdict.removeprefix("tensor parallelism: ")  # fewer GPUs than ranks
            (args.out / "tensor_parallel.json").write_text(json.dumps(
                {"status": entry["status"], "command": tensor_parallel_command(args), "result": verdict,
                 "wall_s": entry["wall_s"]}, indent=1))
        if plan.name == "cuda_tests":
            counts = _pytest_summary(output)
            (args.out / "cuda_tests.json").write_text(json.dumps(
                {"status": entry["status"], "command": cuda_tests_command(args), "counts": counts,
                 "wall_s": entry["wall_s"]}, indent=1))
        report["stages"].append(entry)
    report["wall_s"] = time.time() - started
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    _summary(args, report)
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    """The options of ``scripts/gpu_check.sh`` (and of one stage's process, ``--stage``)."""
    parser = argparse.ArgumentParser(prog="scripts/gpu_check.sh", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes: the CPU rehearsal of every stage (make test runs --device cpu --smoke)")
    parser.add_argument("--deadline-s", type=float, default=DEFAULT_DEADLINE_S,
                        help=f"seconds from the start to the end of the last stage (default {DEFAULT_DEADLINE_S:.0f})")
    parser.add_argument("--only", default="", help=f"comma-separated stages to run, of {','.join(STAGES)}")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default $OUT, else results/gpu_check)")
    parser.add_argument("out_dir", nargs="?", type=Path, default=None, help="the output folder, as a positional")
    parser.add_argument("--started-at", type=float, default=None, help=argparse.SUPPRESS)  # the script's start
    parser.add_argument("--stage", choices=STAGES, default=None, help=argparse.SUPPRESS)  # one stage's process
    parser.add_argument("--deadline-at", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--reserve-s", type=float, default=0.0, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    """``python -m beaconkv.measure.speed.gpu_check`` (what ``scripts/gpu_check.sh`` runs)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in filter(None, (n.strip() for n in args.only.split(","))):
        if name not in STAGES:
            parser.error(f"--only {name}: no such stage (stages: {', '.join(STAGES)})")
    if args.deadline_s < 0:
        parser.error(f"--deadline-s {args.deadline_s:g}: give a number of seconds >= 0")
    args.out = Path(args.out or args.out_dir or os.environ.get("OUT") or "results/gpu_check").absolute()
    if args.stage is None:
        return orchestrate(args)
    runners = {"table4": run_table4_stage, "engine": run_engine_stage, "graph_vs_compile": run_graph_vs_compile_stage}
    if args.stage not in runners:
        parser.error(f"--stage {args.stage} runs its own command (pytest, beaconkv.measure.distributed_check), not here")
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    if args.device == "cpu":
        torch.set_num_threads(1 if args.smoke else torch.get_num_threads())
    result = runners[args.stage](args, lambda line: print(line, flush=True))
    (args.out / f"{args.stage}.json").write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
