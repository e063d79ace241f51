"""Fidelity metrics on constructed cases with known answers, the lock-step runner, and the CLI end to end."""

from __future__ import annotations

import argparse
import csv
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import beaconkv
from beaconkv.cli import main
from beaconkv.measure.fidelity import (
    FidelityError,
    GlobalQueryRule,
    LengthAwareRule,
    LockStep,
    Run,
    Trace,
    attention_distance,
    auto_n_recent,
    forced_tokens,
    held_attention_mass,
    held_attention_masses,
    kl_divergence,
    measure_fidelity,
    study_runs,
)
from beaconkv.measure.fidelity.cli import add_fidelity_arguments, run_fidelity
from beaconkv.policies import make_policy

# ------------------------------------------------------------------------------ metrics


def test_kl_is_zero_for_equal_logits_and_matches_a_hand_computed_value():
    x = torch.randn(4, 11)
    assert torch.allclose(kl_divergence(x, x), torch.zeros(4), atol=1e-6)
    p, q = torch.tensor([0.5, 0.5]).log(), torch.tensor([0.9, 0.1]).log()
    expected = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert kl_divergence(p, q).item() == pytest.approx(expected, rel=1e-5)
    assert kl_divergence(p + 3.0, q - 1.0).item() == pytest.approx(expected, rel=1e-5)  # logits, not probabilities


def test_held_mass_is_one_when_everything_is_held():
    w = torch.randn(2, 3, 4, 10).softmax(-1)  # (batch, kv, group, C)
    pos = torch.arange(10).expand(2, 3, 10)
    assert torch.allclose(held_attention_mass(w, pos, pos), torch.ones(2, 3, 4))
    # the same set in another slot order, padded with empty slots
    shuffled = torch.cat([pos.flip(-1), torch.full((2, 3, 5), -1)], -1)
    assert torch.allclose(held_attention_mass(w, pos, shuffled), torch.ones(2, 3, 4))


def test_evicting_a_known_token_loses_exactly_its_attention_mass():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1, 2, 3, 8, generator=g).softmax(-1)
    key_pos = torch.arange(8).expand(1, 2, 8)
    # head 0 evicts position 5, head 1 evicts positions 0 and 7; empty slots at the end
    held = torch.tensor([[[0, 1, 2, 3, 4, 6, 7, -1], [1, 2, 3, 4, 5, 6, -1, -1]]])
    got = held_attention_mass(w, key_pos, held)
    assert torch.allclose(got[0, 0], 1 - w[0, 0, :, 5])
    assert torch.allclose(got[0, 1], 1 - w[0, 1, :, 0] - w[0, 1, :, 7])


def test_held_mass_ignores_empty_reference_slots_and_follows_positions_not_slots():
    w = torch.tensor([[[[0.2, 0.3, 0.5, 0.0]]]])  # slot 3 empty
    key_pos = torch.tensor([[[10, 4, 7, -1]]])  # slots hold positions 10, 4, 7
    held = torch.tensor([[[4, 10, -1]]])
    assert held_attention_mass(w, key_pos, held).item() == pytest.approx(0.5)


def _brute_force_held_mass(w, key_pos, held):
    """sum of w over reference slots whose position is in ``held`` (python sets, no tensor tricks)."""
    out = torch.zeros(w.shape[:-1], dtype=torch.float64)
    for idx in torch.cartesian_prod(*[torch.arange(n) for n in key_pos.shape[:-1]]).view(-1, key_pos.dim() - 1):
        i = tuple(idx.tolist())
        kept = {int(p) for p in held[i] if p >= 0}
        on = torch.tensor([int(p) >= 0 and int(p) in kept for p in key_pos[i]], dtype=torch.float64)
        out[i] = (w[i].double() * on).sum(-1)
    return out


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), capacity=st.integers(1, 40), widths=st.lists(st.integers(1, 30), min_size=1, max_size=4),
       spread=st.integers(0, 60))
def test_held_masses_of_several_caches_equal_a_brute_force_per_cache(seed, capacity, widths, spread):
    g = torch.Generator().manual_seed(seed)
    lead = (2, 3)  # (batch, kv)
    w = torch.rand(*lead, 4, capacity, generator=g)  # not normalised: the sum itself is compared
    # reference positions: distinct per row, in any slot order, some slots empty, positions may exceed C
    key_pos = torch.stack([torch.randperm(capacity + spread, generator=g)[:capacity] for _ in range(6)]).view(*lead, capacity)
    key_pos = torch.where(torch.rand(*lead, capacity, generator=g) < 0.2, -1, key_pos)
    held = [torch.randint(-1, capacity + spread, (*lead, c), generator=g) for c in widths]  # repeats and -1 allowed
    got = held_attention_masses(w, key_pos, held)
    assert got.shape == (len(held), *lead, 4)
    for r, h in enumerate(held):
        torch.testing.assert_close(got[r].double(), _brute_force_held_mass(w, key_pos, h), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(held_attention_mass(w, key_pos, h), got[r])
    bound = capacity + spread + 5  # any upper bound on the positions gives the same answer
    torch.testing.assert_close(held_attention_masses(w, key_pos, held, n_positions=bound), got)


def test_held_masses_need_a_cache():
    with pytest.raises(ValueError, match="held_pos is empty"):
        held_attention_masses(torch.ones(1, 1, 2), torch.zeros(1, 2, dtype=torch.long), [])


def test_shared_distance_gives_the_same_classes_as_computing_it_per_rule():
    g = torch.Generator().manual_seed(1)
    w = torch.rand(3, 2, 4, 50, generator=g).softmax(-1)
    key_pos = torch.arange(50).expand(3, 2, 50)
    qpos, plen = torch.tensor(60).view(1, 1), torch.tensor(5).view(1, 1)
    dist = attention_distance(w, key_pos, qpos, top_k=8)
    rule = GlobalQueryRule(top_k=8, threshold=float(dist.median()))  # a mix of both classes
    la = LengthAwareRule(top_k=8, fraction=0.55, recent=4, mass=0.3)
    assert torch.equal(rule.is_global(w, key_pos, qpos, distance=dist), rule.is_global(w, key_pos, qpos))
    assert torch.equal(la.is_global(w, key_pos, qpos, plen, distance=dist), la.is_global(w, key_pos, qpos, plen))
    for mask in (rule.is_global(w, key_pos, qpos), la.is_global(w, key_pos, qpos, plen)):
        assert mask.any() and not mask.all()


def test_attention_distance_averages_the_top_k_keys():
    # query at position 20; weights peak on positions 19 and 4, then 0
    key_pos = torch.tensor([[0, 4, 10, 19, -1]])
    w = torch.tensor([[[0.1, 0.3, 0.05, 0.55, 0.0]]])
    assert attention_distance(w, key_pos, torch.tensor([20]), top_k=1).item() == pytest.approx(1.0)
    assert attention_distance(w, key_pos, torch.tensor([20]), top_k=2).item() == pytest.approx((1 + 16) / 2)
    # more than the filled slots: the empty slot never counts
    assert attention_distance(w, key_pos, torch.tensor([20]), top_k=10).item() == pytest.approx((20 + 16 + 10 + 1) / 4)
    rule = GlobalQueryRule(top_k=2, threshold=8.0)
    assert rule.is_global(w, key_pos, torch.tensor([20])).item()
    assert not GlobalQueryRule(top_k=1, threshold=8.0).is_global(w, key_pos, torch.tensor([20])).item()


def test_bad_settings_name_the_value():
    with pytest.raises(FidelityError, match="top_k=0"):
        GlobalQueryRule(top_k=0)
    with pytest.raises(FidelityError, match="threshold=-1"):
        GlobalQueryRule(threshold=-1)
    with pytest.raises(FidelityError, match="n_recent"):
        study_runs(["beacon"], [64], n_recent=16)
    with pytest.raises(FidelityError, match="nope"):
        study_runs(["nope"], [64])
    with pytest.raises(FidelityError, match="only 3 output tokens"):
        forced_tokens([Trace("t", [1, 2], [5, 6, 7])], 4)


def test_n_beacon_as_a_multiple_of_n_recent():
    runs = study_runs(["beacon_mean", "snapkv"], [64, 128], n_beacon="8x")
    assert [(r.name, r.policy.budget, r.policy.n_recent, getattr(r.policy, "n_beacon", None)) for r in runs] == [
        ("beacon_mean", 64, 8, 64), ("beacon_mean", 128, 16, 128), ("snapkv", 64, 8, None), ("snapkv", 128, 16, None)]
    for bad in ("x8", "8y", "-1x"):
        with pytest.raises(FidelityError, match="multiple of n_recent"):
            study_runs(["beacon"], [64], n_beacon=bad)
    parser = add_fidelity_arguments(argparse.ArgumentParser())
    assert parser.parse_args(["--n-beacon", "8X"]).n_beacon == "8x"
    assert parser.parse_args(["--n-beacon", "12"]).n_beacon == 12 and parser.parse_args([]).n_beacon is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--n-beacon", "ax"])


def test_auto_n_recent_scales_small_budgets():
    assert [auto_n_recent(b) for b in (64, 96, 128, 256, 512)] == [8, 12, 16, 16, 16]
    runs = study_runs(["beacon", "snapkv", "full"], [64, 128])
    assert [(r.name, r.policy.budget, r.policy.n_recent, getattr(r.policy, "n_beacon", None)) for r in runs] == [
        ("beacon", 64, 8, 8), ("beacon", 128, 16, 16), ("snapkv", 64, 8, None), ("snapkv", 128, 16, None)]


# ---------------------------------------------------------------------------- lock-step


@pytest.fixture(scope="module")
def llama(tiny_models):
    return beaconkv.load_model(tiny_models["llama"][0])


def _streams(n_tokens=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 97, (L,), generator=g).tolist() for L in (9, 14)]
    tokens = torch.randint(3, 97, (2, n_tokens), generator=g)
    return prompts, tokens


def _policies():
    return [make_policy("beacon", 16, n_recent=2, n_beacon=2), make_policy("h2o", 16, n_recent=2),
            make_policy("streaming", 24, n_recent=3, n_sink=2)]


def test_reference_logits_equal_a_plain_forward_over_the_forced_sequence(llama):
    prompts, tokens = _streams()
    run = LockStep(llama, _policies(), prompts, tokens.shape[1])
    first = run.prefill()
    steps = [run.step(tokens[:, s]) for s in range(tokens.shape[1])]
    for b, p in enumerate(prompts):
        full = torch.tensor(p + tokens[b].tolist())[None]
        plain = llama(full)[0]  # (seq, vocab)
        L = len(p)
        torch.testing.assert_close(first[0, b], plain[L - 1], atol=1e-4, rtol=1e-4)
        for s, out in enumerate(steps):
            torch.testing.assert_close(out.logits[0, b], plain[L + s], atol=1e-4, rtol=1e-4)
            assert int(out.query_pos[b]) == L + s


def test_stacked_runs_equal_one_decode_step_call_per_run(llama):
    prompts, tokens = _streams()
    a = LockStep(llama, _policies(), prompts, tokens.shape[1], stack=True)
    b = LockStep(llama, _policies(), prompts, tokens.shape[1], stack=False)
    torch.testing.assert_close(a.prefill(), b.prefill())
    evicted = False
    for s in range(tokens.shape[1]):
        x, y = a.step(tokens[:, s]), b.step(tokens[:, s])
        torch.testing.assert_close(x.logits, y.logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(x.weights, y.weights, atol=1e-5, rtol=1e-4)
        for hx, hy in zip(x.held_pos, y.held_pos):
            assert torch.equal(hx, hy)
        # the reference slots are cut at the longest sequence's length: nothing attended is cut off
        assert x.weights.shape[-1] == x.key_pos.shape[-1] == max(len(p) for p in prompts) + s + 1
        evicted |= any(bool((h < 0).any()) for h in x.held_pos)
    assert all(sum(s.state.stats.evictions) > 0 for s in a.sessions[1:])
    assert [s.state.stats.evictions for s in a.sessions] == [s.state.stats.evictions for s in b.sessions]


def test_a_policy_that_keeps_everything_has_kl_zero_and_recall_one(llama):
    prompts, tokens = _streams(24)
    traces = [Trace(f"t{b}", p, tokens[b].tolist()) for b, p in enumerate(prompts)]
    runs = [Run("full", make_policy("full")), Run("beacon", make_policy("beacon", 10**4, n_beacon=2, n_recent=2)),
            Run("streaming", make_policy("streaming", 8, n_recent=1, n_sink=1))]
    rows = measure_fidelity(llama, traces, runs, 24, GlobalQueryRule(top_k=4, threshold=5.0), progress=False)
    pooled = {r.policy: r for r in rows if r.trace == "all"}
    for name in ("full", "beacon"):  # beacon's budget is never reached
        r = pooled[name]
        assert r.kl == pytest.approx(0.0, abs=1e-6)  # SDPA vs the reference's explicit softmax: rounding only
        assert r.top1 == 1.0 and r.recall == pytest.approx(1.0) and r.recall_global == pytest.approx(1.0)
        assert r.evictions == 0
    s = pooled["streaming"]
    assert s.evictions > 0 and s.kl > 1e-6 and s.recall < 1.0
    assert 0 < s.n_global < s.n_queries == 24 * 2 * llama.config.num_hidden_layers * llama.config.num_attention_heads
    per_trace = [r for r in rows if r.policy == "streaming" and r.trace != "all"]
    assert sum(r.steps for r in per_trace) == s.steps == 48
    assert sum(r.n_global for r in per_trace) == s.n_global


# --------------------------------------------------------------------------------- CLI


def test_cli_runs_end_to_end_on_short_real_traces(tmp_path, capsys):
    parser = add_fidelity_arguments(argparse.ArgumentParser())
    out = tmp_path / "fid"
    args = parser.parse_args([
        "--num-traces", "2", "--tokens", "16", "--budgets", "8,16", "--policies", "beacon,snapkv",
        "--attention-top-k", "8", "--global-threshold", "12", "--out", str(out), "--no-progress", "--threads", "1",
        "--oracle",
    ])
    assert run_fidelity(args) == 0
    rows = list(csv.DictReader((out / "fidelity.csv").open()))
    assert len(rows) == 6 * 3  # (2 policies + the oracle) x 2 budgets x (all + 2 traces)
    assert {r["budget"] for r in rows if r["policy"] == "oracle"} == {"8", "16"}
    assert {r["n_recent"] for r in rows} == {"1", "2"}
    assert all(0.0 <= float(r["recall"]) <= 1.0 + 1e-6 and float(r["kl"]) >= -1e-6 for r in rows)
    for name in ("fidelity.md", "fidelity.png", "fidelity_kl.png", "fidelity_recall_global.png", "run.json"):
        assert (out / name).stat().st_size > 0
    assert "| beacon | 8 | 1 / 1 |" in capsys.readouterr().out


def test_cli_reports_bad_values(tmp_path, capsys):
    out = tmp_path / "never"
    assert main(["fidelity", "--budgets", "64", "--n-recent", "16", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("beaconkv fidelity: error:") and "budget=64" in err and len(err.splitlines()) == 1
    assert main(["fidelity", "--trace-ids", "nope", "--out", str(out)]) == 2
    assert "trace id(s) ['nope'] not found" in capsys.readouterr().err
    assert not out.exists()  # no empty output folder
