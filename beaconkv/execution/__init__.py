"""How the device work of decoding runs: eagerly, or as ``torch.compile`` graphs — one injected strategy.

The decode loop and every policy hand their device work (the decode step, an eviction's score +
select + compact, BeaconKV's query sampling...) to an :class:`Executor` as plain functions over
explicit tensors and state. :class:`EagerExecutor` calls them; :class:`CompiledExecutor` compiles each
once (``fullgraph=True``; CUDA graphs on CUDA, inductor on CPU) and calls the graph. The same
functions run on the same state either way, so nothing here knows any policy.
:func:`no_host_sync` checks, on any device, that such work never makes the host wait for the device.
"""

from .base import EagerExecutor, Executor
from .compiled import (
    CPU_GEMV_LIMITS,
    CompileConfig,
    CompiledExecutor,
    CompileError,
    RecompileWarning,
    lift_cpu_gemv_limit,
    make_executor,
    resolve_compile_config,
)
from .sync import HostSyncError, no_host_sync

__all__ = [
    "CPU_GEMV_LIMITS", "CompileConfig", "CompileError", "CompiledExecutor", "EagerExecutor", "Executor",
    "HostSyncError", "RecompileWarning", "lift_cpu_gemv_limit", "make_executor", "no_host_sync", "resolve_compile_config",
]
