"""``beaconkv eval --tensor-parallel-size N``: the records of one process, written by groups of ranks.

A tiny random Qwen3 with a word tokenizer and a one-line chat template evaluates 3 short AIME-style problems x 2
sampled answers under SnapKV (budget 16: every long answer evicts). Started alone with 2 ranks it writes the
single process's records, token ids included; under a ``torchrun``-style world of 4 processes (2 groups of 2:
data parallel x tensor parallel) the merged records are the same again. A rank killed mid-run ends the run
with one error naming it; ``--compile`` and ``--backend hf`` are refused before anything loads.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket

import pytest
import torch
import torch.multiprocessing as mp

from beaconkv.cli import main
from beaconkv.distributed import TensorParallelError
from beaconkv.eval.benchmarks import Problem
from beaconkv.eval.config import EvalConfig
from beaconkv.eval.runner import run_eval

pytestmark = pytest.mark.usefixtures("one_thread")

STEM = "aime24__snapkv__b16.jsonl"
PROBLEMS = [Problem("aime24", str(i), " ".join("abcdefghij"[(i + j) % 10] for j in range(12)), "1") for i in range(3)]
ARGS = dict(benchmark="aime24", samples=2, max_new_tokens=24, policy="snapkv", budget=16, save_token_ids=True,
            progress=False, device="cpu")


@pytest.fixture(scope="module")
def chat_checkpoint(qwen3_cli_checkpoint, tmp_path_factory):
    """The tiny random Qwen3 with its word tokenizer and a chat template (what the harness renders prompts with)."""
    d = tmp_path_factory.mktemp("qwen3_chat")
    for f in qwen3_cli_checkpoint.iterdir():
        shutil.copy(f, d / f.name)
    config = json.loads((d / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "problems.jsonl"
    path.write_text("".join(json.dumps({"id": p.id, "problem": p.question, "answer": p.answer}) + "\n"
                            for p in PROBLEMS))
    return path


def argv(checkpoint, data, out, *extra: str) -> list[str]:
    """``beaconkv eval`` over the problems: 2 sampled answers each, 24 new tokens, SnapKV at 16."""
    return ["eval", "--model", str(checkpoint), "--benchmark", "aime24", "--data", str(data), "--samples", "2",
            "--max-new-tokens", "24", "--policy", "snapkv", "--budget", "16", "--out", str(out), "--device", "cpu",
            "--save-token-ids", "--no-progress", *extra]


def read(path) -> list[dict]:
    """The records, without their timing."""
    return [{k: v for k, v in json.loads(line).items() if k != "seconds"} for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def single_records(chat_checkpoint, data_file, tmp_path_factory):
    """The reference: one process, one thread."""
    out = tmp_path_factory.mktemp("single")
    assert main(argv(chat_checkpoint, data_file, out)) == 0
    records = read(out / STEM)
    assert len(records) == 6 and any(r["evictions"] >= 1 for r in records)
    assert all(len(r["token_ids"]) == r["new_tokens"] >= 1 for r in records)
    return records


def test_two_ranks_started_alone_write_the_single_process_records(chat_checkpoint, data_file, single_records,
                                                                   tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the spawned rank's threads
    out = tmp_path / "tp2"
    capsys.readouterr()
    assert main(argv(chat_checkpoint, data_file, out, "--tensor-parallel-size", "2")) == 0, capsys.readouterr().err
    assert read(out / STEM) == single_records
    assert "| aime24 | snapkv | 16 |" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == sorted([STEM, "summary.md", "summary.json"])
    assert not torch.distributed.is_initialized()


def _world_rank(index: int, world: int, port: int, args: list[str], out: str) -> None:
    """One process of ``torchrun --nproc-per-node 4 -m beaconkv.eval ... --tensor-parallel-size 2``."""
    import contextlib
    import io

    os.environ.update(RANK=str(index), WORLD_SIZE=str(world), LOCAL_RANK=str(index), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(args)
    with open(f"{out}.{index}", "w") as f:
        json.dump({"code": code, "printed": printed.getvalue()}, f)


def test_data_parallel_times_tensor_parallel_under_torchrun(chat_checkpoint, data_file, single_records, tmp_path):
    """4 processes, 2 groups of 2: ranks 0 and 2 lead a group (data-parallel ranks 0 and 1), ranks 1 and 3
    mirror them; the merged records are the single process's, and only rank 0 prints the table."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "dpxtp"
    args = argv(chat_checkpoint, data_file, out, "--tensor-parallel-size", "2", "--dist-timeout-min", "2")
    mp.start_processes(_world_rank, args=(4, port, args, str(tmp_path / "rank")), nprocs=4, start_method="spawn")
    assert read(out / STEM) == single_records
    ranks = [json.loads((tmp_path / f"rank.{i}").read_text()) for i in range(4)]
    assert [r["code"] for r in ranks] == [0, 0, 0, 0]
    assert "| aime24 | snapkv | 16 | 3 | 6 |" in ranks[0]["printed"]
    assert [r["printed"] for r in ranks[1:]] == ["", "", ""]
    assert sorted(p.name for p in out.iterdir()) == sorted([STEM, "summary.md", "summary.json"])


def test_a_killed_rank_ends_the_evaluation_with_one_error(chat_checkpoint, tmp_path, monkeypatch):
    """Rank 1 killed at rank 0's first decode step: one TensorParallelError naming it, no rank left running."""
    from beaconkv.eval import tensor_parallel as tp_eval

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    runs = []

    class Recorded(tp_eval.TensorParallelRun):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            runs.append(self)

    step = tp_eval.MirroredEvalEngine.step

    def kill_then_step(self):
        if runs and runs[0].processes.processes[0].is_alive():
            os.kill(runs[0].processes.pids()[0], signal.SIGKILL)
            runs[0].processes.processes[0].join(10)
        return step(self)

    monkeypatch.setattr(tp_eval, "TensorParallelRun", Recorded)
    monkeypatch.setattr(tp_eval.MirroredEvalEngine, "step", kill_then_step)
    config = EvalConfig(model=str(chat_checkpoint), out_dir=tmp_path / "killed", tensor_parallel_size=2, **ARGS)
    with pytest.raises(TensorParallelError, match=r"while evaluating: rank 1 died of SIGKILL"):
        run_eval(config, problems=PROBLEMS)
    assert not any(p.is_alive() for p in runs[0].processes.processes)
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("extra, message", [
    (["--compile"], "--tensor-parallel-size 2 runs the native backend eagerly; drop --compile and --backend hf"),
    (["--backend", "hf"], "--tensor-parallel-size 2 runs the native backend eagerly"),
])
def test_compile_and_the_hf_backend_are_refused_before_anything_loads(tmp_path, capsys, extra, message):
    out = tmp_path / "refused"
    code = main(["eval", "--model", str(tmp_path / "no-such-model"), "--benchmark", "aime24", "--out", str(out),
                 "--tensor-parallel-size", "2", *extra])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()
    with pytest.raises(ValueError, match="drop --compile and --backend hf"):
        EvalConfig(model="embedded", benchmark="aime24", tensor_parallel_size=2, compile=True)
    assert EvalConfig(model="embedded", benchmark="aime24").tensor_parallel_size == 1

