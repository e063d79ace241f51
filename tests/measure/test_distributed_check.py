"""The tensor-parallel device check: it says it skipped where the GPUs are too few, and passes on the CPU."""

from __future__ import annotations

import pytest
import torch

import beaconkv
from beaconkv.measure import distributed_check as check

pytestmark = pytest.mark.usefixtures("one_thread")


def test_check_says_it_skipped_with_fewer_gpus_than_ranks(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert check.main(["--device", "cuda", "--ranks", "2"]) == 0
    assert capsys.readouterr().out.startswith("tensor parallelism: skipped (1 GPU(s) here, 2 needed for NCCL")


def test_random_checkpoint_loads_back(tmp_path):
    path = check.save_random_checkpoint(check.CHECK_CONFIG, tmp_path, seed=3)
    model = beaconkv.load_model(path)
    assert model.config == check.CHECK_CONFIG
    want = beaconkv.models.random_weights.random_model(check.CHECK_CONFIG, torch.float32, "cpu", 3)
    assert torch.equal(model.model.layers[1].mlp.up_proj.weight, 10 * want.model.layers[1].mlp.up_proj.weight)
    assert torch.equal(model.model.norm.weight, want.model.norm.weight)


@pytest.mark.long
def test_check_passes_on_the_cpu(capsys):
    assert check.main(["--device", "cpu", "--ranks", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("tokens equal, kept positions equal") == 3 and out.rstrip().endswith("passed")
