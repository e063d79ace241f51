"""Compiled decoding (``generate(..., compile=...)``): same tokens as eager, clear failures.

Inductor compiles are slow on a CPU box, so only the two headline checks (FullKV and BeaconKV,
greedy) use the real inductor path on one tiny model; the wider matrix (every policy, sampling,
ragged schedules) traces the very same graphs with ``backend="aot_eager"`` — dynamo + AOT
autograd with ``fullgraph=True``, which catches every graph break and host sync in seconds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

import beaconkv
from beaconkv.execution import CPU_GEMV_LIMITS, CompileConfig, CompileError, lift_cpu_gemv_limit
from beaconkv.execution.compiled import resolve_compile_config
from beaconkv.policies import BeaconKV, EvictionPolicy, PolicyState, SnapKV, make_policy, select_keep
from beaconkv.policies.beacon import _select_queries

TRACE = CompileConfig(backend="aot_eager")
BUDGET = 128  # the smallest budget with n_recent = 16: an eviction every 16 steps


@pytest.fixture(scope="module")
def llama(tiny_models):
    return beaconkv.load_model(tiny_models["llama"][0])


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run fastest on one thread on a shared machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _prompts(lengths=(5, 12), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 97, (n,), generator=g).tolist() for n in lengths]


def _both(model, policy, compile_config, **kw):
    kw = dict(max_new_tokens=kw.pop("max_new_tokens", BUDGET + 20), eos_token_ids=[], **kw)
    eager = beaconkv.generate(model, None, _prompts(), policy=policy, **kw)
    compiled = beaconkv.generate(model, None, _prompts(), policy=policy, compile=compile_config, **kw)
    return eager, compiled


def _kept(out):
    return [(r.step, r.layer, r.rows, r.kept_positions.tolist()) for r in out.telemetry]


@pytest.mark.parametrize("name", ["full", "beacon"])
def test_inductor_greedy_tokens_equal_eager(llama, name):
    policy = None if name == "full" else BeaconKV(BUDGET, telemetry=True)
    eager, compiled = _both(llama, policy, CompileConfig())
    assert compiled.token_ids == eager.token_ids
    assert compiled.stats.compiled
    if name == "beacon":
        assert eager.stats.evictions == compiled.stats.evictions == [2, 2]
        assert compiled.stats.compiled_evictions == 2 and _kept(compiled) == _kept(eager)


@dataclass(eq=False)
class DecayState(PolicyState):
    """The test policy's own state: per row, how many decode steps it has observed (a device tensor)."""

    observed: torch.Tensor | None = None


@dataclass
class DecayedAttention(EvictionPolicy):
    """A user's policy with state of its own, defined here: an exponentially decayed running sum of the
    attention each slot received (per-layer slot buffers), normalised by the steps observed (a per-row
    tensor of its own state class). Nothing about compilation is written for it."""

    decay: float = 0.8

    name: ClassVar[str] = "decayed_attention"
    track_attention: ClassVar[bool] = True
    state_class: ClassVar[type[PolicyState]] = DecayState

    def init_state(self, state):
        state.layers = [layer.register_slot_buffer("decayed") for layer in state.cache.layers]
        state.observed = torch.zeros(state.batch, device=state.device)

    def observe_attention(self, state, running, weights):
        running.mul_(self.decay).add_(weights.sum(2))
        if running is state.layers[0]:
            state.observed.add_(1)

    def score(self, state, running, cache, rows, t):
        return running[rows] / state.observed[rows].clamp(min=1)[:, None, None]


@pytest.mark.parametrize("config", [CompileConfig(), TRACE], ids=["inductor", "aot_eager"])
def test_a_user_policy_with_its_own_state_compiles_with_no_extra_code(llama, config):
    policy = DecayedAttention(BUDGET, telemetry=True)
    eager, compiled = _both(llama, policy, config)
    assert compiled.token_ids == eager.token_ids
    assert eager.stats.evictions == compiled.stats.evictions == [2, 2]
    assert compiled.stats.compiled_evictions == 2 and _kept(compiled) == _kept(eager)
    torch.testing.assert_close(compiled.policy_state.observed, eager.policy_state.observed)


@pytest.mark.parametrize("name", ["beacon", "initial_recent", "snapkv", "rpc", "rkv", "h2o", "streaming"])
def test_every_policy_traces_fullgraph_with_the_same_tokens(llama, name):
    eager, compiled = _both(llama, make_policy(name, budget=BUDGET, telemetry=True), TRACE)
    assert compiled.token_ids == eager.token_ids
    assert compiled.stats.evictions == eager.stats.evictions and sum(eager.stats.evictions) > 0
    assert compiled.stats.compiled_evictions == eager.stats.evictions[0]  # every eviction took the graph
    assert _kept(compiled) == _kept(eager)


def test_seeded_sampling_is_the_same_compiled(llama):
    kw = {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "seed": 3, "max_new_tokens": 24}
    eager, compiled = _both(llama, None, TRACE, **kw)
    assert compiled.token_ids == eager.token_ids


def test_ragged_schedules_compile_too(llama):
    # an int n_prefix with prompts of different lengths: the rows reach the budget at different steps,
    # so evictions cover one row at a time — the same graph, with the rows as an argument
    policy = BeaconKV(BUDGET, n_prefix=2, telemetry=True)
    eager, compiled = _both(llama, policy, TRACE)
    assert compiled.token_ids == eager.token_ids
    assert compiled.stats.evictions == eager.stats.evictions
    assert {len(r.rows) for r in compiled.telemetry} == {1}  # ragged indeed
    assert compiled.stats.compiled_evictions == sum(compiled.stats.evictions) > 0
    assert _kept(compiled) == _kept(eager)


def test_one_eviction_graph_serves_every_layer(llama):
    """The per-layer eviction graph is compiled once for all layers: no layer index baked into it."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    class FreshBeaconKV(BeaconKV):  # a new type: no graph compiled for it yet
        pass

    code = EvictionPolicy.evict_layer.__code__
    before = len(_debug_get_cache_entry_list(code))
    out = beaconkv.generate(llama, None, _prompts(), max_new_tokens=BUDGET + 20, eos_token_ids=[],
                            policy=FreshBeaconKV(BUDGET), compile=TRACE)
    assert out.stats.compiled_evictions == 2 and llama.config.num_hidden_layers == 2
    assert len(_debug_get_cache_entry_list(code)) == before + 1


def test_nothing_is_patched_onto_the_policy(llama):
    policy = BeaconKV(BUDGET)
    beaconkv.generate(llama, None, _prompts(), max_new_tokens=40, eos_token_ids=[], policy=policy, compile=TRACE)
    assert set(vars(policy)) == {f.name for f in dataclasses.fields(BeaconKV)}


def test_beacon_maintenance_sampler_call_is_one_graph_for_all_layers(llama):
    """Compression, freeze and roll sample every layer in one compiled call; an override stays the user's."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from beaconkv.policies.samplers import ContinualFPS

    class FreshFPS(ContinualFPS):  # a new type: its graph is compiled fresh
        pass

    calls = []

    class Counting(BeaconKV):
        def select_queries(self, queries, k):
            calls.append(queries.q.shape[0])
            return super().select_queries(queries, k)

    before = len(_debug_get_cache_entry_list(_select_queries.__code__))
    eager, compiled = _both(llama, BeaconKV(BUDGET, sampler=FreshFPS()), TRACE)
    assert compiled.token_ids == eager.token_ids
    assert len(_debug_get_cache_entry_list(_select_queries.__code__)) > before
    beaconkv.generate(llama, None, _prompts(), max_new_tokens=BUDGET + 20, eos_token_ids=[], policy=Counting(BUDGET),
                      compile=TRACE)
    # the user's override ran (traced into the graph), once per maintenance step with every layer stacked
    assert calls and set(calls) == {llama.config.num_hidden_layers}


class _HostSyncPolicy(SnapKV):
    """A policy whose score reads the device: it cannot be one graph."""

    def score(self, state, layer_state, cache, rows, t):
        if int(cache.length.max()) < 0:  # a host sync
            raise AssertionError
        return super().score(state, layer_state, cache, rows, t)


def test_a_graph_break_raises_a_clear_error(llama):
    with pytest.raises(CompileError, match="(?s)evict_layer of _HostSyncPolicy.*compile=False"):
        beaconkv.generate(llama, None, _prompts(), max_new_tokens=BUDGET + 8, eos_token_ids=[],
                          policy=_HostSyncPolicy(BUDGET), compile=CompileConfig(backend="eager"))


def test_cpu_gemv_limit_is_lifted_whatever_the_import_order():
    """The LM head's vocab x hidden matmul may decompose too, even if inductor imported the pass first."""
    import importlib

    module = importlib.import_module("torch._inductor.fx_passes.decompose_mem_bound_mm")
    assert lift_cpu_gemv_limit()
    assert module.cpu_max_other_dimension_decomposition == CPU_GEMV_LIMITS["cpu_max_other_dimension_decomposition"]


def test_compile_argument_and_options():
    assert resolve_compile_config(False) is None and resolve_compile_config(True) == CompileConfig()
    with pytest.raises(TypeError, match="compile='yes'"):
        resolve_compile_config("yes")
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    plain = CompileConfig(cpu_gemv=False)
    assert plain.options(cpu) == {"fullgraph": True, "backend": "inductor", "dynamic": None, "mode": None}
    assert CompileConfig().options(cpu)["options"] == {"post_grad_fusion_options": {"decompose_mm_pass": CPU_GEMV_LIMITS}}
    assert CompileConfig().options(cuda)["mode"] == "reduce-overhead" and CompileConfig().cuda_graphs(cuda)
    assert plain.options(cuda) == CompileConfig().options(cuda)
    assert CompileConfig(freezing=True, cpu_gemv=False).options(cpu)["options"] == {"freezing": True}
    assert not CompileConfig(mode="default").cuda_graphs(cuda) and not CompileConfig().cuda_graphs(cpu)


def test_policy_false_compiles_the_decode_step_only(llama):
    eager, compiled = _both(llama, BeaconKV(BUDGET), CompileConfig(backend="aot_eager", policy=False))
    assert compiled.token_ids == eager.token_ids and compiled.stats.compiled
    assert compiled.stats.compiled_evictions == 0 and compiled.stats.evictions == [2, 2]


def test_select_keep_with_a_host_known_keep_count_equals_the_device_read():
    g = torch.Generator().manual_seed(0)
    b, h, C = 3, 2, 40
    pos = torch.arange(C).repeat(b, h, 1)
    pos[0, :, 30:] = -1  # a shorter row
    scores = torch.randn(b, h, C, generator=g).round(decimals=1)  # ties
    n_prefix, t = torch.tensor([4, 6, 0]), torch.tensor([29, 39, 39])
    keep_total = torch.tensor([20, 24, 24])
    ref = select_keep(scores, pos, n_prefix, t, 8, keep_total)
    got = select_keep(scores, pos, n_prefix, t, 8, keep_total, keep_max=24)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (CUDA graphs)")
@pytest.mark.parametrize("name", ["full", "beacon"])
def test_cuda_graphs_greedy_tokens_equal_eager(tiny_models, name):
    model = beaconkv.load_model(tiny_models["llama"][0], device="cuda")
    policy = None if name == "full" else BeaconKV(BUDGET, telemetry=True)
    eager, compiled = _both(model, policy, True)
    assert compiled.token_ids == eager.token_ids
    assert _kept(compiled) == _kept(eager)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (stream synchronisation)")
@pytest.mark.parametrize("name", ["beacon", "snapkv", "h2o", "rpc"])
def test_decode_and_eviction_loop_never_synchronises(tiny_models, name):
    """The decode step and every eviction (rows, counts, positions) run without a host<->device sync."""
    from beaconkv.sampling import SamplingParams
    from beaconkv.session import Session

    model = beaconkv.load_model(tiny_models["llama"][0], device="cuda")
    prompts = _prompts((9, 9))  # equal prompts: every row evicts at the same steps
    policy = make_policy(name, budget=BUDGET)
    for kv_storage in ("dense", "int8"):
        session = Session.for_prompts(model, policy, [9, 9], BUDGET + 40, kv_storage=kv_storage)
        tokens = session.prefill(prompts).argmax(-1)
        params = SamplingParams()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(BUDGET + 40):
                tokens = session.step(tokens, params)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert session.state.stats.evictions == [3, 3]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_cuda_parity_with_transformers(tiny_models, kind):
    """The transformers-parity oracle on the GPU: fp32 logits and greedy generation (eager and CUDA graphs)."""
    path, hf = tiny_models[kind]
    ours = beaconkv.load_model(path, device="cuda")
    hf = hf.to("cuda")
    try:
        ids = torch.randint(3, 97, (2, 48), generator=torch.Generator().manual_seed(1)).cuda()
        with torch.no_grad():
            torch.testing.assert_close(ours(ids), hf(ids).logits.float(), atol=1e-3, rtol=0)
        prompt = ids[:1, :30]
        ref = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=32, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, 30:].tolist()
        for compile_config in (False, True):
            out = beaconkv.generate(ours, None, [prompt[0].tolist()], max_new_tokens=32, eos_token_ids=[],
                                    compile=compile_config)
            assert out.token_ids[0] == ref
    finally:
        hf.to("cpu")  # the fixture's model is shared with CPU tests
