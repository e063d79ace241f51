"""``beaconkv fidelity --backend hf``: the lock-step fidelity study on a transformers model, every run a PolicyCache.

On the same weights it measures what the native lock-step measures; on an architecture beaconkv's decoder does
not run (gpt-oss: sinks and sliding layers) it runs from the command line like any other checkpoint.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import shutil

import pytest
import torch

import beaconkv
from beaconkv.cli import main
from beaconkv.measure.fidelity.metrics import GlobalQueryRule
from beaconkv.measure.fidelity.study import measure_fidelity, study_runs
from beaconkv.measure.fidelity.traces import Trace

from ..conftest import save_tiny_model
from .test_architectures import tiny_config

tf = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")


def _same(a: float | int | str | None, b: float | int | str | None) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or abs(a - b) <= 1e-5
    return a == b


def test_the_hf_lockstep_measures_what_the_native_one_does(tmp_path):
    hf = save_tiny_model("qwen3", tmp_path)
    hf.set_attn_implementation("sdpa")
    ours = beaconkv.load_model(tmp_path)
    g = torch.Generator().manual_seed(0)
    traces = [Trace(f"t{i}", torch.randint(3, 97, (n,), generator=g).tolist(),
                    torch.randint(3, 97, (120,), generator=g).tolist()) for i, n in enumerate((10, 25))]
    runs = study_runs(["beacon", "snapkv", "h2o", "streaming"], [32], 4, None, None)
    rule = GlobalQueryRule(8, 20.0)
    native = measure_fidelity(ours, traces, runs, 100, rule, progress=False, stack=False, packed=False)
    mine = measure_fidelity(hf, traces, runs, 100, rule, progress=False, backend="hf")
    assert len(native) == len(mine) == 4 * 3
    for a, b in zip(native, mine):
        diff = {k: (v, getattr(b, k)) for k, v in dataclasses.asdict(a).items() if not _same(v, getattr(b, k))}
        assert not diff, (a.policy, a.trace, diff)
    assert min(r.evictions for r in mine) >= 2


@pytest.fixture
def gpt_oss_checkpoint(tiny_checkpoint, tmp_path):
    """A tiny random gpt-oss checkpoint with the tiny word tokenizer: an architecture beaconkv's decoder lacks."""
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(tiny_config("gpt_oss"), attn_implementation="eager").float()
    model.save_pretrained(tmp_path / "gpt_oss")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_checkpoint / name, tmp_path / "gpt_oss" / name)
    return tmp_path / "gpt_oss"


def test_fidelity_backend_hf_runs_an_architecture_the_native_decoder_lacks(gpt_oss_checkpoint, tmp_path, capsys):
    out = tmp_path / "fid"
    rc = main(["fidelity", "--backend", "hf", "--model", str(gpt_oss_checkpoint), "--num-traces", "1", "--tokens", "48",
               "--budgets", "16", "--policies", "beacon,snapkv,h2o", "--n-recent", "2", "--attention-top-k", "8",
               "--global-threshold", "12", "--raw", "--out", str(out), "--no-progress", "--threads", "1"])
    assert rc == 0, capsys.readouterr().err
    rows = list(csv.DictReader((out / "fidelity.csv").open()))
    assert {r["policy"] for r in rows} == {"beacon", "snapkv", "h2o"}
    assert all(0.0 <= float(r["recall"]) <= 1.0 + 1e-6 and float(r["kl"]) >= -1e-6 for r in rows)
    assert all(float(r["evictions"]) >= 1 for r in rows)
    assert '"backend": "hf"' in (out / "run.json").read_text()


@pytest.mark.parametrize("option", [["--oracle"], ["--generate"], ["--kv-storage", "int8"], ["--exact"]])
def test_native_only_fidelity_options_are_refused(tiny_checkpoint, tmp_path, capsys, option):
    rc = main(["fidelity", "--backend", "hf", "--model", str(tiny_checkpoint), "--num-traces", "1", "--tokens", "8",
               "--budgets", "16", "--n-recent", "2", "--out", str(tmp_path / "never"), *option])
    err = capsys.readouterr().err
    assert rc == 2 and "--backend hf" in err and option[0] in err
