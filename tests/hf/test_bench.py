"""The ``hf`` section of ``beaconkv bench``: it runs its three backends and tells their speed and KV memory."""

from __future__ import annotations

import pytest

import beaconkv
from beaconkv.cli import build_parser
from beaconkv.measure.speed.hf_bench import markdown_hf, measure_hf
from beaconkv.measure.speed.throughput import load_hf_model

tf = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_hf_section_measures_three_backends(tiny_checkpoint):
    import torch

    model = load_hf_model(tiny_checkpoint, torch.float32, torch.device("cpu"))
    native = beaconkv.load_model(tiny_checkpoint)
    rows = measure_hf(model, native, [200], [1, 2], budget=128, prompt_tokens=16, log=lambda _: None)
    assert [(r.backend, r.batch) for r in rows] == [(b, n) for n in (1, 2) for b in
                                                    ("hf DynamicCache", "hf PolicyCache", "beaconkv native")]
    assert all(r.tokens_per_s > 0 and r.kv_mib > 0 for r in rows)
    by = {(r.backend, r.batch): r for r in rows}
    for batch in (1, 2):
        policy, dynamic = by["hf PolicyCache", batch], by["hf DynamicCache", batch]
        assert policy.kv_mib < dynamic.kv_mib and policy.evictions > 0 and dynamic.evictions == 0
        assert policy.kv_mib == pytest.approx(by["beaconkv native", batch].kv_mib)  # same slots, same dtype
    table = markdown_hf(rows, 128)
    assert "| 200 | 2 | hf PolicyCache |" in table and "1.00x" in table


def test_bench_takes_the_hf_section():
    args = build_parser().parse_args(["bench", "--sections", "hf", "--hf-tokens", "1024", "--hf-batches", "1,8",
                                      "--hf-budget", "256"])
    assert args.sections == ["hf"] and args.hf_tokens == "1024" and args.hf_budget == 256
