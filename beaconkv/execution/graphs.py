"""The graph strategy: each device function recorded once per shape as a CUDA graph of its eager code, then replayed.

:class:`GraphExecutor` runs what :class:`~beaconkv.execution.CompiledExecutor` runs — the decode step, an
eviction over every layer, a policy's own device work — without ``torch.compile``: nothing is traced or
generated. The eager function is recorded as a graph and later calls of the same shape replay it: one
launch instead of hundreds of kernel launches per step, and a first token within seconds of loading a
model instead of minutes of inductor code generation.

The protocol (what a ``torch.cuda.CUDAGraph`` needs, as in ``torch.cuda.make_graphed_callables``, gpt-fast's
reduce-overhead steps and vLLM's captured batch sizes):

* **a key per call**: the function, the shape, dtype and device of each tensor argument, the value of
  each plain argument (an int such as an eviction's kept count, a flag), and for every other argument
  (a model, a cache, a policy, its state) the object itself and its host flags — the values of its
  attributes that are booleans, strings, enums, None or small frozen settings (a
  :class:`~beaconkv.sampling.SamplingMode`). The function's Python branches read these when it is
  recorded and are baked into the graph, so a changed flag is another key. Building the key is the host's
  whole per-call cost besides the copies (a 36-layer step with BeaconKV's 36 observers: 40-80 µs on this
  project's busy 2-core machine; which attributes are flags is decided once per type);
* **eager until a key repeats**: the first call of a key runs eagerly (a prompt length met once is
  never recorded, and whatever a function makes lazily on its first call — a table it caches — is made by a
  real run, not by a capture that executes nothing), the next records (:attr:`GraphExecutor.record_after`);
* **static inputs**: tensor arguments are copied into buffers the graph owns before every replay
  (device-to-device copies, no host wait); arguments the function writes in place are copied back
  after it. The tensors an argument *object* holds (the cache, the policy's state, the sampling
  tensors) are read and written where they are: they must never be rebound, only written in place —
  the contract :class:`~beaconkv.execution.Executor` already states for compiled graphs;
* **the recording run is the call's own run**: the recorder runs the function once for real (on CUDA on
  a side stream, which also warms up the libraries' workspaces) and returns its result, then records a
  second pass of the same code that executes nothing; each call therefore changes the state exactly once;
* **outputs are cloned**: a replay writes its outputs into the graph's own tensors, which the next replay
  overwrites;
* **no host wait inside**: a function that reads a tensor's value on the host cannot be recorded
  (:class:`GraphCaptureError`): the rule :func:`~beaconkv.execution.no_host_sync` checks.

The device-specific part is one small seam, :class:`~beaconkv.execution.recording.GraphRecorder`
(:mod:`beaconkv.execution.recording`, with :class:`~beaconkv.execution.recording.RecordedGraph` and
:class:`~beaconkv.execution.recording.GraphCaptureError`, all three still importable from here):
:class:`~beaconkv.execution.CUDAGraphRecorder` records ``torch.cuda.CUDAGraph`` s;
:class:`~beaconkv.execution.OpReplayRecorder` records the aten operations of the eager run and replays them on
the same tensors — the CPU stand-in that lets every
piece of this protocol run in the CPU tests (and tells on any machine whether a custom policy would
replay correctly as a CUDA graph).
"""

from __future__ import annotations

import dataclasses
import enum
import time
import warnings
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_map

from .base import Executor
from .compile_log import compile_logger, compile_subject, describe_call
from .cuda_graphs import CUDAGraphRecorder
from .op_replay import OpReplayRecorder
from .recording import GraphCaptureError, GraphRecorder, RecordedGraph

__all__ = ["GRAPH_LIMIT", "GraphCaptureError", "GraphExecutor", "GraphLimitWarning", "GraphRecorder", "RecordedGraph",
           "graph_recorder", "host_flags"]

GRAPH_LIMIT = 64
"""Most graphs one :class:`GraphExecutor` records (every shape of every function); once it holds this many,
a call of a new shape runs eagerly, with a :class:`GraphLimitWarning`."""


class GraphLimitWarning(UserWarning):
    """A :class:`GraphExecutor` holds :data:`GRAPH_LIMIT` graphs: calls of further shapes run eagerly."""


# ------------------------------------------------------------------------------------------------- keys
_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device, enum.Enum)
_FLAGS = (bool, str, type(None), enum.Enum)
_TENSOR, _ALIAS, _OBJECT = object(), object(), object()  # key markers


_SETTING_TYPES: dict[type, bool] = {}  # frozen dataclass types whose fields are plain values (checked once per type)
_FLAG_NAMES: dict[type, tuple[str, ...]] = {}  # per type: the attributes that held a flag when first seen
_NOT_A_FLAG = object()


def _is_setting(value: Any) -> bool:
    """A frozen dataclass whose fields are plain values (a sampling mode, a schedule's settings)."""
    kind = type(value)
    setting = _SETTING_TYPES.get(kind)
    if setting is None:
        params = getattr(kind, "__dataclass_params__", None)
        setting = _SETTING_TYPES[kind] = bool(
            params is not None and params.frozen
            and all(isinstance(getattr(value, f.name), _PLAIN) for f in dataclasses.fields(value)))
    return setting


def _flag(value: Any) -> Any:
    if value is None or type(value) in (bool, str) or isinstance(value, enum.Enum) or _is_setting(value):
        return value
    return _NOT_A_FLAG


def host_flags(obj: Any) -> tuple[Any, ...]:
    """The host values of ``obj``'s attributes that a device function may branch on, and that a recorded graph
    therefore bakes in: booleans, strings, enums, None, and frozen settings of plain values (a
    :class:`~beaconkv.sampling.SamplingMode`).

    Which attributes count is decided once per type, from the first object of that type seen (an attribute
    holding something else later reads as "not a flag"). Counters (ints, floats) and containers are left out:
    a device function must never read them (they change every step; under ``torch.compile`` each change would
    recompile).
    """
    attributes = getattr(obj, "__dict__", None)
    if not attributes:
        return ()
    names = _FLAG_NAMES.get(type(obj))
    if names is None:
        names = _FLAG_NAMES[type(obj)] = tuple(n for n, v in attributes.items() if _flag(v) is not _NOT_A_FLAG)
    return tuple([_flag(attributes.get(n)) for n in names])


_PLAIN_TYPES = frozenset({bool, int, float, str, type(None), torch.dtype, torch.device, torch.Size})


def _signature(x: Any, tensors: list[Tensor], objects: list[Any], seen: dict[int, int]) -> Hashable:
    """The key of one argument; its tensors (in order) and objects are appended to the lists."""
    kind = type(x)
    if kind in _PLAIN_TYPES:
        return kind, x
    if isinstance(x, Tensor):
        first = seen.get(id(x))
        if first is not None:  # the same tensor passed twice: one buffer (the key says so)
            return _ALIAS, first
        seen[id(x)] = len(tensors)
        tensors.append(x)
        return _TENSOR, x.shape, x.dtype, x.device
    if isinstance(x, (tuple, list)):  # named tuples too
        return kind, tuple([_signature(v, tensors, objects, seen) for v in x])
    if isinstance(x, enum.Enum):
        return kind, x
    objects.append(x)
    return _OBJECT, id(x), host_flags(x)


def _substitute(x: Any, buffers: Iterator[Tensor], seen: dict[int, Tensor]) -> Any:
    """``x`` with each tensor replaced by the next static buffer (in :func:`_signature`'s order)."""
    if isinstance(x, Tensor):
        if id(x) not in seen:
            seen[id(x)] = next(buffers)
        return seen[id(x)]
    if isinstance(x, (tuple, list)):
        items = [_substitute(v, buffers, seen) for v in x]
        return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)
    return x


def _clone(out: Any) -> Any:
    return tree_map(lambda x: x.clone() if isinstance(x, Tensor) else x, out)


class _WriteWatch(torch.utils._python_dispatch.TorchDispatchMode):
    """Notes which static input buffers the recorded function writes in place (from each operation's schema)."""

    def __init__(self, buffers: list[Tensor]) -> None:
        super().__init__()
        self.storages = {b.untyped_storage().data_ptr(): i for i, b in enumerate(buffers) if b.numel()}
        self.written: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if self.storages:
            for i, argument in enumerate(func._schema.arguments):
                if argument.alias_info is None or not argument.alias_info.is_write:
                    continue
                value = args[i] if i < len(args) else kwargs.get(argument.name)
                for t in value if isinstance(value, (list, tuple)) else (value,):
                    if isinstance(t, Tensor) and t.numel():
                        j = self.storages.get(t.untyped_storage().data_ptr())
                        if j is not None:
                            self.written.add(j)
        return func(*args, **kwargs)


@dataclasses.dataclass
class _Entry:
    """One recorded shape of one function."""

    graph: RecordedGraph
    buffers: list[Tensor]  # static inputs, one per distinct tensor argument, in the call's order
    written: list[int]  # those the function writes in place: copied back to the caller's tensors
    objects: list[Any]  # the argument objects, kept alive: the key holds their ids

    def replay(self, tensors: list[Tensor]) -> Any:
        for buffer, t in zip(self.buffers, tensors):
            buffer.copy_(t)
        self.graph.replay()
        for i in self.written:
            tensors[i].copy_(self.buffers[i])
        return _clone(self.graph.outputs)


class GraphExecutor(Executor):
    """Runs every function as a recorded graph of its eager code, replayed per shape (see the module docstring).

    Args:
        recorder: Records graphs on the device (:func:`graph_recorder` picks the device's).
        record_after: Eager calls of a key before it is recorded (1: the second call records; 0: the first).
        max_graphs: Most graphs held (:data:`GRAPH_LIMIT`).

    Attributes:
        recorder: The recorder.
        graphs: The recorded graphs by key (see the module docstring).
        replays: Calls served by a replay.
        eager_calls: Calls that ran eagerly (a key's first calls, or the limit reached).

    Raises:
        ValueError: ``record_after`` or ``max_graphs`` below 0.
    """

    compiled = True
    layerwise = False  # one graph per eviction over every layer: one replay
    decode_shape = "whole"  # the eager step, every layer in one graph

    def __init__(self, recorder: GraphRecorder, *, record_after: int = 1, max_graphs: int = GRAPH_LIMIT) -> None:
        super().__init__()
        for name, value in (("record_after", record_after), ("max_graphs", max_graphs)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r} must be an int >= 0.")
        self.recorder, self.record_after, self.max_graphs = recorder, record_after, max_graphs
        self.graphs: dict[Hashable, _Entry] = {}
        self.replays = 0
        self.eager_calls = 0
        self._seen: dict[Hashable, int] = {}
        self._warned = False

    def prepare(self, *objects: Any) -> None:
        """Nothing to mark: the graphs read and write the tensors of ``objects`` (caches, states, sampling
        tensors) at the addresses they had when recorded; those tensors are only ever written in place."""

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        self.calls[fn.__qualname__] += 1
        tensors: list[Tensor] = []
        objects: list[Any] = []
        key = (fn, tuple(_signature(a, tensors, objects, {}) for a in args))
        entry = self.graphs.get(key)
        if entry is not None:
            self.replays += 1
            return entry.replay(tensors)
        seen = self._seen.get(key, 0)
        if seen < self.record_after or len(self.graphs) >= self.max_graphs:
            if len(self._seen) > 16 * GRAPH_LIMIT:  # keys met once (prompt lengths): forget them
                self._seen.clear()
            self._seen[key] = seen + 1
            if len(self.graphs) >= self.max_graphs and not self._warned:
                self._warned = True
                warnings.warn(f"{len(self.graphs)} graphs recorded (the limit): {fn.__qualname__} and every further "
                              "new shape run eagerly from now on.", GraphLimitWarning, stacklevel=2)
            self.eager_calls += 1
            return fn(*args)
        self._seen.pop(key, None)
        t0 = time.perf_counter()
        compile_logger.info("recording %s as a graph…", compile_subject(fn, args))
        entry, out = self._record(fn, args, tensors, objects)
        self.graphs[key] = entry
        seconds = time.perf_counter() - t0
        compile_logger.info("recorded %s in %.1f s", compile_subject(fn, args), seconds)
        self.compile_s += seconds
        self.compile_seconds[fn.__qualname__] += seconds
        self.compiles += 1
        return out

    def _record(self, fn: Callable[..., Any], args: tuple[Any, ...], tensors: list[Tensor],
                objects: list[Any]) -> tuple[_Entry, Any]:
        buffers = [t.clone() for t in tensors]
        static_args = _substitute(args, iter(buffers), {})
        watch = _WriteWatch(buffers)
        try:
            with watch:
                out, graph = self.recorder.record(lambda: fn(*static_args))
        except GraphCaptureError as err:
            raise GraphCaptureError(f"{describe_call(fn, args)}: {err}") from err
        written = sorted(watch.written)
        for i in written:  # the recording run was the call's own run: its writes reach the caller's tensors
            tensors[i].copy_(buffers[i])
        return _Entry(graph, buffers, written, objects), out


def graph_recorder(device: torch.device | str, kind: str = "cuda") -> GraphRecorder:
    """The recorder of ``device``: :class:`~beaconkv.execution.CUDAGraphRecorder` (``kind="cuda"``), or
    :class:`~beaconkv.execution.OpReplayRecorder` on any device (``kind="op_replay"``).

    Raises:
        GraphCaptureError: CUDA graphs on another device (on a CPU the compiled strategy runs,
            ``CompileConfig(strategy="compile")``).
        ValueError: An unknown ``kind``.
    """
    device = torch.device(device)
    if kind == "op_replay":
        return OpReplayRecorder()
    if kind != "cuda":
        raise ValueError(f"kind={kind!r}: choose 'cuda' or 'op_replay'.")
    if device.type != "cuda":
        raise GraphCaptureError(
            f"CUDA graphs need a CUDA device; got {device}. Use CompileConfig(strategy='compile') (torch.compile, "
            "the CPU default) or compile=False; OpReplayRecorder replays recorded graphs on any device for tests.")
    return CUDAGraphRecorder(device)
