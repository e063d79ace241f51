"""How the device work of decoding runs: eagerly, as recorded CUDA graphs, or as ``torch.compile`` graphs — one
injected strategy.

The decode loop and every policy hand their device work (the decode step, an eviction's score +
select + compact, BeaconKV's query sampling...) to an :class:`Executor` as plain functions over
explicit tensors and state. :class:`EagerExecutor` calls them; :class:`GraphExecutor` records each one's
eager code once per shape as a CUDA graph and replays it (the CUDA default: no code generation);
:class:`CompiledExecutor` compiles each once with ``torch.compile(fullgraph=True)`` (inductor: the CPU
default) and calls the graph. The same functions run on the same state either way, so nothing here knows
any policy. :func:`no_host_sync` checks, on any device, that such work never makes the host wait for the
device, and :class:`OpReplayRecorder` replays recorded graphs on any device with a CUDA graph's semantics.
"""

from .base import EagerExecutor, Executor
from .compiled import (
    CPU_GEMV_LIMITS,
    STRATEGIES,
    CompileConfig,
    CompiledExecutor,
    CompileError,
    RecompileWarning,
    lift_cpu_gemv_limit,
    make_executor,
    resolve_compile_config,
)
from .cuda_graphs import CUDAGraphRecorder
from .graphs import (
    GRAPH_LIMIT,
    GraphCaptureError,
    GraphExecutor,
    GraphLimitWarning,
    GraphRecorder,
    RecordedGraph,
    graph_recorder,
)
from .op_replay import OpReplayRecorder
from .sync import HostSyncError, no_host_sync

__all__ = [
    "CPU_GEMV_LIMITS", "GRAPH_LIMIT", "STRATEGIES", "CUDAGraphRecorder", "CompileConfig", "CompileError",
    "CompiledExecutor", "EagerExecutor", "Executor", "GraphCaptureError", "GraphExecutor", "GraphLimitWarning",
    "GraphRecorder", "HostSyncError", "OpReplayRecorder", "RecompileWarning", "RecordedGraph", "graph_recorder",
    "lift_cpu_gemv_limit", "make_executor", "no_host_sync", "resolve_compile_config",
]
