"""The execution-strategy interface, and the eager strategy."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any


class Executor:
    """Runs device functions: ``run(fn, *args)`` returns ``fn(*args)``, however it is computed.

    A device function reads and writes tensors only — its arguments, the tensors of objects it is
    handed (a cache, a policy state), and the constant settings of a policy — and never reads a
    tensor's value on the host. That is what lets a compiled strategy capture it as one graph.

    Attributes:
        compiled: Whether functions run as compiled graphs.
        layerwise: Whether per-layer work (an eviction) should be called once per layer (one small graph
            reused by every layer) rather than as one whole-model call.
        decode_shape: How a decode step runs: ``"eager"``, or a compiled shape (see
            :meth:`~beaconkv.execution.CompileConfig.decode_shape`).
        calls: How many times each function (by qualified name) ran.
        compile_s: Wall seconds of the calls that compiled a graph (0 when nothing compiles).
        compile_seconds: The same seconds by function (qualified name).
        compiles: Graphs compiled by this executor's calls (recompiles included).
    """

    compiled: bool = False
    layerwise: bool = True
    decode_shape: str = "eager"

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.compile_s = 0.0
        self.compile_seconds: Counter[str] = Counter()
        self.compiles = 0

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Runs ``fn(*args)``; returns what it returns (fresh tensors the caller may keep)."""
        self.calls[fn.__qualname__] += 1
        return fn(*args)

    def prepare(self, *objects: Any) -> None:
        """Called once with the objects whose tensors the functions will write in place (caches, states).

        The eager strategy needs nothing; a CUDA-graph strategy marks their tensors as static addresses.
        """


class EagerExecutor(Executor):
    """Calls every function as it is (PyTorch eager mode)."""
