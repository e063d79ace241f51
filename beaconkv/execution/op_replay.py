"""Recorded graphs on any device: the aten operations of one eager run, replayed on the same tensors.

:class:`OpReplayRecorder` is the CPU stand-in of :class:`~beaconkv.execution.CUDAGraphRecorder` behind the
same seam (:class:`~beaconkv.execution.GraphRecorder`), and replays with a CUDA graph's semantics:

* the function runs once, for real, under a dispatch mode that writes down every operation it dispatches
  (the operation, its arguments, which earlier operation made each tensor argument) — its Python code,
  its branches on host values and its Python numbers are *not* run again: a replay runs the operations
  only, with the numbers of the recording, as a CUDA graph replays its kernels;
* a tensor the function did not make (a static input buffer, a cache, a weight) is read and written in
  place at every replay, as a CUDA graph reads and writes fixed addresses; it is held weakly, and a
  replay that finds it freed raises (on CUDA the graph would read freed memory);
* the outputs are tensors of the graph, filled with garbage (NaN, -1, True) until the first replay and
  overwritten by each one, as a CUDA graph's outputs are;
* an operation that reads a value on the host (``.item()``, ``nonzero``...; see
  :func:`~beaconkv.execution.no_host_sync`) cannot be recorded, as a CUDA capture cannot hold one; nor can
  ``torch.tensor(...)`` of host data, which on CUDA is a host-to-device copy a capture cannot hold.

So a runner that forgets to copy a new input into the graph's buffer, to clone an output, or to record a new
shape again, or a device function that bakes a changing host value into its graph, gives wrong results here,
on a CPU, as it would on a GPU. It is slow (a Python call per operation): a checking tool, not a speed-up.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
from torch.utils._python_dispatch import TorchDispatchMode

from .recording import GraphCaptureError, GraphRecorder, RecordedGraph
from .sync import _reason

__all__ = ["OpReplayGraph", "OpReplayRecorder"]

aten = torch.ops.aten
_FROM_HOST = {aten.lift_fresh, aten.lift_fresh_copy}  # torch.tensor(data) inside the function


class _Slot:
    """A tensor an earlier operation of the recording made (its index in the replay's environment)."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


class _External:
    """A tensor the recording did not make, read and written in place at each replay (held weakly)."""

    __slots__ = ("ref", "what")

    def __init__(self, t: Tensor) -> None:
        self.ref = weakref.ref(t)
        self.what = f"{tuple(t.shape)} {t.dtype}"

    def get(self) -> Tensor:
        t = self.ref()
        if t is None:
            raise GraphCaptureError(f"a replay reads a tensor ({self.what}) that was freed after the recording; a "
                                    "CUDA graph would read freed memory: keep every tensor a graph reads alive.")
        return t


def _garbage(t: Tensor) -> Tensor:
    """A tensor like ``t`` holding what an unreplayed graph output holds: nothing meaningful."""
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return torch.full_like(t, float("nan"))
    return torch.full_like(t, True) if t.dtype == torch.bool else torch.full_like(t, -1)


class OpReplayGraph(RecordedGraph):
    """The operations of one recorded run (see the module docstring).

    Attributes:
        steps: ``(operation, argument template, keyword template, output slots)`` per dispatched operation.
        outputs: The graph's output tensors (see :class:`~beaconkv.execution.RecordedGraph`).
    """

    def __init__(self, steps: list[tuple[Any, Any, Any, list[int | None]]], n_slots: int, out: Any,
                 refs: list[Any]) -> None:
        self.steps, self._n_slots = steps, n_slots
        leaves, spec = tree_flatten(out)
        self._out_refs = refs
        self.outputs = tree_unflatten([_garbage(t) if isinstance(r, _Slot) else (r.get() if isinstance(r, _External)
                                       else t) for t, r in zip(leaves, refs)], spec)
        self._out_leaves = tree_flatten(self.outputs)[0]

    def replay(self) -> None:
        """Runs every recorded operation again, then writes the results into :attr:`outputs`."""
        env: list[Any] = [None] * self._n_slots

        def resolve(x: Any) -> Any:
            if isinstance(x, _Slot):
                return env[x.index]
            return x.get() if isinstance(x, _External) else x

        for func, args, kwargs, slots in self.steps:
            out = func(*tree_map(resolve, args), **tree_map(resolve, kwargs))
            for value, slot in zip(tree_flatten(out)[0], slots):
                if slot is not None:
                    env[slot] = value
        for static, ref in zip(self._out_leaves, self._out_refs):
            if isinstance(ref, _Slot):
                static.copy_(env[ref.index])


class _Recording(TorchDispatchMode):
    """Runs every operation and writes it down."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[tuple[Any, Any, Any, list[int | None]]] = []
        self.made: dict[int, int] = {}  # id of a tensor an operation made -> its slot
        self.keep: list[Tensor] = []  # those tensors, alive while recording (their ids stay theirs)

    def template(self, x: Any) -> Any:
        if not isinstance(x, Tensor):
            return x
        slot = self.made.get(id(x))
        return _Slot(slot) if slot is not None else _External(x)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        reason = _reason(func, args, kwargs)
        if reason is not None:
            raise GraphCaptureError(f"{func} {reason}: a graph cannot hold a host wait.")
        if func.overloadpacket in _FROM_HOST:
            raise GraphCaptureError(
                "torch.tensor(...) of host data inside a recorded function: on CUDA a host-to-device copy that a "
                "capture cannot hold (and a replay would not repeat); make it outside and pass it in, or build it on "
                "the device (torch.full, torch.arange).")
        out = func(*args, **kwargs)
        inputs = {id(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)}
        slots: list[int | None] = []
        for value in tree_flatten(out)[0]:
            if not isinstance(value, Tensor):
                raise GraphCaptureError(f"{func} returns a host value ({type(value).__name__}): a graph cannot "
                                        "hand it to the host.")
            if id(value) in self.made or id(value) in inputs:  # an in-place operation returns its argument
                slots.append(None)
                continue
            self.made[id(value)] = len(self.keep)
            self.keep.append(value)
            slots.append(self.made[id(value)])
        self.steps.append((func, tree_map(self.template, args), tree_map(self.template, kwargs), slots))
        return out


class OpReplayRecorder(GraphRecorder):
    """Records the operations of a function's eager run and replays them (see the module docstring).

    Attributes:
        recorded: Graphs recorded so far.
    """

    def __init__(self) -> None:
        self.recorded = 0

    def record(self, fn: Callable[[], Any]) -> tuple[Any, RecordedGraph]:
        recording = _Recording()
        with recording:
            out = fn()
        refs = [recording.template(t) for t in tree_flatten(out)[0]]
        graph = OpReplayGraph(recording.steps, len(recording.keep), out, refs)
        self.recorded += 1
        return out, graph
