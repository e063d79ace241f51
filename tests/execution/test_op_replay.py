"""The op-replay recorder (:mod:`beaconkv.execution.op_replay`): a CUDA graph's replay semantics on the CPU — the
recorded operations only, on the same tensors, into outputs the graph owns — so that what a CUDA graph would get
wrong goes wrong in the CPU tests too."""

from __future__ import annotations

import functools

import pytest
import torch

from beaconkv.execution import CompileError, GraphCaptureError, GraphExecutor, OpReplayRecorder

from .device_functions import Store, write_and_read

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_recorded_graph_replays_its_operations_on_the_same_tensors():
    store, x = Store(), torch.ones(3)
    out, graph = OpReplayRecorder().record(lambda: write_and_read(store, x, 1.0))
    assert int(store.count) == 1  # recording is one real run
    # the graph's own outputs: garbage until a replay
    assert graph.outputs is not out and torch.isnan(graph.outputs).all()
    x.fill_(2.0)  # a new input, in the buffer the graph reads
    graph.replay()
    ref = Store()
    write_and_read(ref, torch.ones(3), 1.0)
    torch.testing.assert_close(graph.outputs, write_and_read(ref, torch.full((3,), 2.0), 1.0))
    assert int(store.count) == 2


def test_what_a_cuda_graph_would_get_wrong_goes_wrong_here_too():
    """A device function that reads a changing host value bakes it in: the replay repeats the recording's value
    (the executor's key sees flags, not counters), exactly as a CUDA graph would."""
    def reads_a_counter(store: Store) -> torch.Tensor:
        return store.buf + store.steps  # store.steps is host state that changes: a contract violation

    store = Store()
    executor = GraphExecutor(OpReplayRecorder(), record_after=0)
    seen = []
    for step in range(3):
        store.steps = step
        seen.append(executor.run(reads_a_counter, store)[0].item())
    assert seen == [0.0, 0.0, 0.0]  # eagerly it would be [0, 1, 2]


def test_a_host_wait_cannot_be_recorded():
    def syncs(x: torch.Tensor) -> torch.Tensor:
        return x * x.sum().item()

    executor = GraphExecutor(OpReplayRecorder(), record_after=0)
    with pytest.raises(GraphCaptureError, match=r"syncs: .*_local_scalar_dense.*host") as info:
        executor.run(syncs, torch.ones(2))
    assert isinstance(info.value, CompileError)
    with pytest.raises(GraphCaptureError, match="nonzero"):
        OpReplayRecorder().record(lambda: torch.ones(3).nonzero())
    # a tensor of host data made inside: on CUDA a host-to-device copy, which a capture cannot hold either
    with pytest.raises(GraphCaptureError, match=r"torch.tensor\(...\) of host data"):
        OpReplayRecorder().record(lambda: torch.ones(3) + torch.tensor([1.0, 2.0, 3.0]))


def test_a_replay_that_reads_a_freed_tensor_raises():
    buf = torch.zeros(6)
    _, graph = OpReplayRecorder().record(functools.partial(torch.add, buf, 1.0))  # nothing else holds the call
    graph.replay()
    del buf  # the only reference: a CUDA graph would now read freed memory
    with pytest.raises(GraphCaptureError, match="freed"):
        graph.replay()


