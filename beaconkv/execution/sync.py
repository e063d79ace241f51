"""A guard that fails on every operation that would make the host wait for the device.

The decode step and an eviction must never synchronise the host with the device: on a GPU each sync
stalls the CPU until the queued kernels finish, which costs more than most policies' work, and a
CUDA graph cannot hold one. On a GPU ``torch.cuda.set_sync_debug_mode("error")`` catches them; on a
CPU nothing waits, so a sync slips through every CPU test unnoticed. :func:`no_host_sync` makes the
same check on any device: inside it, each operation that needs a tensor's *value* on the host raises
:class:`HostSyncError` naming the operation:

* ``.item()``, ``bool(t)``, ``int(t)``, ``float(t)``, ``if t:`` (``aten._local_scalar_dense``),
  ``torch.equal``, ``.tolist()``, ``.numpy()``, ``.cpu()``;
* operations whose output shape depends on values: ``nonzero`` / ``torch.where(mask)``,
  ``masked_select``, boolean-mask indexing (``t[mask]``, ``t[mask] = v``), ``unique``,
  ``bincount``, ``repeat_interleave`` without ``output_size``;
* a copy from a device to the host (``.to("cpu")`` of a device tensor).

Copies *to* the device (a pinned host tensor ``.to(device, non_blocking=True)``) and reads of
Python-side state (lists of counts) are fine. Use it around a policy's decode-time work to check
that a custom policy will run sync-free (and CUDA-graph-able) on a GPU::

    with no_host_sync():
        for _ in range(steps):
            tokens = session.step(tokens, sampling)

Compiled graphs are checked too where their operations pass through the dispatcher
(``backend="aot_eager"``); inductor's generated kernels do not, but a graph compiled with
``fullgraph=True`` cannot hold a host sync in the first place.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import BeaconKVError

__all__ = ["HostSyncError", "no_host_sync"]

aten = torch.ops.aten


class HostSyncError(BeaconKVError, RuntimeError):
    """An operation inside :func:`no_host_sync` would make the host wait for the device."""


_ALWAYS = {
    aten._local_scalar_dense: "reads a tensor's value on the host (.item(), bool(t), int(t), if t:)",
    aten.equal: "returns a host bool (torch.equal)",
    aten.is_nonzero: "returns a host bool",
    aten.nonzero: "has a value-dependent shape (nonzero / torch.where(mask)); use a fixed-size mask or topk",
    aten.masked_select: "has a value-dependent shape (masked_select); use torch.where",
    aten._unique: "has a value-dependent shape (unique)",
    aten._unique2: "has a value-dependent shape (unique)",
    aten.unique_dim: "has a value-dependent shape (unique)",
    aten.unique_consecutive: "has a value-dependent shape (unique_consecutive)",
    aten.unique_dim_consecutive: "has a value-dependent shape (unique_consecutive)",
    aten.bincount: "has a value-dependent shape (bincount)",
}
_INDEXING = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
_MASKS = (torch.bool, torch.uint8)


def _reason(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """Why calling ``func`` on these arguments syncs, or ``None``."""
    packet = func.overloadpacket
    if packet in _ALWAYS:
        return _ALWAYS[packet]
    if packet in _INDEXING:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(isinstance(i, torch.Tensor) and i.dtype in _MASKS for i in indices):
            return "indexes with a boolean mask (a value-dependent shape); use torch.where or an index tensor"
    if packet is aten.repeat_interleave and func is not aten.repeat_interleave.self_int:
        if kwargs.get("output_size") is None:  # tensor repeats: the output length is their sum
            return "has a value-dependent shape (repeat_interleave without output_size)"
    if packet is aten._to_copy:
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cpu" and args[0].device.type != "cpu":
            return f"copies from {args[0].device} to the host"
    if packet is aten.copy_ and args[0].device.type == "cpu" and args[1].device.type != "cpu":
        return f"copies from {args[1].device} to the host"
    return None


class _NoHostSyncMode(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        reason = _reason(func, args, kwargs)
        if reason is not None:
            raise HostSyncError(f"{func} {reason}: the host would wait for the device here.")
        return func(*args, **kwargs)


def _refuse(name: str, why: str) -> Any:
    def method(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        raise HostSyncError(f"Tensor.{name}() {why}: the host would wait for the device here.")

    return method


_HOST_READS = {
    "tolist": "reads a tensor's values on the host",
    "numpy": "reads a tensor's values on the host",
    "__array__": "reads a tensor's values on the host (numpy conversion)",
    "cpu": "copies a tensor to the host",
}


@contextlib.contextmanager
def no_host_sync() -> Iterator[None]:
    """Raise :class:`HostSyncError` on any operation that would make the host wait for the device.

    See the module docstring for what counts. Not thread-safe: the host-read methods of
    :class:`torch.Tensor` are replaced for the duration (on every thread).

    Raises:
        HostSyncError: Inside the block, at the first such operation.
    """
    saved = {name: getattr(torch.Tensor, name) for name in _HOST_READS}
    try:
        for name, why in _HOST_READS.items():
            setattr(torch.Tensor, name, _refuse(name, why))
        with _NoHostSyncMode():
            yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)
