"""``scripts/gpu_check.sh``, the one prepared command for a lent GPU: its CPU rehearsal runs every stage.

A GPU's minutes must go to measuring, not to fixing a typo in a module path: ``--device cpu --smoke`` runs all
four stages — Table 4 (its predictions, both policies at the paper's batch and at their largest batch, through the
recorded-graph executor), the engine section, the CUDA tests' CPU twins, recorded graphs against a compiled shape —
in the GPU run's order and under the same deadline logic, so no stage can name a module, flag or function that
does not exist, and a deadline that leaves no room skips each stage with its reason.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from beaconkv.measure.speed import gpu_check
from beaconkv.measure.speed.gpu_check import CUDA_TEST_FILES, STAGES, stage_plans

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _run(*args: str, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, **(env or {})}
    env.pop("OUT", None)
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=timeout,
                          check=False)


@pytest.mark.slow
def test_the_cpu_rehearsal_runs_every_stage_in_order_figures_first(tmp_path: Path) -> None:
    done = _run("--device", "cpu", "--smoke", str(tmp_path))
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-2000:]
    # the stages in the GPU run's order, Table 4's rows before anything else is measured
    heads = [out.index(f"=== {stage} (") for stage in STAGES]
    assert heads == sorted(heads), heads
    table4 = out[heads[0]:heads[1]]
    order = ["predicted full", "predicted beacon", "FullKV [batch 2]", "BeaconKV(64) [batch 2]",
             "FullKV [largest batch]", "BeaconKV(64) [largest batch]"]
    positions = [table4.index(line) for line in order]
    assert positions == sorted(positions), table4
    result = json.loads((tmp_path / "table4.json").read_text())
    rows = {(r["policy"], r["label"]): r for r in result["rows"]}
    assert set(rows) == {(p, label) for p in ("full", "beacon") for label in ("batch 2", "largest batch")}
    for row in rows.values():
        assert row["executor"] == "GraphExecutor" and row["tokens_per_s"] > 0 and row["predicted_peak_bytes"] > 0
        assert row["peak_bytes"] is None  # nothing measures a peak on a CPU: the prediction stands alone
    assert len(rows["full", "batch 2"]["ms_per_step"]) == 4  # the generation's start, thirds and end
    beacon = rows["beacon", "batch 2"]
    assert beacon["evictions"] > 0 and beacon["eviction_ms"] is not None and "sawtooth" in beacon["method"]
    assert rows["full", "largest batch"]["batch"] == rows["beacon", "largest batch"]["batch"] == 6  # --max-batch
    engine = json.loads((tmp_path / "engine.json").read_text())
    assert {(r["mode"], r["policy"]) for r in engine["rows"]} == {(m, p) for m in ("engine", "static")
                                                                  for p in ("full", "beacon")}
    assert all(r["evictions"] > 0 for r in engine["rows"] if r["policy"] == "beacon")
    tests = json.loads((tmp_path / "cuda_tests.json").read_text())
    assert tests["counts"]["passed"] > 0 and tests["counts"]["failed"] == tests["counts"]["errors"] == 0
    parallel = json.loads((tmp_path / "tensor_parallel.json").read_text())  # gloo, 2 ranks
    assert parallel["result"] == "tensor parallelism: passed" and "--device" in parallel["command"]
    assert out.count("tokens equal, kept positions equal over") == 3
    compare = json.loads((tmp_path / "graph_vs_compile.json").read_text())
    assert {r["shape"] for r in compare["rows"]} == {"graphs", "whole"}
    assert all(r["identical"] == r["batch"] for r in compare["rows"])
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [s["name"] for s in report["stages"]] == list(STAGES) and {s["status"] for s in report["stages"]} == {"ok"}
    summary = out.split("GPU check summary", 1)[1]
    assert "| FullKV, batch 2 | 2 |" in summary and "tests: " in summary and " passed" in summary
    assert "tensor parallelism: passed" in summary


def test_a_deadline_that_leaves_no_room_skips_each_stage_and_says_why(tmp_path: Path) -> None:
    done = _run("--device", "cpu", "--smoke", "--deadline-s", "0", str(tmp_path), timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    for stage in STAGES:
        line = next(line for line in done.stdout.splitlines() if line.startswith(f"=== {stage}:"))
        assert "skipped: would need ~" in line and ", 0 s left" in line, line
        assert json.loads((tmp_path / f"{stage}.json").read_text())["status"].startswith("skipped: would need")
    assert "total" in done.stdout.split("GPU check summary", 1)[1]


def test_inside_table4_each_measurement_checks_the_time_left(llama, capsys) -> None:
    """The paper's batch runs against the global deadline; the largest batches against the time the later stages
    leave it: here none, so each is skipped with the time it would need."""
    from beaconkv.execution import CompileConfig
    from beaconkv.measure.speed.table4_generation import Deadline, Table4Setting, run_table4_generation

    setting = Table4Setting(batch=2, new_tokens=96, prompt=8, budget=32, window=2, device_memory=64 << 20, max_batch=3)
    now = [1000.0]
    result = run_table4_generation(
        llama, setting, CompileConfig(strategy="graphs", recorder="op_replay"), Deadline(1030.0, lambda: now[0]),
        {"full": 20.0, "beacon": 25.0}, label="tiny llama", largest_deadline=Deadline(1000.0, lambda: now[0]))
    lines = capsys.readouterr().out.splitlines()
    assert [(r["policy"], r["label"]) for r in result["rows"]] == [("full", "batch 2"), ("beacon", "batch 2")]
    skipped = [line for line in lines if "[largest batch]" in line]
    assert len(skipped) == 2 and all("skipped: would need ~" in line and ", 0 s left" in line for line in skipped)
    assert [s["left_s"] for s in result["skipped"]] == [0, 0]
    # a first measurement estimated beyond the deadline is skipped too
    result = run_table4_generation(llama, setting, False, Deadline(1010.0, lambda: now[0]),
                                   {"full": 20.0, "beacon": 5.0}, label="tiny llama")
    assert [r["policy"] for r in result["rows"]] == ["beacon", "beacon"]
    assert result["skipped"][0]["part"] == "full [batch 2] batch 2" and result["skipped"][0]["need_s"] == 20


def test_stage_plans_name_missing_packages_and_keep_the_order(monkeypatch) -> None:
    monkeypatch.setattr(gpu_check, "_installed", lambda name: name not in ("hypothesis", "xdist"))
    plans = stage_plans(["cuda_tests", "table4"], "cuda", smoke=False)
    assert [p.name for p in plans] == ["table4", "cuda_tests"]
    assert plans[1].missing == ("hypothesis",) and plans[1].estimate_s > plans[0].estimate_s  # one worker: longer
    args = argparse.Namespace(smoke=False)
    command = gpu_check.cuda_tests_command(args, "python")
    assert command[-len(CUDA_TEST_FILES):] == list(CUDA_TEST_FILES) and "-n" not in command and "cuda" in command


def test_every_test_file_the_gpu_check_names_exists() -> None:
    """The GPU run selects tests by file; a file moved or renamed must fail here, not on the GPU."""
    missing = [f for f in CUDA_TEST_FILES if not (ROOT / f).is_file()]
    assert not missing, missing


def test_the_gpu_check_refuses_bad_options(tmp_path: Path, capsys) -> None:
    done = _run("--devcie", "cpu", timeout=120)
    assert done.returncode == 2 and "unrecognized arguments: --devcie" in done.stderr
    done = _run("--help", timeout=60)
    assert done.returncode == 0 and "figures first" in done.stdout
    for argv, message in ((["--device", "tpu"], "invalid choice: 'tpu'"),
                          (["--only", "table4,tabel4"], "--only tabel4: no such stage"),
                          (["--deadline-s", "-5"], "--deadline-s -5: give a number of seconds >= 0")):
        with pytest.raises(SystemExit) as exit_:
            gpu_check.main([*argv, "--out", str(tmp_path)])
        assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_a_missing_package_is_refused_in_one_line(tmp_path: Path) -> None:
    """The device's python lacks a package beaconkv imports: one line names it, nothing runs, nothing installs."""
    blocker = tmp_path / "blocked"
    blocker.mkdir()
    (blocker / "einops.py").write_text("raise ModuleNotFoundError(\"No module named 'einops'\", name='einops')\n")
    t0 = time.monotonic()
    done = _run("--device", "cpu", "--smoke", str(tmp_path / "out"), env={"PYTHONPATH": str(blocker)}, timeout=120)
    assert done.returncode == 3, done.stdout + done.stderr
    refusal = done.stderr.strip().splitlines()
    assert len(refusal) == 1 and "refused" in refusal[0] and "lacks einops" in refusal[0], refusal
    assert not (tmp_path / "out").exists() and time.monotonic() - t0 < 100


def test_the_tensor_parallel_stage_runs_the_distributed_check_and_reads_its_verdict(monkeypatch) -> None:
    """The stage's command is the check's (the smoke run at tiny sizes); its verdict line is what the summary
    shows, a skip on a machine with fewer than 2 GPUs included."""
    from beaconkv.measure import distributed_check as check

    command = gpu_check.tensor_parallel_command(argparse.Namespace(smoke=True, device="cpu"), "python")
    assert command[:3] == ["python", "-m", "beaconkv.measure.distributed_check"] and command[3:7] == ["--device", "cpu",
                                                                                              "--ranks", "2"]
    calls = []
    monkeypatch.setattr(check, "run_check", lambda *a, **k: calls.append((a, k)) or True)
    assert check.main(command[3:]) == 0
    assert calls == [(("cpu", 2), {"max_new_tokens": 24, "threads": 1, "budget": 16})]
    assert gpu_check.tensor_parallel_command(argparse.Namespace(smoke=False, device="cuda"))[-4:] == [
        "--device", "cuda", "--ranks", "2"]
    skipped = "tensor parallelism: skipped (1 GPU(s) here, 2 needed for NCCL over 2 ranks; ...)"
    assert gpu_check._tensor_parallel_result(f"starting\n{skipped}\n") == skipped
    assert "no verdict" in gpu_check._tensor_parallel_result("Traceback ...\n")
