"""``scripts/gpu_check.sh``, the one prepared command for a lent GPU, runs every stage on the CPU.

A GPU's minutes must go to measuring, not to fixing a typo in a module path: ``--device cpu --smoke``
runs all four stages (the CUDA tests' CPU bodies, compiled vs eager decode, the Table-4 run, the
engine section) at tiny shapes, so no stage can name a module, flag or function that does not exist.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"
STAGES = ("parity_and_compile_tests", "cuda_graph_decode", "table4_qwen3_4b_batch16", "engine_qwen3_4b")


@pytest.mark.slow
def test_every_stage_of_the_gpu_check_runs_on_the_cpu(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(SCRIPT), "--device", "cpu", "--smoke", str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=900, check=False)
    summary = done.stdout.split("GPU check summary", 1)[-1]
    assert done.returncode == 0, summary + done.stderr[-2000:]
    for stage in STAGES:
        assert f"  {stage}: ok in " in summary, summary
    assert " passed" in summary and " failed" not in summary, summary
    decode = [line for line in summary.splitlines() if line.startswith("  decode: ")]
    # FullKV and BeaconKV for each decode-step shape, regions first (its lines come before whole's slower compile)
    assert [line.split(":")[1].split(" [")[1] for line in decode] == ["regions]", "regions]", "whole]", "whole]"], decode
    assert all("2/2 sequences identical to eager" in line for line in decode), decode
    assert all("compiled evictions" in line and " 0 compiled evictions" not in line for line in decode[1::2]), decode
    assert (tmp_path / "table4" / "table4.json").exists() and (tmp_path / "engine" / "bench.json").exists()


def test_every_test_file_the_gpu_check_names_exists() -> None:
    """The full (GPU) run selects tests by file too; a file moved or renamed must fail here, not on the GPU."""
    named = set(re.findall(r"tests/[\w/]+\.py", SCRIPT.read_text()))
    assert named, "the script names no test file"
    missing = sorted(f for f in named if not (SCRIPT.parents[1] / f).is_file())
    assert not missing, missing


def test_the_gpu_check_refuses_an_unknown_option(tmp_path: Path) -> None:
    done = subprocess.run(["bash", str(SCRIPT), "--devcie", "cpu"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "unknown option --devcie" in done.stderr
    done = subprocess.run(["bash", str(SCRIPT), "--device", "tpu"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "choose cuda or cpu" in done.stderr
