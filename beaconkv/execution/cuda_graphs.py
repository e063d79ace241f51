"""Recording a device function as a ``torch.cuda.CUDAGraph``: the CUDA side of
:class:`~beaconkv.execution.GraphExecutor`.

:meth:`CUDAGraphRecorder.record` does, once per shape:

1. **the warm-up, which is the call's own run**: the function runs eagerly on the recorder's side stream
   (after that stream waited for the current one), so that lazily created library state — cuBLAS
   handles and workspaces, attention kernels' choices — exists before capture, on the stream that
   captures; its outputs are marked as used by the current stream (``record_stream``), which goes on
   after them;
2. **the capture**: ``torch.cuda.graph`` on the same side stream, into one memory pool shared by every
   graph of the recorder (the graphs never run concurrently, and each keeps its outputs alive, so a later
   capture reuses only an earlier graph's dead intermediates). Capture executes nothing. It starts with one
   ``torch.cuda.synchronize()`` (torch's own), once per shape: the replays never wait. CUDA's sync debug
   mode is paused for the capture only;
3. **replay**: ``CUDAGraph.replay()`` queues the whole graph on the current stream.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_leaves

from .recording import GraphCaptureError, GraphRecorder, RecordedGraph

__all__ = ["CUDAGraphRecorder", "CUDARecordedGraph"]


class CUDARecordedGraph(RecordedGraph):
    """A captured ``torch.cuda.CUDAGraph`` and the output tensors it writes.

    Args:
        graph: The captured graph.
        outputs: The tensors the capture returned (allocated in the graph's pool).
    """

    def __init__(self, graph: torch.cuda.CUDAGraph, outputs: Any) -> None:
        self.graph, self.outputs = graph, outputs

    def replay(self) -> None:
        """Queues the graph on the current stream."""
        self.graph.replay()


class CUDAGraphRecorder(GraphRecorder):
    """Records functions as CUDA graphs on one device (see the module docstring).

    Args:
        device: A CUDA device.
        capture_error_mode: ``torch.cuda.graph``'s: ``"thread_local"`` (the default here) lets other threads of a
            server (a tokenizer's, an HTTP loop's) use CUDA during a capture; ``"global"`` forbids it.

    Raises:
        GraphCaptureError: No CUDA device.
    """

    def __init__(self, device: torch.device | str = "cuda", capture_error_mode: str = "thread_local") -> None:
        if not torch.cuda.is_available():
            raise GraphCaptureError("CUDA graphs need a CUDA device and this torch sees none "
                                    f"(torch {torch.__version__}, CUDA {torch.version.cuda}).")
        self.device = torch.device(device)
        self.capture_error_mode = capture_error_mode
        with torch.cuda.device(self.device):
            self.stream = torch.cuda.Stream(self.device)
            self.pool = torch.cuda.graph_pool_handle()

    def record(self, fn: Callable[[], Any]) -> tuple[Any, RecordedGraph]:
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            out = fn()  # the warm-up: the call's own eager run
        current.wait_stream(self.stream)
        for t in tree_leaves(out):
            if isinstance(t, Tensor) and t.is_cuda:
                t.record_stream(current)  # allocated on the side stream, used on the current one from now on
        graph = torch.cuda.CUDAGraph()
        debug_mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode(0)  # torch.cuda.graph synchronises once before capturing
        try:
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream,
                                  capture_error_mode=self.capture_error_mode):
                static = fn()
        except Exception as err:
            raise GraphCaptureError(f"CUDA graph capture failed: {type(err).__name__}: {str(err).strip()[:1500]}. "
                                    "Nothing fell back to eager; run it with CompileConfig(strategy='compile') or "
                                    "compile=False.") from err
        finally:
            torch.cuda.set_sync_debug_mode(debug_mode)
        return out, CUDARecordedGraph(graph, static)
