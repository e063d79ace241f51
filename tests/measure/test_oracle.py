"""The hindsight oracle: the recorded future attention adds up, and the oracle out-recalls real policies."""

from __future__ import annotations

import pytest
import torch

import beaconkv
from beaconkv.measure.fidelity import FidelityError, GlobalQueryRule, Run, Trace, measure_fidelity
from beaconkv.measure.fidelity.oracle import FutureAttentionOracle, oracle_runs, record_future_attention
from beaconkv.policies import make_policy


@pytest.fixture(scope="module")
def llama(tiny_models):
    return beaconkv.load_model(tiny_models["llama"][0])


def _streams(n_tokens=48):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 97, (L,), generator=g).tolist() for L in (7, 11)]
    return prompts, torch.randint(3, 97, (2, n_tokens), generator=g)


def test_future_attention_sums_every_later_query_once(llama):
    prompts, tokens = _streams()
    fut = record_future_attention(llama, prompts, tokens)
    cfg = llama.config
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    S = tokens.shape[1]
    assert fut.steps == S and fut.prompt_lengths.tolist() == [7, 11]
    assert fut.suffix.shape == (cfg.num_hidden_layers, S + 1, 2, cfg.num_key_value_heads, 11 + S)
    assert float(fut.suffix[:, S].abs().sum()) == 0.0
    # each query's weights sum to one per query head: steps s.. of a KV head carry (S - s) * group
    per_step = fut.suffix.sum(-1)  # (L, S + 1, B, kv)
    expected = (S - torch.arange(S + 1)).float().view(1, S + 1, 1, 1) * group
    torch.testing.assert_close(per_step, expected.expand_as(per_step), rtol=1e-4, atol=1e-3)
    # no attention to positions a sequence has not reached: sequence 0 ends at position 7 + S - 1
    assert float(fut.suffix[:, :, 0, :, 7 + S :].abs().sum()) == 0.0


def test_the_oracle_recalls_more_than_real_policies_at_the_same_budget(llama):
    prompts, tokens = _streams()
    traces = [Trace(f"t{b}", p, tokens[b].tolist()) for b, p in enumerate(prompts)]
    fut = record_future_attention(llama, prompts, tokens)
    budget = 16
    runs = [Run(n, make_policy(n, budget, n_recent=2, **kw))
            for n, kw in (("beacon", {"n_beacon": 2}), ("h2o", {}), ("streaming", {"n_sink": 1}))]
    runs += oracle_runs(fut, [budget], n_recent=2)
    rows = measure_fidelity(llama, traces, runs, tokens.shape[1], GlobalQueryRule(top_k=4, threshold=6.0),
                            progress=False)
    pooled = {r.policy: r for r in rows if r.trace == "all"}
    assert pooled["oracle"].evictions > 0 and pooled["oracle"].evictions == pooled["beacon"].evictions
    for name in ("beacon", "h2o", "streaming"):
        assert pooled["oracle"].recall > pooled[name].recall, name


def test_the_oracle_needs_the_recorded_future():
    with pytest.raises(FidelityError, match="record_future_attention"):
        FutureAttentionOracle(16, n_recent=2)
