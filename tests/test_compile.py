"""Compiled decoding (``generate(..., compile=...)``): same tokens as eager, clear failures.

Inductor compiles are slow on a CPU box, so only the headline checks use the real inductor path on one
tiny model (FullKV and BeaconKV greedy, marked ``long``: CI's second tier; the gpu check's CPU smoke and
the compiled demo run inductor in ``make test``); the wider matrix (every policy, sampling,
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
from beaconkv.execution import compiled as compiled_module
from beaconkv.execution.compiled import COMPILE_TAKES_RECOMPILE_LIMIT, resolve_compile_config
from beaconkv.policies import H2O, BeaconKV, EvictionPolicy, PolicyState, SnapKV, make_policy
from beaconkv.policies.beacon import _select_queries
from beaconkv.policies.driver import evict_layer

TRACE = CompileConfig(backend="aot_eager")
BUDGET = 128  # the smallest budget with n_recent = 16: an eviction every 16 steps


pytestmark = pytest.mark.usefixtures("one_thread")


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


@pytest.mark.long  # a cold inductor compile of the decode step and an eviction: ~110 s on 2 cores
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
        state.layers = [layer.register_slot_buffer("decayed") for layer in state.observers]
        state.observed = torch.zeros(state.batch, device=state.device)

    def observe_attention(self, state, running, weights):
        running.mul_(self.decay).add_(weights.sum(2))
        if running is state.layers[0]:
            state.observed.add_(1)

    def score(self, layer, rows, t):
        return layer.layer_state[rows] / layer.state.observed[rows].clamp(min=1)[:, None, None]


@pytest.mark.parametrize("config", [pytest.param(CompileConfig(), marks=pytest.mark.long), TRACE], ids=["inductor", "aot_eager"])
def test_a_user_policy_with_its_own_state_compiles_with_no_extra_code(llama, config):
    policy = DecayedAttention(BUDGET, telemetry=True)
    eager, compiled = _both(llama, policy, config)
    assert compiled.token_ids == eager.token_ids
    assert eager.stats.evictions == compiled.stats.evictions == [2, 2]
    assert compiled.stats.compiled_evictions == 2 and _kept(compiled) == _kept(eager)
    torch.testing.assert_close(compiled.policy_state.observed, eager.policy_state.observed)


@pytest.mark.parametrize("name", ["beacon", "initial_recent", "snapkv", "rpc", "rkv", "h2o", "streaming",
                                  "expected_attention", "tova", "keydiff", "knorm", "lazy_eviction", "triattention"])
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

    code = evict_layer.__code__
    before = len(_debug_get_cache_entry_list(code))
    out = beaconkv.generate(llama, None, _prompts(), max_new_tokens=BUDGET + 20, eos_token_ids=[],
                            policy=FreshBeaconKV(BUDGET), compile=TRACE)
    assert out.stats.compiled_evictions == 2 and llama.config.num_hidden_layers == 2
    assert len(_debug_get_cache_entry_list(code)) == before + 1


def test_nothing_is_patched_onto_the_policy(llama):
    policy = BeaconKV(BUDGET)
    beaconkv.generate(llama, None, _prompts(), max_new_tokens=40, eos_token_ids=[], policy=policy, compile=TRACE)
    assert set(vars(policy)) == {f.name for f in dataclasses.fields(BeaconKV)}


@pytest.mark.long
def test_beacon_maintenance_sampler_call_is_one_graph_for_all_layers(llama):
    """Compression, freeze and roll sample every layer in one compiled call; an override stays the user's."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from beaconkv.policies.query_selection import FPS

    class FreshFPS(FPS):  # a new type: its graph is compiled fresh
        pass

    # written by the override inside the graph: device tensors, not Python lists (a list the graph appends
    # to is a guard that fails at every call, which would recompile every maintenance step)
    ran, stacked = torch.zeros((), dtype=torch.long), torch.zeros((), dtype=torch.long)

    class Counting(BeaconKV):
        def select_queries(self, queries, k):
            ran.add_(1)
            stacked.fill_(queries.q.shape[0])  # the layers stacked in this call
            return super().select_queries(queries, k)

    before = len(_debug_get_cache_entry_list(_select_queries.__code__))
    eager, compiled = _both(llama, BeaconKV(BUDGET, sampler=FreshFPS()), TRACE)
    assert compiled.token_ids == eager.token_ids
    assert len(_debug_get_cache_entry_list(_select_queries.__code__)) > before
    out = beaconkv.generate(llama, None, _prompts(), max_new_tokens=BUDGET + 20, eos_token_ids=[],
                            policy=Counting(BUDGET), compile=TRACE)
    # the user's override ran (traced into the graph), once per maintenance step with every layer stacked
    maintenance = out.policy_state.executor.calls["_select_queries"]
    assert maintenance > 0 and int(ran) == maintenance and int(stacked) == llama.config.num_hidden_layers


class _HostSyncPolicy(SnapKV):
    """A policy whose score reads the device: it cannot be one graph."""

    def score(self, layer, rows, t):
        if int(layer.cache.length.max()) < 0:  # a host sync
            raise AssertionError
        return super().score(layer, rows, t)


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
    per_function = {"recompile_limit": compiled_module.RECOMPILE_LIMIT} if COMPILE_TAKES_RECOMPILE_LIMIT else {}
    assert plain.options(cpu) == {"fullgraph": True, "backend": "inductor", "dynamic": None, "mode": None,
                                  **per_function}
    assert CompileConfig().options(cpu)["options"] == {"post_grad_fusion_options": {"decompose_mm_pass": CPU_GEMV_LIMITS}}
    assert CompileConfig().options(cuda)["mode"] == "reduce-overhead" and CompileConfig().cuda_graphs(cuda)
    assert plain.options(cuda) == CompileConfig().options(cuda)
    assert CompileConfig(freezing=True, cpu_gemv=False).options(cpu)["options"] == {"freezing": True}
    assert not CompileConfig(mode="default").cuda_graphs(cuda) and not CompileConfig().cuda_graphs(cpu)


def test_policy_false_compiles_the_decode_step_only(llama):
    eager, compiled = _both(llama, BeaconKV(BUDGET), CompileConfig(backend="aot_eager", policy=False))
    assert compiled.token_ids == eager.token_ids and compiled.stats.compiled
    assert compiled.stats.compiled_evictions == 0 and compiled.stats.evictions == [2, 2]


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"))]


@pytest.fixture
def graph_shape(request, monkeypatch):
    """``"cuda"``: real CUDA graphs. ``"cpu"``: the CUDA-graph execution shape on the CPU — the executor
    believes it replays graphs, so it takes every CUDA-graph branch (one eviction graph over all layers,
    static addresses marked, step boundaries, outputs cloned) with aot_eager graphs."""
    if request.param == "cpu":
        monkeypatch.setattr(CompileConfig, "cuda_graphs", lambda self, device: True)
        return request.param, TRACE
    return request.param, True


@pytest.mark.cuda
@pytest.mark.parametrize("graph_shape", DEVICES, indirect=True)
@pytest.mark.parametrize("name", ["full", "beacon"])
def test_cuda_graphs_greedy_tokens_equal_eager(tiny_models, graph_shape, name):
    device, config = graph_shape
    model = beaconkv.load_model(tiny_models["llama"][0], device=device)
    policy = None if name == "full" else BeaconKV(BUDGET, telemetry=True)
    eager, compiled = _both(model, policy, config)
    assert compiled.token_ids == eager.token_ids
    assert _kept(compiled) == _kept(eager)
    if name == "beacon":
        assert compiled.stats.compiled_evictions == 2 and eager.stats.evictions == [2, 2]
        assert compiled.policy_state.executor.calls["evict_all_layers"] == 2
        assert "evict_layer" not in compiled.policy_state.executor.calls


def test_one_graph_over_all_layers_gives_the_layerwise_tokens_and_kept_positions(llama):
    """``layerwise=False`` (what CUDA graphs choose) evicts through ``evict_all_layers``: same result."""
    policy = BeaconKV(BUDGET, n_prefix=2, telemetry=True)  # ragged rows: one-row evictions too
    layerwise = beaconkv.generate(llama, None, _prompts(), policy=policy, max_new_tokens=BUDGET + 20,
                                  eos_token_ids=[], compile=TRACE)
    whole = beaconkv.generate(llama, None, _prompts(), policy=policy, max_new_tokens=BUDGET + 20, eos_token_ids=[],
                              compile=dataclasses.replace(TRACE, layerwise=False))
    assert whole.token_ids == layerwise.token_ids and _kept(whole) == _kept(layerwise)
    calls = whole.policy_state.executor.calls
    assert calls["evict_all_layers"] == whole.stats.compiled_evictions > 0
    assert "evict_layer" not in calls


@pytest.mark.cuda
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_parity_with_transformers_eager_and_compiled(tiny_models, kind, device):
    """The transformers-parity oracle on each device: fp32 logits and greedy generation, eager and compiled
    (CUDA graphs on a GPU; the same graph traced with aot_eager on the CPU)."""
    path, hf = tiny_models[kind]
    ours = beaconkv.load_model(path, device=device)
    hf = hf.to(device)
    try:
        ids = torch.randint(3, 97, (2, 48), generator=torch.Generator().manual_seed(1)).to(device)
        with torch.no_grad():
            torch.testing.assert_close(ours(ids), hf(ids).logits.float(), atol=1e-3, rtol=0)
        prompt = ids[:1, :30]
        ref = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=32, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, 30:].tolist()
        for compile_config in (False, True if device == "cuda" else TRACE):
            out = beaconkv.generate(ours, None, [prompt[0].tolist()], max_new_tokens=32, eos_token_ids=[],
                                    compile=compile_config)
            assert out.token_ids[0] == ref
    finally:
        hf.to("cpu")  # the fixture's model is shared with CPU tests


def test_one_decode_graph_serves_every_block_of_layers_and_compile_time_is_counted_apart(tiny_models):
    """The layer-by-layer decode step compiles one block's graph and calls it for every block of layers;
    the seconds it took are in ``stats.compile_s`` (not in ``tokens_per_s``), and a second call compiles nothing."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from beaconkv.models.decoder import decode_layers
    from beaconkv.models.layers import SwiGLUMLP

    class FreshMLP(SwiGLUMLP):  # a new module type: no decode_layers graph compiled for it yet
        pass

    model = beaconkv.load_model(tiny_models["llama"][0], mlp=lambda c: FreshMLP(c.hidden_size, c.intermediate_size))
    one_layer = dataclasses.replace(TRACE, layerwise=True)  # one layer per block: the tiny model's 2 layers are 2
    calls = []
    before = len(_debug_get_cache_entry_list(decode_layers.__code__))
    first = beaconkv.generate(model, None, _prompts(), max_new_tokens=12, eos_token_ids=[], compile=one_layer,
                              on_step=lambda step, session: calls.append(session.decoder.calls["decode_layers"]))
    assert model.config.num_hidden_layers == 2 and calls[1] - calls[0] == 2  # a graph call per layer, every step
    assert len(_debug_get_cache_entry_list(decode_layers.__code__)) == before + 1  # one graph for both layers
    assert first.stats.compile_s > 0 and first.stats.compile_s < first.stats.wall_time_s
    decode_s = first.stats.wall_time_s - first.stats.prefill_s - first.stats.compile_s
    assert first.stats.tokens_per_s == pytest.approx(sum(first.stats.new_tokens) / decode_s)
    again = beaconkv.generate(model, None, _prompts(), max_new_tokens=12, eos_token_ids=[], compile=one_layer)
    assert again.stats.compile_s == 0 and again.token_ids == first.token_ids
    assert len(_debug_get_cache_entry_list(decode_layers.__code__)) == before + 1
    both = beaconkv.generate(model, None, _prompts(), max_new_tokens=12, eos_token_ids=[],
                             compile=dataclasses.replace(TRACE, layerwise=True, layer_block=2))  # one block of both
    assert both.token_ids == first.token_ids and both.stats.compile_s > 0
    eager = beaconkv.generate(model, None, _prompts(), max_new_tokens=12, eos_token_ids=[])
    assert eager.stats.compile_s == 0 and eager.token_ids == first.token_ids


def test_a_regional_decode_step_is_one_graph_whose_layers_share_one_region(tiny_models):
    """``regions=True``: the decode step is one graph; each decoder layer is a call of one nested compile
    region (traced once), and the tokens are eager's, FullKV and a policy with observers alike (two cache
    sizes: static shapes, one graph each)."""
    graphs = []

    def recording(gm, example_inputs):  # a backend that keeps dynamo's graphs and runs them as they are
        graphs.append(gm)
        return gm.forward

    model = beaconkv.load_model(tiny_models["qwen3"][0])  # Qwen3: q/k norms, and attention's float scale
    config = CompileConfig(backend=recording, regions=True)
    cpu = torch.device("cpu")
    assert config.decode_shape(cpu) == "regions" and config.options(cpu)["dynamic"] is False
    assert CompileConfig().decode_shape(cpu) == "layers" and CompileConfig(layerwise=False).decode_shape(cpu) == "whole"
    for policy in (None, H2O(BUDGET, n_recent=4)):
        graphs.clear()
        out = beaconkv.generate(model, None, _prompts(), max_new_tokens=BUDGET + 8, eos_token_ids=[], policy=policy,
                                compile=config)
        eager = beaconkv.generate(model, None, _prompts(), max_new_tokens=BUDGET + 8, eos_token_ids=[], policy=policy)
        assert out.token_ids == eager.token_ids
        assert out.policy_state.executor.calls["decode_and_sample"] == out.stats.decode_steps  # one call per step
        step = [gm for gm in graphs if any(n.target is torch.ops.higher_order.invoke_subgraph for n in gm.graph.nodes)]
        assert step, "the decode step's graph calls a region"
        for gm in step:
            calls = [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]
            assert len(calls) == model.config.num_hidden_layers
            assert len({n.args[0].target for n in calls}) == 1, "every layer calls the same region"


def test_layer_blocks_divide_the_layers_so_one_graph_serves_every_block():
    assert [CompileConfig().block_size(n) for n in (1, 2, 30)] == [1, 1, 1]  # the default: a graph per layer
    three = CompileConfig(layer_block=3)
    assert [three.block_size(n) for n in (1, 2, 7, 28, 30, 32, 36)] == [1, 2, 1, 2, 3, 2, 3]
    for k in (2, 4, 5):
        assert all(1 <= CompileConfig(layer_block=k).block_size(n) <= k and n % CompileConfig(layer_block=k).block_size(n)
                   == 0 for n in range(1, 80))
    for bad in (0, -1, 1.5, True, None):
        with pytest.raises(ValueError, match="layer_block"):
            CompileConfig(layer_block=bad)


def test_a_recompile_is_announced_with_its_reason_and_counted():
    from beaconkv.execution.compiled import CompiledExecutor, RecompileWarning

    def scale_rows(x):
        return x * 2

    executor = CompiledExecutor(CompileConfig(backend="eager", dynamic=False), "cpu")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", RecompileWarning)  # the first graph is no recompile
        executor.run(scale_rows, torch.ones(3))
        executor.run(scale_rows, torch.ones(3))
    assert executor.compiles == 1 and executor.compile_s > 0
    with pytest.warns(RecompileWarning, match=r"(?s)another graph of .*scale_rows \(.*size"):
        executor.run(scale_rows, torch.ones(5))  # a new size, with dynamic=False: a second graph
    assert executor.compiles == 2


@pytest.mark.parametrize("per_function", [True, False], ids=["torch.compile-argument", "dynamo-config"])
def test_a_function_past_the_recompile_limit_raises_instead_of_running_eagerly(monkeypatch, per_function):
    """Both ways the limit is set: ``torch.compile(recompile_limit=)`` (torch 2.12+) and, for older torch
    (the GPU image's 2.11), dynamo's process-wide ``recompile_limit`` raised to :data:`RECOMPILE_LIMIT`."""
    import torch._dynamo.config as dynamo_config

    from beaconkv.execution.compiled import CompiledExecutor, RecompileWarning

    if per_function and not COMPILE_TAKES_RECOMPILE_LIMIT:
        pytest.skip(f"torch {torch.__version__}'s torch.compile has no recompile_limit argument (added in 2.12)")
    monkeypatch.setattr(compiled_module, "RECOMPILE_LIMIT", 2)
    monkeypatch.setattr(compiled_module, "COMPILE_TAKES_RECOMPILE_LIMIT", per_function)
    with dynamo_config.patch(recompile_limit=1):  # below ours: the fallback must lift it to 2
        assert ("recompile_limit" in CompileConfig(backend="eager").options(torch.device("cpu"))) == per_function

        def shift_rows(x):
            return x + 1

        def shift_rows_too(x):  # its own code object: dynamo keeps the graphs of the other case on shift_rows's
            return x + 1

        fn = shift_rows if per_function else shift_rows_too
        executor = CompiledExecutor(CompileConfig(backend="eager", dynamic=False), "cpu")
        with pytest.warns(RecompileWarning):
            for n in (1, 2):
                executor.run(fn, torch.ones(n))
        with pytest.raises(CompileError, match="(?s)failed on .*shift_rows.*compile=False"):
            executor.run(fn, torch.ones(3))  # a third graph
