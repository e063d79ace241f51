"""The CUDA recorder (:mod:`beaconkv.execution.cuda_graphs`): real ``torch.cuda.CUDAGraph`` capture and replay of the
eager decode step and evictions. Each test runs twice: on a CUDA device with the real recorder, and on the CPU
with the op-replay recorder behind the same seam (the same protocol, checked where no GPU is lent)."""

from __future__ import annotations

import pytest
import torch

import beaconkv
from beaconkv.execution import (
    CompileConfig,
    CUDAGraphRecorder,
    GraphCaptureError,
    GraphExecutor,
    OpReplayRecorder,
)
from beaconkv.policies import BeaconKV

from .device_functions import Store, write_and_read

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.cuda]

NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
RECORDERS = ["cpu", pytest.param("cuda", marks=NO_CUDA)]


@pytest.fixture(params=RECORDERS)
def device(request) -> str:
    """``"cuda"``: the real recorder; ``"cpu"``: the op-replay recorder in its place."""
    return request.param


def _recorder(device: str):
    return CUDAGraphRecorder(device) if device == "cuda" else OpReplayRecorder()


def test_replays_write_in_place_and_return_fresh_outputs(device):
    eager_store, graph_store = Store(), Store()
    graph_store.buf, graph_store.count = graph_store.buf.to(device), graph_store.count.to(device)
    executor = GraphExecutor(_recorder(device))
    g = torch.Generator().manual_seed(0)
    outs = []
    for _ in range(6):
        x = torch.randn(3, generator=g)
        ref = write_and_read(eager_store, x, 0.5)
        outs.append(executor.run(write_and_read, graph_store, x.to(device), 0.5))
        torch.testing.assert_close(outs[-1].cpu(), ref)
    assert executor.replays == 4 and len(executor.graphs) == 1
    torch.testing.assert_close(graph_store.buf.cpu(), eager_store.buf)
    assert len({o.data_ptr() for o in outs}) == len(outs)  # cloned: no replay overwrote an earlier output


def test_a_host_wait_inside_cannot_be_recorded(device):
    def syncs(x: torch.Tensor) -> torch.Tensor:
        return x * x.sum().item()

    executor = GraphExecutor(_recorder(device), record_after=0)
    with pytest.raises(GraphCaptureError, match="syncs"):
        executor.run(syncs, torch.ones(2, device=device))


@pytest.mark.parametrize("name", ["full", "beacon"])
def test_recorded_decode_gives_the_eager_tokens_and_kept_positions(tiny_models, device, name):
    """``compile=True`` on CUDA records the eager step and the evictions as CUDA graphs (no inductor)."""
    model = beaconkv.load_model(tiny_models["llama"][0], device=device)
    config = True if device == "cuda" else CompileConfig(strategy="graphs", recorder="op_replay")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (5, 12)]

    def run(compile_config):
        policy = None if name == "full" else BeaconKV(32, n_recent=4, n_beacon=4, n_prefix=2, telemetry=True)
        return beaconkv.generate(model, None, prompts, max_new_tokens=72, eos_token_ids=[], policy=policy,
                                 compile=compile_config)

    eager, graph = run(False), run(config)
    assert graph.token_ids == eager.token_ids
    kept = [[(r.step, r.layer, r.rows, r.kept_positions.tolist()) for r in out.telemetry] for out in (eager, graph)]
    assert kept[0] == kept[1]
    executor = graph.policy_state.executor
    assert isinstance(executor, GraphExecutor) and executor.replays > 60
    assert isinstance(executor.recorder, CUDAGraphRecorder if device == "cuda" else OpReplayRecorder)
    if name == "beacon":
        assert graph.stats.compiled_evictions == eager.policy_state.stats.eviction_calls > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_inductor_stays_selectable_on_cuda(tiny_models):
    """``CompileConfig(strategy="compile")``: inductor with its own CUDA graphs (``mode="reduce-overhead"``), the
    option that must measure faster than the recorded eager step to become the CUDA default."""
    from beaconkv.execution import CompiledExecutor

    model = beaconkv.load_model(tiny_models["llama"][0], device="cuda")
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    eager = beaconkv.generate(model, None, prompts, max_new_tokens=24, eos_token_ids=[])
    compiled = beaconkv.generate(model, None, prompts, max_new_tokens=24, eos_token_ids=[],
                                 compile=CompileConfig(strategy="compile"))
    assert compiled.token_ids == eager.token_ids
    assert isinstance(compiled.policy_state.executor, CompiledExecutor)
