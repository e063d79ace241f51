"""The evaluation harness on a transformers model: ``run_eval(config, backend=load_hf_backend(...))`` writes the
records the core backend writes (greedy, BeaconKV evicting; ``--prefill-chunk`` too), and its engine keeps the
EvalEngine contract."""

from __future__ import annotations

import json

import pytest

from beaconkv.decode_setup import DecodeSetup
import torch

from beaconkv.engine import Request
from beaconkv.eval.backend import load_backend, run_requests
from beaconkv.eval.config import EvalConfig
from beaconkv.eval.hf_backend import load_hf_backend
from beaconkv.eval.runner import run_eval
from beaconkv.paths import data_dir
from beaconkv.cli import main
from beaconkv.policies import BeaconKV, SnapKV

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")


def _records(folder) -> list[dict]:
    (merged,) = sorted(folder.glob("aime24*.jsonl"))
    return [{k: v for k, v in json.loads(line).items() if k != "seconds"} for line in merged.read_text().splitlines()]


def test_run_eval_on_the_hf_backend_writes_the_core_backends_records(tmp_path):
    """The embedded model (it has a chat template), 2 AIME24 problems, 24 greedy tokens, the prompt evictable."""
    settings = dict(model="embedded", benchmark="aime24", data=data_dir() / "aime24.jsonl", limit=2,
                    samples=1, max_new_tokens=24, temperature=0.0, policy="beacon", budget=16,
                    policy_kwargs={"n_recent": 2, "n_beacon": 2, "n_prefix": 4}, save_token_ids=True, progress=False,
                    device="cpu", dtype="float32")
    run_eval(EvalConfig(out_dir=tmp_path / "hf", **settings),
             backend=load_hf_backend("embedded", device="cpu", dtype=torch.float32))
    run_eval(EvalConfig(out_dir=tmp_path / "core", **settings),
             backend=load_backend("embedded", device="cpu", dtype=torch.float32))
    hf, core = _records(tmp_path / "hf"), _records(tmp_path / "core")
    assert len(hf) == 2 and [r["token_ids"] for r in hf] == [r["token_ids"] for r in core]
    assert [r.get("evictions") for r in hf] == [r.get("evictions") for r in core] and hf[0].get("evictions")


def test_the_hf_engine_runs_requests_one_at_a_time_and_reports_its_cache(tiny_checkpoint):
    backend = load_hf_backend(str(tiny_checkpoint), device="cpu", dtype=torch.float32)
    engine = backend.make_engine(policy=BeaconKV(16, n_recent=2, n_beacon=2), max_batch=4, prompt_capacity=32,
                                 max_new_tokens=50)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]]
    done = list(run_requests(engine, [Request(p, max_new_tokens=50, eos_token_ids=[]) for p in prompts]))
    assert engine.idle and [len(c.token_ids) for c in done] == [50, 50] and min(c.evictions for c in done) > 0
    figures = engine.cache_figures(done[1])
    assert figures.capacity == len(prompts[1]) + 16 and figures.peak_tokens <= figures.capacity
    with pytest.raises(ValueError, match="stop strings"):
        engine.submit(Request([5], stop=("x",)))


def test_the_hf_engine_prefills_in_chunks_and_reports_the_bounded_cache(tiny_checkpoint):
    backend = load_hf_backend(str(tiny_checkpoint), device="cpu", dtype=torch.float32)
    policy = SnapKV(16, n_recent=2, n_prefix=2)
    engine = backend.make_engine(policy=policy, max_batch=1, prompt_capacity=80, max_new_tokens=20,
                                 setup=DecodeSetup(prefill_chunk=8))
    prompt = list(range(3, 83))
    (done,) = run_requests(engine, [Request(prompt, max_new_tokens=20, eos_token_ids=[])])
    figures = engine.cache_figures(done)
    assert figures.capacity == policy.capacity([80], 20, prefill_chunk=8) <= 2 + 16 + 8 < 80
    assert figures.peak_tokens <= figures.capacity and done.evictions >= 8  # 80 prompt tokens through 26 slots
    whole = backend.make_engine(policy=policy, max_batch=1, prompt_capacity=80, max_new_tokens=20)
    (done,) = run_requests(whole, [Request(prompt, max_new_tokens=20, eos_token_ids=[])])
    assert whole.cache_figures(done).capacity >= 80


def test_eval_backend_hf_prefill_chunk_writes_the_core_backends_records(tmp_path, capsys):
    """``beaconkv eval --backend hf --prefill-chunk N`` (once refused) writes the native run's greedy records."""
    argv = ["eval", "--model", "embedded", "--benchmark", "aime24", "--limit", "1", "--samples", "1",
            "--max-new-tokens", "8", "--temperature", "0", "--policy", "snapkv", "--budget", "32", "--n-recent", "4",
            "--policy-arg", "n_prefix=4", "--prefill-chunk", "32", "--device", "cpu", "--dtype", "float32",
            "--save-token-ids", "--no-progress"]
    assert main([*argv, "--backend", "hf", "--out", str(tmp_path / "hf")]) == 0, capsys.readouterr().err
    assert main([*argv, "--out", str(tmp_path / "core")]) == 0, capsys.readouterr().err
    (hf,), (core,) = _records(tmp_path / "hf"), _records(tmp_path / "core")
    assert hf["settings"]["prefill_chunk"] == 32 and hf["settings"]["backend"] == "hf"
    assert hf["token_ids"] == core["token_ids"] and hf["evictions"] == core["evictions"] >= 1
    assert hf["cache_capacity"] == core["cache_capacity"] <= 4 + 32 + 32 < hf["prompt_tokens"]
