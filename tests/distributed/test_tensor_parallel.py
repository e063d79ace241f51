"""Tensor parallelism on the CPU with gloo, 2 processes: the same tokens and kept positions as one process.

Each model is split over 2 ranks (this process is rank 0, the other is spawned) and generates with every
policy the issue names; rank 0's output must equal a single-process run of the whole model: greedy tokens,
and every eviction's kept positions per KV head (the ranks' records joined head by head). ``gqa1`` has one
KV head for 4 query heads, so both ranks hold it (replicated) and must keep identical sets; ``kv3`` has 3 KV
heads, 2 on rank 0 and 1 on rank 1. Then: the engine
with ragged requests admitted into a busy pool, prompts prefilled in chunks, sampled tokens
(a killed rank and the refusals: ``test_failures.py``; the command line: ``test_cli.py``).
"""

from __future__ import annotations

import pytest
import torch

import beaconkv
from beaconkv import RPC, BeaconKV, ExpectedAttention, H2O, HeadAdaptive, Shared, SnapKV
from beaconkv.distributed import MirroredEngine, TensorParallelRun
from beaconkv.engine import Engine, Request

from .conftest import KINDS

pytestmark = pytest.mark.usefixtures("one_thread")

#: Each policy at a budget the 24-token generations of the ragged prompts evict several times with.
POLICIES = {
    "beacon": lambda: BeaconKV(16, telemetry=True),
    "snapkv": lambda: SnapKV(16, telemetry=True),
    "h2o": lambda: H2O(16, telemetry=True),
    "rpc": lambda: RPC(16, window=8, telemetry=True),
    "expected_attention": lambda: ExpectedAttention(16, window=8, n_future_positions=64, telemetry=True),
    "head_adaptive": lambda: SnapKV(16, allocation=HeadAdaptive(), telemetry=True),
    "shared": lambda: BeaconKV(16, allocation=Shared(), telemetry=True),
}
PROMPTS = [[1, 5, 9, 11, 3, 7, 20, 40, 33, 12, 8], [1, 4, 4, 60, 70], list(range(1, 30))]
TIMEOUT_S = 30.0


@pytest.fixture(scope="module", params=KINDS)
def split(request, tp_checkpoints):
    """``(kind, the whole model, a 2-rank run of it)``; one spawned rank per model, reused by its tests."""
    kind = request.param
    threads = torch.get_num_threads()
    run = TensorParallelRun(tp_checkpoints[kind], 2, timeout_s=TIMEOUT_S, threads=1)
    try:
        yield kind, beaconkv.load_model(tp_checkpoints[kind]), run
    finally:
        run.close()
        torch.set_num_threads(threads)


def assert_same_evictions(got, want) -> None:
    """The same evictions (step, layer, rows) keeping the same positions in every KV head, and at least one."""
    assert len(want) > 0, "the reference never evicted: the check would prove nothing"
    assert [(r.step, r.layer, r.rows) for r in got] == [(r.step, r.layer, r.rows) for r in want]
    for g, w in zip(got, want):
        assert g.kept_positions.shape == w.kept_positions.shape, (g.step, g.layer)
        assert torch.equal(g.kept_positions, w.kept_positions), (g.step, g.layer)


@pytest.mark.parametrize("name", list(POLICIES))
def test_greedy_tokens_and_kept_positions_equal_one_process(split, name):
    kind, whole, run = split
    want = beaconkv.generate(whole, None, PROMPTS, max_new_tokens=24, policy=POLICIES[name]())
    got = beaconkv.generate(run.model, None, PROMPTS, max_new_tokens=24, policy=POLICIES[name]())
    assert got.token_ids == want.token_ids
    assert got.stats.evictions == want.stats.evictions
    assert_same_evictions(got.telemetry, want.telemetry)
    # the records cover every KV head of the model, as the single process's
    assert got.telemetry[0].kept_positions.shape[1] == whole.config.num_key_value_heads


def test_each_rank_holds_its_heads(split):
    kind, whole, run = split
    plan, local = run.model.shard_plan, run.model.config
    assert local.num_key_value_heads == len(plan.kv_heads) == -(-whole.config.num_key_value_heads // 2)
    assert local.intermediate_size == whole.config.intermediate_size // 2
    q = run.model.model.layers[0].self_attn.q_proj.weight
    hd = whole.config.head_dim
    want = whole.model.layers[0].self_attn.q_proj.weight[plan.attention_heads.start * hd:plan.attention_heads.stop * hd]
    assert torch.equal(q, want)  # read straight from the checkpoint's slice
    if kind == "gqa1":  # the one KV head is replicated; o_proj is split between the replicas
        assert plan.replicas == 2 and len(plan.attention_heads) == 4 and len(plan.output_heads) == 2


def test_engine_with_ragged_requests_admitted_mid_flight(split):
    """5 requests of different lengths and limits through a 2-slot pool: admissions and releases mid-flight."""
    kind, whole, run = split
    lengths, limits = [3, 17, 9, 25, 6], [20, 7, 13, 5, 18]
    requests = [Request([1 + (7 * i + j) % 90 for j in range(n)], m) for i, (n, m) in enumerate(zip(lengths, limits))]

    def complete(engine):
        return [(c.token_ids, c.evictions, c.slot) for c in engine.run(requests)]

    settings = dict(policy=BeaconKV(16, telemetry=True), max_batch=2, prompt_capacity=32, max_new_tokens=24)
    want_engine = Engine(whole, None, **settings)
    with torch.inference_mode():
        want = complete(want_engine)
    with run.guard("the ragged requests"), torch.inference_mode():
        engine = MirroredEngine(run.model, None, **settings)
        got = complete(engine)
    assert got == want
    assert [len(t) for t, _, _ in got] == limits  # each its own limit (no end-of-sequence id without a tokenizer)
    assert_same_evictions(engine.session.state.stats.telemetry, want_engine.session.state.stats.telemetry)


def test_chunked_prefill_and_sampling_equal_one_process(split):
    kind, whole, run = split
    for kwargs in (dict(prefill_chunk=8, policy=SnapKV(16, n_prefix=2, telemetry=True)),
                   dict(temperature=0.8, top_p=0.9, seed=3, policy=BeaconKV(16, telemetry=True))):
        want = beaconkv.generate(whole, None, PROMPTS, max_new_tokens=24, **kwargs)
        got = beaconkv.generate(run.model, None, PROMPTS, max_new_tokens=24, **kwargs)  # a policy serves both
        assert got.token_ids == want.token_ids
        assert_same_evictions(got.telemetry, want.telemetry)
