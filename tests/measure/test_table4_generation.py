"""Table 4 over a whole generation (:mod:`beaconkv.measure.speed.table4_generation`): rows, the prediction beside
the measured peak, and the largest batch; on a CUDA device the real peak and the recorded CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from beaconkv.execution import CompileConfig
from beaconkv.measure.speed.table4_generation import (
    PEAK_TOLERANCE,
    Deadline,
    Table4Setting,
    compare_peak,
    make_table4_policy,
    markdown_table4_generation,
    measure_policy,
)

SETTING = Table4Setting(batch=2, new_tokens=96, prompt=8, budget=32, window=2)


def test_the_peak_is_flagged_past_the_tolerance():
    assert compare_peak(None, 100) == (None, False)
    assert compare_peak(105, 100) == (pytest.approx(0.05), False)
    error, flagged = compare_peak(89, 100)
    assert error == pytest.approx(-0.11) and flagged and PEAK_TOLERANCE == 0.10


def test_beacon_protects_the_prompt_explicitly_and_fullkv_is_fullkv():
    beacon = make_table4_policy("beacon", SETTING)
    assert beacon.n_prefix == SETTING.prompt and beacon.budget == 32 and beacon.n_recent < 16  # scaled below 128
    assert not make_table4_policy("full", SETTING).evicts


def test_a_deadline_without_a_moment_never_runs_out():
    assert Deadline(None).fits(1e9) and Deadline(None).left() == float("inf")
    assert Deadline(50.0, lambda: 60.0).left() == 0.0
    assert Deadline(100.0, lambda: 40.0).skipped(75) == "skipped: would need ~75 s, 60 s left"
    assert Deadline(100.0, lambda: 99.0).skipped(2.25) == "skipped: would need ~2.2 s, 1 s left"


@pytest.mark.parametrize("name", ["full", "beacon"])
def test_a_row_has_its_fills_its_evictions_and_the_prediction(llama, name):
    row = measure_policy(llama, name, 2, SETTING, "batch 2", CompileConfig(strategy="graphs", recorder="op_replay"))
    assert row.executor == "GraphExecutor" and row.tokens_per_s > 0 and row.predicted_peak_bytes > row.kv_cache_bytes
    if name == "full":
        # after the prompt and the three warm-up steps, then each fill and one step
        assert list(row.ms_per_step) == [11, 41, 73, 101] and row.evictions == 0 and row.eviction_ms is None
        assert row.cache_capacity == 8 + 96
    else:
        kept = make_table4_policy("beacon", SETTING).schedule.keep(make_table4_policy("beacon", SETTING), 32, 0)
        assert list(row.ms_per_step)[0] == 8 + kept and row.evictions > 0 and row.eviction_ms >= 0
    text = markdown_table4_generation({"model": "tiny", "dtype": "float32", "device": "cpu",
                                       "setting": {"batch": 2, "prompt": 8, "new_tokens": 96},
                                       "rows": [row.__dict__], "skipped": [{"part": "beacon [largest batch]",
                                                                           "why": "no device memory given"}]})
    assert f"| {'FullKV' if name == 'full' else 'BeaconKV (32)'}, batch 2 | 2 | — |" in text
    assert "beacon [largest batch]: skipped (no device memory given)" in text


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_on_cuda_the_peak_is_measured_and_near_the_prediction(tiny_models):
    import beaconkv

    model = beaconkv.load_model(tiny_models["llama"][0], device="cuda", dtype=torch.bfloat16)
    row = measure_policy(model, "beacon", 4, SETTING, "batch 4", True)
    assert row.executor == "GraphExecutor" and row.peak_bytes is not None and row.peak_bytes > row.kv_cache_bytes
    assert row.peak_error is not None
