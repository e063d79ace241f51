"""End to end with the embedded model: 2 AIME24 problems x 2 samples x 8 new tokens.

One single-process run (in this process, one thread) is the reference; it is resumed after losing
records, and the same command split over 2 processes (gloo, torchrun-style environment) must merge
to the same records — token ids included — because every sample has its own seed. For the same
reason the engine's pool size does not change a record: ``--max-batch 1`` and ``--max-batch 4``
write the same records, 24 new tokens each. The cache figures of a record are checked against the
engine's own peak. ``--backend hf`` runs the same command with the model in transformers.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from beaconkv.cli import main
from beaconkv.engine import Request
from beaconkv.eval.backend import load_backend
from beaconkv.eval.config import EvalConfig
from beaconkv.eval.runner import run_eval
from beaconkv.policies import make_policy

REPO = Path(__file__).resolve().parents[2]
# n_prefix=4 makes the prompt evictable, so even 8 new tokens exercise an eviction.
POLICY, BUDGET, POLICY_KWARGS = "beacon", 128, {"n_prefix": 4}
ARGS = dict(
    benchmark="aime24", limit=2, samples=2, max_new_tokens=8, policy=POLICY, budget=BUDGET,
    policy_kwargs=POLICY_KWARGS, save_token_ids=True,
)  # fmt: skip


# every in-process run of the module on one thread, like the distributed ranks (OMP_NUM_THREADS=1): the same
# arithmetic in every test, so their records compare
pytestmark = pytest.mark.usefixtures("one_thread")


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def comparable(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "seconds"} for r in records]


@pytest.fixture(scope="module")
def single_run(tmp_path_factory, project_data):
    """The reference: one process, one thread, in this interpreter."""
    out = tmp_path_factory.mktemp("single")
    backend = load_backend("embedded", device="cpu", dtype=torch.float32)
    cfg = EvalConfig(model="embedded", data=project_data / "aime24.jsonl", out_dir=out, progress=False, **ARGS)
    report = run_eval(cfg, backend=backend)
    return cfg, backend, report


@pytest.mark.slow
def test_end_to_end_records(single_run) -> None:
    _, _, report = single_run
    records = read(report.results_file)
    assert [(r["problem_id"], r["sample_idx"]) for r in records] == [("60", 0), ("60", 1), ("61", 0), ("61", 1)]
    for r in records:
        assert 1 <= r["new_tokens"] <= 8 and len(r["token_ids"]) == r["new_tokens"]
        assert r["finish_reason"] in ("stop", "length")
        assert r["correct"] is False  # 8 tokens are not enough to answer an AIME problem
        assert r["peak_cache_tokens"] >= r["prompt_tokens"] > 100
        assert r["seconds"] > 0 and r["evictions"] >= 1
        assert (r["policy"], r["budget"]) == (POLICY, BUDGET)
        assert r["reference"] in ("204", "113")
    assert records[0]["seed"] != records[1]["seed"]
    (row,) = report.rows
    assert (row.benchmark, row.policy, row.budget, row.samples, row.pass_at_1) == ("aime24", "beacon", 128, 4, 0.0)


@pytest.mark.slow
def test_resume_regenerates_only_missing_samples_identically(single_run, tmp_path) -> None:
    cfg, backend, report = single_run
    out = tmp_path / "resume"
    out.mkdir()
    merged = out / report.results_file.name
    records = read(report.results_file)
    merged.write_text("".join(json.dumps(r) + "\n" for r in records[::2]))  # lose samples 1 and 3
    cfg_here = EvalConfig(**{**cfg.__dict__, "out_dir": out})
    resumed = run_eval(cfg_here, backend=backend)
    assert (resumed.generated, resumed.skipped) == (2, 2)
    assert comparable(read(merged)) == comparable(records)
    again = run_eval(cfg_here, backend=backend)
    assert again.generated == 0 and comparable(read(merged)) == comparable(records)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_merge_to_the_single_process_results(single_run, project_data, tmp_path) -> None:
    _, _, report = single_run
    out = tmp_path / "dist"
    cmd = [
        sys.executable, "-m", "beaconkv.eval", "--model", "embedded", "--benchmark", "aime24",
        "--data", str(project_data / "aime24.jsonl"), "--limit", "2", "--samples", "2",
        "--max-new-tokens", "8", "--policy", POLICY, "--out", str(out), "--save-token-ids",
        "--no-progress", "--dist-timeout-min", "5",
    ]  # fmt: skip
    cmd += ["--budget", str(BUDGET)] + [f"--policy-arg={k}={v}" for k, v in POLICY_KWARGS.items()]
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1",
        }  # fmt: skip
        procs.append(
            subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    outputs = []
    for proc in procs:
        try:
            stdout, stderr = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        outputs.append((proc.returncode, stdout, stderr))
    for rank, (code, _, stderr) in enumerate(outputs):
        assert code == 0, f"rank {rank} failed:\n{stderr[-3000:]}"
    assert "| aime24 |" in outputs[0][1]  # rank 0 prints the table
    merged = out / report.results_file.name
    assert sorted(p.name for p in out.iterdir()) == sorted([merged.name, "summary.md", "summary.json"])
    assert comparable(read(merged)) == comparable(read(report.results_file))
    shutil.rmtree(out)


@pytest.mark.slow
def test_cli_with_int8_kv_storage_and_the_project_data(tmp_path, capsys) -> None:
    out = tmp_path / "int8"
    argv = [
        "eval", "--model", "embedded", "--benchmark", "aime24", "--limit", "1", "--samples", "1",
        "--max-new-tokens", "8", "--policy", POLICY, "--budget", str(BUDGET), "--out", str(out),
        "--device", "cpu", "--kv-storage", "int8", "--no-progress",
    ]  # fmt: skip
    argv += [f"--policy-arg={k}={v}" for k, v in POLICY_KWARGS.items()]
    assert main(argv) == 0, capsys.readouterr().err
    (record,) = read(out / "aime24__beacon__b128.jsonl")
    assert (record["problem_id"], record["reference"]) == ("60", "204")  # the project's data/aime24.jsonl
    assert record["settings"]["kv_storage"] == "int8"
    assert 1 <= record["new_tokens"] <= 8 and record["evictions"] >= 1


@pytest.mark.slow
def test_cli_with_the_hf_backend(tmp_path, capsys, monkeypatch) -> None:
    """``--backend hf``: the embedded model loaded in transformers runs the same harness and writes the rows."""
    pytest.importorskip("transformers", reason="--backend hf needs the hf extra")
    from beaconkv.eval import hf_backend

    loads = []
    real = hf_backend.load_hf_backend
    monkeypatch.setattr(hf_backend, "load_hf_backend", lambda *a, **k: loads.append((a, k)) or real(*a, **k))
    out = tmp_path / "hf"
    argv = [
        "eval", "--backend", "hf", "--model", "embedded", "--benchmark", "aime24", "--limit", "2", "--samples", "1",
        "--max-new-tokens", "8", "--policy", POLICY, "--budget", str(BUDGET), "--out", str(out),
        "--device", "cpu", "--save-token-ids", "--no-progress",
    ]  # fmt: skip
    argv += [f"--policy-arg={k}={v}" for k, v in POLICY_KWARGS.items()]
    assert main(argv) == 0, capsys.readouterr().err
    assert loads == [(("embedded",), {"device": "cpu", "dtype": torch.float32})]
    records = read(out / "aime24__beacon__b128.jsonl")
    assert [(r["problem_id"], r["sample_idx"], r["reference"]) for r in records] == [("60", 0, "204"), ("61", 0, "113")]
    assert all(r["settings"]["backend"] == "hf" for r in records)
    assert all(1 <= r["new_tokens"] == len(r["token_ids"]) <= 8 and r["evictions"] >= 1 for r in records)
    assert "| aime24 | beacon | 128 | 2 | 2 |" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.long
def test_max_batch_does_not_change_the_records(tmp_path, capsys) -> None:
    argv = [
        "eval", "--model", "embedded", "--benchmark", "aime24", "--limit", "2", "--samples", "2",
        "--max-new-tokens", "24", "--policy", POLICY, "--budget", str(BUDGET), "--device", "cpu",
        "--save-token-ids", "--no-progress",
    ]  # fmt: skip
    argv += [f"--policy-arg={k}={v}" for k, v in POLICY_KWARGS.items()]
    for max_batch in (1, 4):
        assert main([*argv, "--max-batch", str(max_batch), "--out", str(tmp_path / str(max_batch))]) == 0
    capsys.readouterr()
    one, four = (read(tmp_path / str(b) / "aime24__beacon__b128.jsonl") for b in (1, 4))
    assert [(r["problem_id"], r["sample_idx"]) for r in one] == [("60", 0), ("60", 1), ("61", 0), ("61", 1)]
    assert any(r["new_tokens"] == 24 for r in one) and all(r["evictions"] >= 1 for r in one)
    assert comparable(one) == comparable(four)  # every field but the timing, token ids included


@pytest.mark.slow
def test_cache_figures_match_the_engines_own_peak(single_run) -> None:
    _, backend, _ = single_run
    prompt = backend.tokenizer.encode_prompt("Count to twenty: one, two, three,")
    for policy in (None, make_policy("beacon", budget=16, n_prefix=4, n_recent=2)):
        engine = backend.make_engine(policy=policy, max_batch=1, prompt_capacity=len(prompt), max_new_tokens=20)
        assert engine.slot_capacity == engine.cache_figures(engine.run([Request(prompt, 1)])[0]).capacity
        for new in (1, 5, 20):  # growing peaks: the engine's peak over all its requests is the latest one's
            (done,) = engine.run([Request(prompt, max_new_tokens=new, eos_token_ids=[])])
            assert engine.cache_figures(done).peak_tokens == engine.session.state.peak_tokens
        assert (done.evictions > 0) == (policy is not None)  # the figures hold across evictions too


@pytest.mark.slow
def test_new_tokens_are_capped_to_the_models_positions(single_run) -> None:
    _, backend, _ = single_run
    policy = make_policy("beacon", budget=16, n_prefix=4, n_recent=2)
    engine = backend.make_engine(policy=policy, max_batch=1, prompt_capacity=100, max_new_tokens=16)
    positions = engine.model.config.max_position_embeddings
    assert engine.max_new_tokens == 16  # room enough: as asked
    with pytest.warns(UserWarning, match=rf"max_new_tokens={10**7} capped to {positions - 100}"):
        engine = backend.make_engine(policy=policy, max_batch=1, prompt_capacity=100, max_new_tokens=10**7)
    assert engine.max_new_tokens == positions - 100
    with pytest.raises(ValueError, match=f"the longest prompt has {positions} tokens.*no room for a new token"):
        backend.make_engine(policy=policy, max_batch=1, prompt_capacity=positions, max_new_tokens=8)
