"""The evaluation harness on a transformers model: ``run_eval(config, backend=load_hf_backend(...))`` writes the
records the core backend writes (greedy, BeaconKV evicting), and its engine keeps the EvalEngine contract."""

from __future__ import annotations

import json

import pytest
import torch

from beaconkv.engine import Request
from beaconkv.eval.backend import load_backend, run_requests
from beaconkv.eval.config import EvalConfig
from beaconkv.eval.hf_backend import load_hf_backend
from beaconkv.eval.runner import run_eval
from beaconkv.paths import data_dir
from beaconkv.policies import BeaconKV

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
