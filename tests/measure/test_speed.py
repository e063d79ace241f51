"""``beaconkv bench`` and Table 4: the run end to end on a tiny model, the bookkeeping of step windows,
memory and targets. Nothing here asserts on a timing."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re

import pytest
import torch

import beaconkv
from beaconkv.cli import build_parser, main
from beaconkv.measure.speed import cli as speed_cli
from beaconkv.measure.speed.cli import QUICK_COST, run_bench
from beaconkv.measure.speed.machine import (
    PeakMemory,
    kv_bytes_per_token,
    weight_bytes_per_step,
)
from beaconkv.models.random_weights import qwen3_4b_config
from beaconkv.measure.speed.table4 import (
    markdown_table4,
    measure_table4,
    smaller_batch,
)
from beaconkv.measure.speed.targets import evaluate_targets
from beaconkv.measure.speed.throughput import ThroughputRow
from beaconkv.measure.speed.timing import StepRecorder
from beaconkv.models.random_weights import random_model
from beaconkv.policies import BeaconKV


@pytest.fixture(scope="module")
def llama(tiny_models):
    return beaconkv.load_model(tiny_models["llama"][0])


#: Small explicit sizes (what ``--quick`` used before it went eager): every section compiled, with aot_eager.
SMALL_COMPILED = ["--dtypes", "fp32", "--batches", "1", "--new-tokens", "8", "--prompt-tokens", "16", "--repeats", "1",
                  "--budget", "128", "--contexts", "64,128", "--curve-window", "16", "--policies", "beacon,snapkv",
                  "--policy-cycles", "2", "--policy-dtype", "fp32"]


@pytest.mark.long
def test_small_compiled_bench_runs_end_to_end(tiny_models, tmp_path):
    argv = ["bench", *SMALL_COMPILED, "--model", str(tiny_models["llama"][0]), "--threads", "1", "--compile-backend",
            "aot_eager", "--no-transformers-compile", "--out", str(tmp_path)]
    args = build_parser().parse_args(argv)
    assert run_bench(args) == 0
    res = json.loads((tmp_path / "bench.json").read_text())
    impls = {r["impl"] for r in res["throughput"]}
    assert impls == {"beaconkv eager", "beaconkv compiled", "transformers eager"}
    assert all(not r["error"] and r["tokens_per_s"] > 0 and 0 < r["roofline"] for r in res["throughput"])
    assert [p["context"] for p in res["curve"]] == [64, 128]
    pol = {r["policy"]: r for r in res["policies"]}
    assert set(pol) == {"full", "beacon", "snapkv"}
    # budget 128 (an eviction every 16 steps), timed over 2 cycles after the first eviction
    assert pol["beacon"]["cache_capacity"] == 16 + 128 < pol["full"]["cache_capacity"] == 16 + 127 + 16 + 32 + 1
    assert pol["beacon"]["evictions"] == pol["beacon"]["compiled_evictions"] == 3 and pol["full"]["evictions"] == 0
    assert 0 < pol["beacon"]["eviction_share"] <= pol["beacon"]["policy_share"] < 1
    assert {t["name"].split(" (")[0] for t in res["targets"]} >= {"compiled / transformers eager tok/s"}
    assert (tmp_path / "cost_curve.png").stat().st_size > 0
    assert "| beaconkv compiled | fp32 | 1 |" in (tmp_path / "bench.md").read_text()


def test_byte_counts(llama):
    c = llama.config
    assert kv_bytes_per_token(c, torch.bfloat16) == c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * 2
    params = sum(p.nbytes for p in llama.parameters())  # untied: the embedding is only gathered
    emb = llama.model.embed_tokens.weight
    assert weight_bytes_per_step(llama, 3) == params - emb.nbytes + 3 * emb.shape[1] * 4


def test_peak_memory_sees_an_allocation():
    with PeakMemory("cpu") as mem:
        x = torch.ones(64 << 18)  # 64 MiB, touched
        x += 1
        del x
    assert mem.increase >= 48 << 20


def test_step_recorder_windows(llama):
    policy = BeaconKV(128)
    rec = StepRecorder(torch.device("cpu"))
    out = beaconkv.generate(llama, None, [[5, 6, 7]], max_new_tokens=150, eos_token_ids=[], policy=policy,
                            on_step=rec)
    assert set(vars(policy)) == {f.name for f in dataclasses.fields(BeaconKV)}  # nothing patched onto the policy
    assert len(rec.ends) == out.stats.decode_steps == 149
    durations, evictions, policy_s = rec.window(127)  # the hook of step 127 holds the first eviction
    assert len(durations) == len(evictions) == len(policy_s) == 149 - 127
    assert evictions[0] > 0 and sum(e > 0 for e in evictions) == out.stats.evictions[0] == 2
    assert all(p >= e for p, e in zip(policy_s, evictions))


def test_targets_are_checked_against_results():
    def row(impl, tps, roof):
        return vars(ThroughputRow(impl, "bf16", 1, 1e3 / tps, tps, 0, 1.0, roof, ""))

    res = {"throughput": [row("beaconkv compiled", 30.0, 0.5), row("transformers eager", 15.0, 0.2)],
           "curve": [{"context": 512, "full_ms": 1, "beacon_ms": 10.0, "full_capacity": 512, "beacon_capacity": 320},
                     {"context": 4096, "full_ms": 5, "beacon_ms": 12.0, "full_capacity": 4096, "beacon_capacity": 320}],
           "policies": [{"policy": "full", "budget": None, "ms_per_step": 9.0, "policy_ms": 0.0, "decode_ms": 9.0},
                        {"policy": "beacon", "budget": 256, "ms_per_step": 10.1, "policy_ms": 0.6, "decode_ms": 9.5},
                        {"policy": "snapkv", "budget": 256, "ms_per_step": 10.0, "policy_ms": 0.3, "decode_ms": 9.7},
                        {"policy": "rpc", "budget": 256, "ms_per_step": 8.85, "policy_ms": 0.05, "decode_ms": 8.8}]}
    got = {t.name.split(" (")[0]: (t.value, t.met) for t in evaluate_targets(res)}
    assert got["compiled / transformers eager tok/s"] == (2.0, True)
    assert got["compiled roofline ratio"] == (0.5, True)
    assert got["BeaconKV step time at 4096 / at 512"] == (pytest.approx(1.2), False)
    # the policies' own time on the median decode time of the evicting runs (9.5 ms): noise-free
    snap, rpc = got["BeaconKV / snapkv ms/step, eviction + maintenance included"], got[
        "BeaconKV / rpc ms/step, eviction + maintenance included"]
    assert snap == (pytest.approx(10.1 / 9.8), True) and rpc == (pytest.approx(10.1 / 9.55), False)


def test_qwen3_4b_shape_and_random_model():
    c = qwen3_4b_config()
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (
        36, 2560, 32, 8, 128)
    assert kv_bytes_per_token(c, torch.bfloat16) == 147456  # 144 KiB per token
    small = type(c)(**{**vars(c), "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 96,
                       "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 97})
    model = random_model(small, torch.bfloat16, "cpu")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    out = beaconkv.generate(model, None, [[5, 6, 7]], max_new_tokens=4, eos_token_ids=[])
    assert len(out.token_ids[0]) == 4


def test_table4_at_a_fixed_batch(llama):
    # the tiny model has 512 positions: a cache sized for 8 + 480 tokens
    rows = measure_table4(llama, budget=128, generation_tokens=480, memory_limit=1 << 30, prompt_tokens=8,
                          cycles=1, batch=2, log=lambda m: None)
    full, beacon = rows
    assert (full.policy, full.batch, full.cache_capacity) == ("full", 2, 8 + 480)
    assert (beacon.policy, beacon.cache_capacity, beacon.evictions) == ("beacon", 8 + 128, 2)
    assert beacon.kv_cache_bytes * (8 + 480) == full.kv_cache_bytes * (8 + 128)
    assert all(r.peak_bytes > 0 and r.tokens_per_s > 0 and not math.isnan(r.ms_per_step) for r in rows)
    text = markdown_table4({"model": "tiny", "dtype": "fp32", "generation_tokens": 512, "memory_limit_gib": 1.0,
                            "mode": "eager", "memory": "rss", "rows": [vars(r) for r in rows]})
    assert "| FullKV, fixed batch | 2 |" in text and "| BeaconKV (128), fixed batch | 2 |" in text


def test_over_limit_batch_is_scaled_to_the_measured_per_sequence_memory():
    MiB = 2**20
    # base 512 MiB, batch 16 peaked at 512 + 16 * 50 MiB: 50 MiB per sequence -> 10 fit in 1024 MiB
    assert smaller_batch({"peak_bytes": 1312 * MiB, "base_bytes": 512 * MiB, "batch": 16}, 1024 * MiB) == 10
    # always smaller than the batch that went over, never below 1
    assert smaller_batch({"peak_bytes": 1040 * MiB, "base_bytes": 0, "batch": 16}, 1024 * MiB) == 15
    assert smaller_batch({"peak_bytes": 3072 * MiB, "base_bytes": 900 * MiB, "batch": 2}, 1024 * MiB) == 1


def test_bench_with_a_missing_model_fails_in_one_line_before_measuring(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(speed_cli, "streaming_bandwidth", lambda *a, **k: pytest.fail("measured before checking"))
    out, missing = tmp_path / "out", tmp_path / "no-such-checkpoint"
    rc = main(["bench", "--quick", "--model", str(missing), "--out", str(out)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith("beaconkv bench: error: ") and str(missing) in lines[0] and "does not exist" in lines[0]
    assert not out.exists()


def test_quick_bench_runs_every_section_with_progress(tiny_models, tmp_path, capsys):
    from beaconkv.cli import show_compiles
    from beaconkv.execution.compile_log import compile_logger

    show_compiles()  # as the command does: the compile lines must still come as the bench's timed lines
    handlers = compile_logger.handlers[:]
    argv = ["bench", "--quick", "--model", str(tiny_models["llama"][0]), "--threads", "1", "--compile-backend",
            "aot_eager", "--out", str(tmp_path)]
    assert run_bench(build_parser().parse_args(argv)) == 0
    assert compile_logger.handlers == handlers  # given back
    res = json.loads((tmp_path / "bench.json").read_text())
    s = res["settings"]
    assert s["no_transformers_compile"] and s["eager_sections"] and s["budget"] == 32 and s["n_recent"] == 4
    assert {r["impl"] for r in res["throughput"]} == {"beaconkv eager", "beaconkv compiled", "transformers eager"}
    assert [p["context"] for p in res["curve"]] == [64, 96]
    pol = {r["policy"]: r for r in res["policies"]}
    assert set(pol) == {"full", "beacon", "snapkv"} and pol["beacon"]["cache_capacity"] == 16 + 32
    assert pol["beacon"]["evictions"] > 0 and pol["beacon"]["compiled_evictions"] == 0  # eager sections
    assert "--quick" in (tmp_path / "bench.md").read_text() and "eager" in (tmp_path / "bench.md").read_text()
    log = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "Loading weights" not in line]
    assert [line for line in log if not re.match(r"\[\s*\d+s\] ", line)] == [], "every line carries the elapsed time"
    assert any(re.match(r"\[\s*\d+s\] compiled the decode step .* in [\d.]+ s$", line) for line in log), log
    started = [line for line in log if line.endswith("…")]
    for what in ("beaconkv compiled", "BeaconKV(32) to 96 tokens", "context 64: FullKV", "beacon: 1 run(s)"):
        assert any(what in line for line in started), f"{what!r} is not announced before it runs"


def test_quick_help_states_its_measured_cost():
    help_text = " ".join(build_parser()._subparsers._group_actions[0].choices["bench"].format_help().split())
    assert QUICK_COST.split(" (")[0] in help_text


def test_bench_budget_too_small_for_n_recent_fails_before_measuring(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(speed_cli, "streaming_bandwidth", lambda *a, **k: pytest.fail("measured before checking"))
    rc = main(["bench", "--budget", "64", "--n-recent", "16", "--out", str(tmp_path / "out")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "budget=64" in lines[0] and "smaller n_recent" in lines[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("budget, n_recent", [(128, 16), (64, 8), (32, 4)])
def test_bench_n_recent_auto_is_what_each_policy_fits_to_the_budget(budget, n_recent):
    # the default --n-recent (auto): each policy's own n_recent, lowered where the budget leaves fewer slots
    args = build_parser().parse_args(["bench", "--budget", str(budget), "--policy-arg", "window=8"])
    kwargs = speed_cli._policy_kwargs(args, ["beacon", "snapkv"])
    assert kwargs == {"beacon": {"n_recent": n_recent}, "snapkv": {"window": 8, "n_recent": n_recent}}


# ------------------------------------------------------------------------------------------ engine
def test_engine_workload_follows_the_traces_and_fits_the_memory_limit():
    from beaconkv.measure.speed.engine_bench import slots_for, trace_lengths, workload_lengths

    lengths = workload_lengths(200, 32, 512)
    assert len(lengths) == 200 and min(lengths) >= 32 and max(lengths) <= 512
    base = sorted(trace_lengths())
    # the median request is the traces' median scaled to 512 / longest trace (jitter within +-20%)
    scaled = base[len(base) // 2] * 512 / base[-1]
    assert 0.6 * scaled <= sorted(lengths)[100] <= 1.4 * scaled
    assert slots_for(10_000, 100, 10, most=64) == 10 and slots_for(10_000, 100, 10, most=4) == 4
    assert slots_for(10, 100, 10, most=4) == 1


def test_engine_modes_serve_every_request_and_static_batches_idle(llama):
    from beaconkv.measure.speed.engine_bench import engine_targets, markdown_engine, run_engine_mode

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (5, 9, 7, 6, 8)]
    lengths = [3, 20, 4, 18, 5]
    rows = [run_engine_mode(llama, None, name, budget, prompts, lengths, 2, static, None)
            for name, budget in (("full", None), ("beacon", 8)) for static in (False, True)]
    for r in rows:
        assert (r.requests, r.new_tokens, r.slots) == (5, sum(lengths), 2)
        assert 0 < r.utilisation <= 1 and r.ttft_mean_s > 0 and r.tokens_per_s > 0
    engine, static = rows[0], rows[1]
    # a static batch waits for its longest request: slots idle while 3 and 4 tokens wait for 20
    assert engine.utilisation > static.utilisation
    assert rows[2].evictions > 0 and rows[0].evictions == 0
    ratios = engine_targets(rows)
    assert set(ratios) == {"engine / static (full)", "engine / static (beacon)",
                           "BeaconKV / FullKV (engine, equal memory)"}
    table = markdown_engine(rows, {"requests": 5, "lengths": lengths, "memory_limit_bytes": 2**20})
    assert table.count("\n| engine |") == 2 and "| static | beacon (8) | 2 |" in table


def test_engine_section_settings_fail_before_anything_loads(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(speed_cli, "streaming_bandwidth", lambda *a, **k: pytest.fail("measured before checking"))
    rc = main(["bench", "--sections", "engine", "--engine-min-new", "600", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--engine-min-new=600 exceeds --engine-max-new=512" in err[0]


def test_compile_section_child_measures_a_real_compiled_call(tiny_models, capsys):
    """One measured process of ``--sections compile``, in process: compile seconds apart from ms/step."""
    from beaconkv.measure.speed import compile_time

    spec = {"model": str(tiny_models["llama"][0]), "device": "cpu", "dtype": "fp32", "threads": 1,
            "prompt": list(range(3, 19)), "budget": 32, "tokens": 24, "backend": "aot_eager", "policy": "beacon", "shape": "layerwise",
            "run": "cold", "second": "snapkv"}
    assert compile_time._child([json.dumps(spec)]) == 0
    row = compile_time.CompileRow(**json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert row.run == "cold" and row.shape == "layerwise" and row.policy == "beacon" and row.second_policy == "snapkv"
    assert 0 < row.compile_s < row.first_call_s and row.ms_per_step > 0 and row.second_compile_s > 0
    assert 0 < row.decode_compile_s < row.compile_s  # beacon's eviction and query sampling compiled too


def test_compile_section_runs_cold_rerun_then_alternating_speed_runs(monkeypatch):
    from beaconkv.measure.speed import compile_time

    seen: list[tuple[str, str, str | None, str]] = []

    def fake_measure(spec, cache_dir):
        seen.append((spec["run"], spec["shape"], spec.get("second"), cache_dir))
        compile_s = {"cold": 30.0, "rerun": 5.0, "speed": 4.0}[spec["run"]]
        ms = 50.0 + len(seen) + (10 if spec["shape"] == "whole" else 0)
        return compile_time.CompileRow(spec["run"], spec["shape"], spec["policy"], compile_s, compile_s + 3, ms,
                                       spec.get("second"), 12.0 if spec.get("second") else None, compile_s / 2)

    monkeypatch.setattr(compile_time, "_measure", fake_measure)
    args = argparse.Namespace(compile_policies="beacon,snapkv", compile_shapes="layerwise,whole", compile_budget=64,
                              compile_tokens=96, compile_repeats=2, threads=2, compile_backend="inductor")
    result = compile_time.run_compile_section(args, None, "cpu", "bf16", "p", lambda _: None)
    runs = [(r, s) for r, s, _, _ in seen]
    assert runs == [("cold", "layerwise"), ("rerun", "layerwise"), ("cold", "whole"), ("rerun", "whole"),
                    ("speed", "layerwise"), ("speed", "whole"), ("speed", "layerwise"), ("speed", "whole")]
    caches = {s: {c for _, s2, _, c in seen if s2 == s} for s in ("layerwise", "whole")}
    assert all(len(c) == 1 for c in caches.values()) and caches["layerwise"] != caches["whole"]
    assert [x[2] for x in seen if x[0] == "cold"] == ["snapkv", "snapkv"]
    lw = result["summary"]["layerwise"]
    assert lw["first_compile_s"] == 30.0 and lw["rerun_compile_s"] == 5.0 and lw["second_policy_compile_s"] == 12.0
    assert lw["speed_runs"] == 4 and lw["ms_per_step_min"] == 51.0
    table = compile_time.markdown_compile(result)
    assert "| layerwise | 30.0 (15.0) | 33.0 | 12.0 | 5.0 |" in table and "| whole |" in table


def test_engine_bench_raises_when_its_requests_fail(llama, monkeypatch):
    """A failed decode step ends its requests with ``finish_reason="error"`` in the engine; the benchmark must
    report that error, not a row of 0 tok/s (on the GPU check a failing compile once became a division by 0)."""
    from beaconkv.measure.speed.engine_bench import run_engine_mode
    from beaconkv.session import Session

    def broken_step(self, *args, **kwargs):
        raise ValueError("the step broke")

    monkeypatch.setattr(Session, "step", broken_step)
    with pytest.raises(RuntimeError, match="a benchmark request failed: .*the step broke") as info:
        run_engine_mode(llama, None, "beacon", 8, [[5, 6, 7]], [4], 1, False, None)
    assert isinstance(info.value.__cause__, ValueError)


def test_compile_shapes_include_layer_blocks():
    from beaconkv.execution import CompileConfig
    from beaconkv.measure.speed.compile_time import shape_config

    assert shape_config("layerwise-5") == {"layerwise": True, "layer_block": 5}
    config = CompileConfig(**shape_config("layerwise-5"))
    assert config.decode_shape(torch.device("cpu")) == "layers" and config.block_size(30) == 5
    assert config.block_size(36) == 4  # the largest divisor of the layer count up to 5: every block one graph
    assert shape_config("whole") == {"layerwise": False}
    assert shape_config("layerwise-1@wrapper") == {"layerwise": True, "layer_block": 1, "direct_calls": False}
    assert CompileConfig(**shape_config("whole@wrapper")) == CompileConfig(layerwise=False, direct_calls=False)
    for bad in ("layerwise-0", "layerwise-x", "wholestep", "whole@", "@wrapper"):
        with pytest.raises(ValueError, match=f"unknown shape '{bad}'.*layerwise-N"):
            shape_config(bad)


def test_graph_decode_compiles_each_named_shape_and_refuses_an_unknown_one(capsys):
    from beaconkv.execution import CompileConfig
    from beaconkv.measure.speed import graph_decode
    from beaconkv.measure.speed.compile_time import shape_compile_config

    configs = {shape: shape_compile_config(shape, "aot_eager") for shape in ("regions", "whole")}
    assert configs["whole"] == CompileConfig(backend="aot_eager", layerwise=False)
    cuda = torch.device("cuda")  # the shape a GPU would run: no CUDA device needed to ask
    assert configs["regions"].decode_shape(cuda) == "regions" and configs["regions"].cuda_graphs(cuda) is False
    assert CompileConfig(regions=True).decode_shape(cuda) == "regions" and CompileConfig(regions=True).cuda_graphs(cuda)
    assert configs["whole"].decode_shape(cuda) == "whole"
    with pytest.raises(SystemExit):
        graph_decode.main(["--compile-shapes", "regions,wholestep"])
    assert "unknown shape 'wholestep'" in capsys.readouterr().err
