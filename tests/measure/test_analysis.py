"""Trace analysis: helpers on constructed inputs, the recorded quantities on a tiny model, and the CLI end to end."""

from __future__ import annotations

import argparse
import csv

import pytest
import torch

import beaconkv
from beaconkv.measure.analysis import (
    TraceAnalysis,
    add_analyze_arguments,
    analyze_trace,
    clustering_stats,
    distance_bin,
    mixed_head,
    parse_window,
    run_analyze,
)
from beaconkv.measure.fidelity import FidelityError, GlobalQueryRule, LengthAwareRule, Trace
from beaconkv.policies import make_policy


def test_distance_bins_are_log2():
    assert distance_bin(torch.tensor([0, 1, 2, 3, 4, 7, 8, 200])).tolist() == [0, 1, 2, 2, 3, 3, 4, 8]


def test_window_parsing_and_errors():
    assert parse_window(None, 1000) == (744, 1000)
    assert parse_window(None, 100) == (0, 100)
    assert parse_window("10:50", 100) == (10, 50)
    assert parse_window(":20", 100) == (0, 20)
    assert parse_window("90:", 100) == (90, 100)
    with pytest.raises(FidelityError, match="START:END"):
        parse_window("10-20", 100)
    with pytest.raises(FidelityError, match="widen"):
        parse_window("99:", 100)


@pytest.fixture(scope="module")
def llama(tiny_models):
    return beaconkv.load_model(tiny_models["llama"][0])


def test_analysis_records_every_query_and_the_beacons_held(llama):
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 97, (12,), generator=g).tolist()
    output = torch.randint(3, 97, (48,), generator=g).tolist()
    trace = Trace("t", prompt, output)
    spec = make_policy("beacon", 16, n_beacon=2, n_recent=2)
    la = LengthAwareRule(top_k=4, fraction=0.1, recent=4, mass=0.3)
    a = analyze_trace(llama, trace, 48, GlobalQueryRule(top_k=4, threshold=6.0), spec, progress=False, sparse_rule=la)
    cfg = llama.config
    shape = (48, cfg.num_hidden_layers, cfg.num_attention_heads)
    assert a.distance.shape == a.is_global.shape == a.recall.shape == shape
    assert torch.equal(a.is_global, a.distance > 6.0)
    assert 0 < int(a.is_global.sum()) < a.is_global.numel()
    assert bool((a.recall <= 1 + 1e-5).all()) and bool((a.recall[:4] > 1 - 1e-5).all())  # nothing evicted yet
    assert float(a.recall.min()) < 1.0  # BeaconKV evicted by the end
    # the mass histogram holds one unit of attention per query
    assert float(a.mass_by_distance.sum()) == pytest.approx(a.is_global.numel(), rel=1e-4)
    # pre-RoPE queries of every position were kept, and beacons were recorded
    assert a.queries.shape[2] == 12 + 48 and bool(a.queries[:, :, -1].abs().sum() > 0)
    assert a.held_query_pos.shape[-1] == 2 and bool(a.frozen.any()) and not bool(a.frozen.all())
    assert not torch.isnan(a.beacon_cos).all()
    assert a.is_global_la.shape == shape
    position = (12 + torch.arange(48)).view(48, 1, 1).expand(shape)
    assert 0 < int(a.is_global_la.sum()) < a.is_global_la.numel()
    assert bool((a.distance[a.is_global_la] > 0.1 * (position[a.is_global_la] + 1)).all())  # far, relative to t
    n_g = a.is_global.sum(0)
    balance = torch.minimum(n_g, 48 - n_g)
    layer, head = mixed_head(a, (0, 48))
    assert balance[layer, head] == balance.max()


def test_analyze_cli_runs_end_to_end_on_a_short_real_trace(tmp_path, capsys):
    parser = add_analyze_arguments(argparse.ArgumentParser())
    out = tmp_path / "an"
    args = parser.parse_args([
        "--tokens", "24", "--budget", "16", "--attention-top-k", "8", "--global-threshold", "20", "--window", "4:24",
        "--out", str(out), "--no-progress", "--threads", "1",
    ])
    assert run_analyze(args) == 0
    for name in ("attention_distance.png", "global_heatmap.png", "query_similarity.png", "beacons.png", "summary.txt"):
        assert (out / name).stat().st_size > 0
    rows = list(csv.DictReader((out / "global_queries.csv").open()))
    assert rows and {r["phase"] for r in rows} <= {"frozen", "accumulating"}
    assert all(float(r["mean_distance"]) > 20 for r in rows)
    text = capsys.readouterr().out
    assert "global queries:" in text and "BeaconKV(budget=16" in text


def test_analyze_cli_reports_bad_values(tmp_path, capsys):
    from beaconkv.cli import main

    assert main(["analyze", "--tokens", "40", "--layer", "99", "--out", str(tmp_path)]) == 2
    assert "beaconkv analyze: error: --layer=99" in capsys.readouterr().err
    assert main(["analyze", "--low-sim-quantile", "0", "--out", str(tmp_path)]) == 2
    assert "beaconkv analyze: error: --low-sim-quantile=0" in capsys.readouterr().err


def _analysis_with_queries(queries, is_global):
    """A TraceAnalysis holding given pre-RoPE queries (L, H, W, D) for W steps and a prompt of 0 tokens."""
    W = queries.shape[2]
    L, H = queries.shape[:2]
    z = torch.zeros(W, L, H)
    return TraceAnalysis(trace="t", prompt_len=0, rule=GlobalQueryRule(), policy="p", distance=z,
                         is_global=is_global, is_global_la=is_global, recall=z, prompt_mass=z, beacon_cos=z,
                         mass_by_distance=torch.zeros(2, 4), queries=queries, held_query_pos=torch.zeros(W, L, H, 0),
                         frozen=torch.zeros(W, dtype=torch.bool))


def test_clustering_finds_clustered_global_queries_and_no_lift_for_random_classes():
    g = torch.Generator().manual_seed(0)
    W, D = 200, 16
    is_global = (torch.rand(W, 1, 1, generator=g) < 0.3)
    centre_g, centre_l = torch.randn(D, generator=g), torch.randn(D, generator=g)
    q = torch.where(is_global.view(W, 1), centre_g, centre_l) + 0.3 * torch.randn(W, D, generator=g)
    a = _analysis_with_queries(q.view(1, 1, W, D), is_global)
    c = clustering_stats(a, (0, W))
    assert c["heads"] == 1 and c["purity"] == pytest.approx(1.0)
    n_g = int(is_global.sum())
    assert c["base"] == pytest.approx((n_g - 1) / (W - 1), abs=0.02)  # about the global share
    # classes that come in runs over adjacent, similar queries: a cluster only at gap 1
    t = torch.arange(W, dtype=torch.float32)
    drift = torch.randn(D, generator=g) + 0.15 * torch.randn(W, D, generator=g).cumsum(0)  # a random walk
    runs = ((t // 10) % 3 == 0).view(W, 1, 1)  # global in runs of 10 steps
    walk = _analysis_with_queries(drift.view(1, 1, W, D), runs)
    assert clustering_stats(walk, (0, W), min_gap=1)["lift"] > 2.0
    assert clustering_stats(walk, (0, W), min_gap=20)["lift"] < 1.3
    with pytest.raises(FidelityError, match="min_gap"):
        clustering_stats(walk, (0, W), min_gap=0)
    assert c["lift"] > 2.5 and c["global-global"] > c["global-local"] < c["local-local"]
    # classes drawn independently of the queries: no clustering beyond chance
    shuffled = torch.rand(W, 1, 1, generator=g) < 0.3
    iso = _analysis_with_queries(torch.randn(1, 1, W, D, generator=g), shuffled)
    r = clustering_stats(iso, (0, W))
    assert 0.4 < r["lift"] < 1.6 and abs(r["global-global"] - r["global-local"]) < 0.05
