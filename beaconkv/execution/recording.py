"""The seam between :class:`~beaconkv.execution.GraphExecutor` and a device: a recorder, the graph it records,
and the error it raises.

:class:`GraphRecorder` records a function as a replayable :class:`RecordedGraph`;
:class:`~beaconkv.execution.CUDAGraphRecorder` (``torch.cuda.CUDAGraph``) and
:class:`~beaconkv.execution.OpReplayRecorder` (the recorded aten operations, on any device) implement it. The
executor (:mod:`beaconkv.execution.graphs`) and the recorders import these from here, so neither imports the
other for them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .compile_log import CompileError

__all__ = ["GraphCaptureError", "GraphRecorder", "RecordedGraph"]


class GraphCaptureError(CompileError):
    """A device function could not be recorded as a graph (a host read of a tensor's value, an operation the
    device cannot record, no CUDA device); nothing fell back to eager. A :class:`~beaconkv.execution.CompileError`:
    whoever handles a failed compile handles this too."""


class RecordedGraph:
    """A recorded graph: :meth:`replay` repeats the recorded device work on the same tensors and writes its
    results into :attr:`outputs`.

    Attributes:
        outputs: What the recorded function returned, as tensors the graph owns (overwritten by each replay).
    """

    outputs: Any = None

    def replay(self) -> None:
        """Runs the recorded work again (on CUDA: queued on the current stream; the host does not wait)."""
        raise NotImplementedError


class GraphRecorder:
    """The seam between :class:`~beaconkv.execution.GraphExecutor` and a device: records a function as a
    replayable graph."""

    def record(self, fn: Callable[[], Any]) -> tuple[Any, RecordedGraph]:
        """Runs ``fn()`` once for real and records it as a graph.

        Args:
            fn: The call to record, over the executor's static input buffers.

        Returns:
            ``(outputs of the real run — the call's result, the recorded graph)``.

        Raises:
            GraphCaptureError: ``fn`` cannot be recorded (the real run's own exceptions propagate as they are).
        """
        raise NotImplementedError
