"""The graph strategy (:mod:`beaconkv.execution.graphs`): the protocol of recording a device function once per shape
and replaying it, checked on the CPU through the op-replay recorder, which replays with a CUDA graph's semantics
(the recorded operations only, on the same tensors, outputs the graph owns); and the recorder itself."""

from __future__ import annotations

import dataclasses
import enum

import pytest
import torch

import beaconkv
from beaconkv.execution import (
    CompileConfig,
    CompiledExecutor,
    EagerExecutor,
    GraphCaptureError,
    GraphExecutor,
    GraphLimitWarning,
    OpReplayRecorder,
    graphs,
    make_executor,
)
from beaconkv.execution.graphs import host_flags
from beaconkv.policies import BeaconKV

from .device_functions import Store, write_and_read

pytestmark = pytest.mark.usefixtures("one_thread")


def _executor(**kw) -> GraphExecutor:
    return GraphExecutor(OpReplayRecorder(), **kw)


def _inputs(n: int, seed: int = 0, size: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(size, generator=g) for _ in range(n)]


def test_replays_give_the_eager_results_and_write_the_objects_tensors_in_place():
    eager_store, graph_store = Store(), Store()
    executor = _executor()
    outs = []
    for x in _inputs(8):
        ref = write_and_read(eager_store, x, 0.25)
        got = executor.run(write_and_read, graph_store, x, 0.25)
        torch.testing.assert_close(got, ref)
        outs.append(got)
    torch.testing.assert_close(graph_store.buf, eager_store.buf)
    assert int(graph_store.count) == 8
    # the first call ran eagerly, the second recorded (its own run was the call), the rest replayed
    assert executor.eager_calls == 1 and executor.compiles == 1 and executor.replays == 6 and len(executor.graphs) == 1
    assert executor.calls["write_and_read"] == 8 and executor.compile_s > 0
    # outputs are the caller's: the next replays did not overwrite the earlier ones
    assert len({o.data_ptr() for o in outs}) == len(outs)
    assert not torch.equal(outs[-1], outs[-2])


def test_a_new_shape_a_new_plain_value_or_a_new_object_records_another_graph():
    executor = _executor(record_after=0)
    store, other = Store(), Store()
    calls = [(store, torch.ones(3), 0.5), (store, torch.ones(4), 0.5), (store, torch.ones(3), 0.25),
             (other, torch.ones(3), 0.5)]
    for args in calls * 2:
        executor.run(write_and_read, *args)
    assert len(executor.graphs) == 4 and executor.replays == 4 and executor.eager_calls == 0


def test_a_changed_host_flag_records_another_graph_and_the_results_follow_it():
    eager_store, graph_store = Store(), Store()
    executor = _executor(record_after=0)
    for i, x in enumerate(_inputs(10)):
        eager_store.doubled = graph_store.doubled = i >= 5  # e.g. a sampling mode that a new request changes
        got = executor.run(write_and_read, graph_store, x, 1.0)
        torch.testing.assert_close(got, write_and_read(eager_store, x, 1.0))
    assert len(executor.graphs) == 2
    assert host_flags(graph_store) == (True,)  # the bool; the int counter and the tensors are not flags


class Kind(enum.Enum):
    A = "a"


@dataclasses.dataclass(frozen=True)
class Mode:
    greedy: bool
    k: int


def test_host_flags_are_booleans_strings_enums_none_and_plain_frozen_settings():
    class Holder:
        def __init__(self) -> None:
            self.a, self.b, self.c, self.d, self.e = True, "x", Kind.A, None, Mode(True, 3)
            self.n, self.f, self.t, self.items = 3, 0.5, torch.zeros(2), [True]

    holder = Holder()
    assert host_flags(holder) == (True, "x", Kind.A, None, Mode(True, 3))
    holder.d = torch.ones(1)  # an attribute that held None and now a tensor: not a flag, and never compared
    assert host_flags(holder)[3] is graphs._NOT_A_FLAG
    assert host_flags(object()) == ()


def test_tensor_arguments_written_in_place_are_copied_back():
    def bump(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x.add_(1.0)
        return x * y

    executor = _executor()
    x, x_ref = torch.zeros(4), torch.zeros(4)
    y = torch.arange(4.0)
    for _ in range(5):
        torch.testing.assert_close(executor.run(bump, x, y), bump(x_ref, y))
        torch.testing.assert_close(x, x_ref)
    assert executor.replays == 3 and [e.written for e in executor.graphs.values()] == [[0]]


def test_tensors_inside_tuples_named_tuples_and_lists_are_inputs_too():
    from collections import namedtuple

    Pair = namedtuple("Pair", "a b")

    def combine(pair: Pair, rest: list, size: torch.Size) -> torch.Tensor:
        return (pair.a * pair.b + rest[0]).reshape(size)

    executor = _executor()
    for i in range(4):
        a, b, c = torch.full((4,), float(i)), torch.arange(4.0), torch.ones(4)
        got = executor.run(combine, Pair(a, b), [c], torch.Size([2, 2]))
        torch.testing.assert_close(got, (a * b + c).reshape(2, 2))
    assert executor.replays == 2 and len(executor.graphs) == 1


def test_the_same_tensor_twice_shares_one_buffer():
    def add_into(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a.add_(1.0)
        return a + b  # sees its own write through b

    executor = _executor(record_after=0)
    t, ref = torch.zeros(2), torch.zeros(2)
    for _ in range(3):
        torch.testing.assert_close(executor.run(add_into, t, t), add_into(ref, ref))
    torch.testing.assert_close(t, ref)


def test_past_the_graph_limit_calls_run_eagerly_with_one_warning():
    executor = _executor(record_after=0, max_graphs=1)
    store, ref = Store(), Store()
    executor.run(write_and_read, store, torch.ones(3), 1.0)
    write_and_read(ref, torch.ones(3), 1.0)
    with pytest.warns(GraphLimitWarning, match="1 graphs recorded"):
        for n in (4, 5, 4):
            torch.testing.assert_close(executor.run(write_and_read, store, torch.ones(n), 1.0),
                                       write_and_read(ref, torch.ones(n), 1.0))
    assert len(executor.graphs) == 1 and executor.eager_calls == 3
    with pytest.raises(ValueError, match="max_graphs=-1"):
        _executor(max_graphs=-1)
    with pytest.raises(ValueError, match="record_after=True"):
        _executor(record_after=True)


# ---------------------------------------------------------------------------------- which strategy runs
def test_the_cuda_default_is_the_graph_strategy_and_the_cpu_keeps_torch_compile(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert CompileConfig().strategy_on(cpu) == "compile" and CompileConfig().strategy_on(cuda) == "graphs"
    for asks_compile in (dict(backend="aot_eager"), dict(mode="max-autotune"), dict(regions=True),
                         dict(layerwise=False), dict(freezing=True), dict(strategy="compile")):
        assert CompileConfig(**asks_compile).strategy_on(cuda) == "compile", asks_compile
    assert CompileConfig(dynamic=False).strategy_on(cuda) == "graphs"  # what `--compile` passes
    assert CompileConfig(strategy="graphs").strategy_on(cpu) == "graphs"
    decode, _ = make_executor(CompileConfig(strategy="graphs", recorder="op_replay"), cpu)
    assert isinstance(decode, GraphExecutor) and isinstance(decode.recorder, OpReplayRecorder)
    with pytest.raises(ValueError, match="recorder='tape'"):
        CompileConfig(recorder="tape")
    assert CompileConfig().cuda_graphs(cuda) and CompileConfig(strategy="graphs", backend="aot_eager").cuda_graphs(cuda)
    with pytest.raises(ValueError, match="strategy='cudagraph'"):
        CompileConfig(strategy="cudagraph")
    # on the CPU: torch.compile by default; CUDA graphs asked for explicitly name the missing device
    decode, policy = make_executor(CompileConfig(backend="aot_eager"), cpu)
    assert isinstance(decode, CompiledExecutor) and policy is decode
    with pytest.raises(GraphCaptureError, match="CUDA graphs need a CUDA device; got cpu"):
        make_executor(CompileConfig(strategy="graphs"), cpu)
    # the executor the CUDA default makes, with the op-replay recorder standing in for the device's
    monkeypatch.setattr(graphs, "graph_recorder", lambda device, kind: OpReplayRecorder())
    decode, policy = make_executor(True, cuda)
    assert isinstance(decode, GraphExecutor) and policy is decode and decode.compiled and not decode.layerwise
    decode, policy = make_executor(CompileConfig(policy=False), cuda)
    assert isinstance(decode, GraphExecutor) and isinstance(policy, EagerExecutor)


# ---------------------------------------------------------------------------------- the real decode path
BUDGET = 32


@pytest.fixture
def replayed() -> CompileConfig:
    """The graph strategy on the CPU: the op-replay recorder stands in for CUDA graphs, so that the session, the
    engine and the policies run through every branch of the graph executor (keys, buffers, replays, clones)."""
    return CompileConfig(strategy="graphs", recorder="op_replay")


def _prompts(lengths=(5, 12), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 97, (n,), generator=g).tolist() for n in lengths]


def _kept(out):
    return [(r.step, r.layer, r.rows, r.kept_positions.tolist()) for r in out.telemetry]


def _tensor_shapes(executor: GraphExecutor, name: str) -> set[tuple]:
    """The shapes of the first tensor argument of every graph recorded for ``name`` (an eviction's rows)."""
    return {next(tuple(s[1]) for s in key[1] if isinstance(s, tuple) and s[:1] == (graphs._TENSOR,))
            for key in executor.graphs if key[0].__qualname__ == name}


@pytest.mark.parametrize("name", ["full", "beacon", "snapkv", "h2o", "rkv"])
def test_graph_replays_give_the_eager_tokens_and_kept_positions(llama, replayed, name):
    from beaconkv.policies import make_policy
    from beaconkv.policies.registry import policy_parameters

    settings = {} if name == "full" else {"budget": BUDGET, "n_recent": 4, "telemetry": True}
    if "n_beacon" in policy_parameters(name):
        settings["n_beacon"] = 4
    if "n_prefix" in policy_parameters(name):
        settings["n_prefix"] = 2  # the prompts' tails are evictable: rows of different lengths evict at other steps
    kw = dict(max_new_tokens=BUDGET + 40, eos_token_ids=[])
    eager = beaconkv.generate(llama, None, _prompts(), policy=make_policy(name, **settings), **kw)
    graph = beaconkv.generate(llama, None, _prompts(), policy=make_policy(name, **settings), compile=replayed, **kw)
    assert graph.token_ids == eager.token_ids
    assert _kept(graph) == _kept(eager) and graph.stats.evictions == eager.stats.evictions
    executor = graph.policy_state.executor
    assert isinstance(executor, GraphExecutor) and graph.stats.compiled
    assert executor.replays >= kw["max_new_tokens"] - 4  # every step after the first two replays
    decode_graphs = [k for k in executor.graphs if k[0].__qualname__ == "decode_and_sample"]
    assert len(decode_graphs) == 1
    if name != "full":
        # the policy decides on the host which rows evict and how many slots they keep; the graph only runs it:
        # one eviction graph per (rows, kept slots) met twice, the same positions kept as eagerly
        assert graph.stats.compiled_evictions == eager.policy_state.stats.eviction_calls > 2
        assert executor.calls["evict_all_layers"] == graph.stats.compiled_evictions
        assert (1,) in _tensor_shapes(executor, "evict_all_layers")  # one row's eviction is a shape of its own


def test_seeded_sampling_gives_the_eager_tokens(llama, replayed):
    kw = dict(max_new_tokens=48, eos_token_ids=[], temperature=0.8, top_p=0.9, top_k=20, seed=3,
              policy=BeaconKV(BUDGET, n_recent=4, n_beacon=4))
    eager = beaconkv.generate(llama, None, _prompts((7, 7, 9)), **kw)
    graph = beaconkv.generate(llama, None, _prompts((7, 7, 9)), compile=replayed, **kw)
    assert graph.token_ids == eager.token_ids


def test_the_engine_replays_and_a_new_sampling_mode_records_another_step(llama, replayed):
    """A pool with staggered requests (admissions, releases, one-row evictions at different steps), where a
    request asking for log-probabilities arrives mid-run: its sampling mode is a host flag of the step's
    sampling object, so the step records again, and every token and log-probability equals the eager engine's."""
    from beaconkv.engine import Engine, Request
    from beaconkv.sampling import SamplingParams

    def run(compile_config):
        engine = Engine(llama, None, policy=BeaconKV(BUDGET, n_recent=4, n_beacon=4), max_batch=3, prompt_capacity=16,
                        max_new_tokens=80, compile=compile_config, kernels="model")
        requests = [Request(p, n, eos_token_ids=[]) for p, n in zip(_prompts((5, 12, 9, 6)), (70, 40, 55, 30))]
        requests.append(Request(_prompts((8,), seed=1)[0], 30, SamplingParams(logprobs=2), eos_token_ids=[]))
        done = engine.run(requests)
        return engine, [(c.token_ids, [(round(t.logprob, 4), t.token_id) for t in c.logprobs or []]) for c in done]

    eager_engine, eager = run(False)
    engine, got = run(replayed)
    assert got == eager
    executor = engine.session.decoder
    assert isinstance(executor, GraphExecutor) and executor.replays > 100
    # the sampling object is the step's sixth argument; its key part is (marker, id, host flags)
    modes = {key[1][5][2] for key in executor.graphs if key[0].__qualname__ == "decode_and_sample"}
    assert len(modes) == 2, modes  # greedy rows only, then with log-probabilities
    assert sum(c for c in engine.session.state.stats.evictions) > 0
