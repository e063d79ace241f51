"""The tensor-parallel process group: which rank this process is, the collectives its layers call, their timeout.

A :class:`TensorParallel` wraps one ``torch.distributed`` process group (gloo on the CPU, NCCL on CUDA)
whose ranks each hold one shard of the model (:mod:`beaconkv.distributed.plan`). It is the only object
the sharded layers (:mod:`beaconkv.distributed.layers`), the head-adaptive allocation's exchange
(:mod:`beaconkv.distributed.heads`) and the step mirror (:mod:`beaconkv.distributed.mirror`) talk to, and
it offers exactly the collectives they need: a sum (:meth:`TensorParallel.all_reduce`), a concatenation
(:meth:`TensorParallel.all_gather`), rank 0's broadcast of a step's inputs and a gather of objects to
rank 0. There is no transport of our own: every call is a ``torch.distributed`` collective.

**Never a hang.** The group is made with a timeout (:data:`DEFAULT_TIMEOUT_S`, or the caller's): a rank
that died makes the others' next collective fail (gloo notices the closed connection at once, and any
backend gives up at the timeout), and the launcher (:mod:`beaconkv.distributed.launch`) turns that into
one :class:`TensorParallelError` naming the rank.

In eager code :meth:`TensorParallel.all_reduce` sums in place with ``torch.distributed.all_reduce`` (half
the cost of a functional collective on the CPU: 0.56 ms against 1.1 ms per call on this project's 2-core
machine); while ``torch.compile`` traces it, or where autograd records, it uses the functional
collective, which dynamo traces and which allocates its result.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor

from ..errors import BeaconKVError

__all__ = ["DEFAULT_TIMEOUT_S", "IDLE_TIMEOUT_S", "TensorParallel", "TensorParallelError", "backend_for",
           "under_torchrun"]

DEFAULT_TIMEOUT_S = 600.0
"""Seconds a collective may wait for the other ranks before it fails (a dead or stuck rank). Long enough for
the slowest rank to load its shard and for rank 0 to tokenize between steps; the tests use a few seconds."""

IDLE_TIMEOUT_S = 7 * 24 * 3600.0
"""Seconds the other ranks wait for rank 0's next call (a server with no request for a while) before they give
up. Rank 0's calls travel on a gloo group of their own with this timeout; a rank 0 that dies is still noticed
at once (its connections close)."""


class TensorParallelError(BeaconKVError, RuntimeError):
    """Tensor parallelism cannot run as asked: a size the model cannot be split by, a rank that failed or
    died (the message names it), or a setting tensor parallelism does not support."""


def backend_for(device: torch.device | str) -> str:
    """The ``torch.distributed`` backend for ``device``: ``"nccl"`` on CUDA, ``"gloo"`` elsewhere."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def under_torchrun() -> bool:
    """Whether this process was started by ``torchrun`` (or a launcher that sets the same variables)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


@dataclass
class TensorParallel:
    """One process's place in a tensor-parallel group, and the collectives over the group.

    The model's collectives run on ``group``, made with ``timeout_s``; the process group's rendezvous and
    rank 0's calls between steps (``control``) wait up to :data:`IDLE_TIMEOUT_S` instead, so a slow start or
    an idle server is not a failure.

    Args:
        group: The process group of the ranks that share one model (None: the default group).
        rank: This process's rank in ``group`` (0 owns the tokenizer and the scheduling).
        size: Ranks in ``group`` (the tensor-parallel size).
        timeout_s: Seconds a collective waits before failing (the group was made with it).
        device: Where this rank's shard lives (a CUDA rank's collectives run on its GPU).
        owns_group: Whether :meth:`close` destroys the process group (this object made it).
        control: The gloo group of the same ranks that carries rank 0's calls between steps (:meth:`broadcast`
            and :meth:`broadcast_object` with ``control=True``), with the long :data:`IDLE_TIMEOUT_S` (None:
            ``group``, with its timeout).

    Raises:
        TensorParallelError: ``rank`` is outside ``[0, size)``.
    """

    group: Any
    rank: int
    size: int
    timeout_s: float = DEFAULT_TIMEOUT_S
    device: torch.device = torch.device("cpu")
    owns_group: bool = False
    control: Any = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise TensorParallelError(f"rank={self.rank} is outside [0, size={self.size}); check the launcher's "
                                      "RANK and WORLD_SIZE.")
        self.device = torch.device(self.device)

    @classmethod
    def join(cls, address: str, rank: int, size: int, *, timeout_s: float = DEFAULT_TIMEOUT_S,
             device: torch.device | str = "cpu") -> TensorParallel:
        """Joins (or starts, as rank 0) a group of ``size`` processes rendezvousing at ``address``.

        The group becomes this process's default ``torch.distributed`` group; :meth:`close` destroys it.

        Args:
            address: ``tcp://host:port`` of the rendezvous (rank 0 listens there).
            rank: This process's rank.
            size: The group's size.
            timeout_s: The collectives' timeout (and the rendezvous's).
            device: Where this rank's shard lives (selects gloo or NCCL).

        Raises:
            TensorParallelError: A default group already exists in this process (join its ranks with
                :meth:`from_default_group` or :meth:`split` instead).
        """
        if dist.is_initialized():
            raise TensorParallelError(
                "this process already belongs to a torch.distributed group; under torchrun use "
                "TensorParallel.split(tensor_parallel_size) instead of starting a second group.")
        device = torch.device(device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        idle = datetime.timedelta(seconds=IDLE_TIMEOUT_S)  # the rendezvous waits for the slowest rank to start
        dist.init_process_group(backend_for(device), init_method=address, rank=rank, world_size=size, timeout=idle)
        compute = dist.new_group(timeout=datetime.timedelta(seconds=timeout_s))
        control = dist.new_group(backend="gloo", timeout=idle)
        return cls(compute, rank, size, timeout_s, device, owns_group=True, control=control)

    @classmethod
    def split(cls, tensor_parallel_size: int, *, timeout_s: float = DEFAULT_TIMEOUT_S,
              device: torch.device | str | None = None) -> TensorParallel:
        """This process's tensor-parallel group under ``torchrun`` (world = data parallel x tensor parallel).

        Joins the default group from the environment if it is not joined yet (gloo on the CPU, NCCL on
        CUDA with ``LOCAL_RANK`` as the device), then cuts the world into consecutive groups of
        ``tensor_parallel_size`` ranks: ranks ``0 .. tp-1`` share one model, ``tp .. 2tp-1`` the next, ...

        Args:
            tensor_parallel_size: Ranks per model.
            timeout_s: The collectives' timeout.
            device: This rank's device (None: ``cuda:LOCAL_RANK`` when CUDA is available, else the CPU).

        Raises:
            TensorParallelError: The world size is not a multiple of ``tensor_parallel_size``, or the
                environment names no world (start the script with ``torchrun``).
        """
        if device is None:
            local = int(os.environ.get("LOCAL_RANK", "0"))
            device = torch.device(f"cuda:{local}") if torch.cuda.is_available() else torch.device("cpu")
        device = torch.device(device)
        if not dist.is_initialized():
            if not under_torchrun():
                raise TensorParallelError("TensorParallel.split needs torchrun's RANK, WORLD_SIZE, MASTER_ADDR and "
                                          "MASTER_PORT; start the script with torchrun --nproc-per-node N.")
            if device.type == "cuda":
                torch.cuda.set_device(device)
            dist.init_process_group(backend_for(device), timeout=datetime.timedelta(seconds=IDLE_TIMEOUT_S))
        world, rank = dist.get_world_size(), dist.get_rank()
        if world % tensor_parallel_size:
            raise TensorParallelError(
                f"the world has {world} ranks, not a multiple of tensor_parallel_size={tensor_parallel_size}; "
                f"start torchrun with a multiple of {tensor_parallel_size} processes.")
        groups = [list(range(s, s + tensor_parallel_size)) for s in range(0, world, tensor_parallel_size)]
        compute, _ = dist.new_subgroups_by_enumeration(groups, timeout=datetime.timedelta(seconds=timeout_s))
        control, _ = dist.new_subgroups_by_enumeration(groups, timeout=datetime.timedelta(seconds=IDLE_TIMEOUT_S),
                                                       backend="gloo")
        return cls(compute, rank % tensor_parallel_size, tensor_parallel_size, timeout_s, device, control=control)

    @property
    def is_main(self) -> bool:
        """Whether this is the group's rank 0 (tokenizer, scheduling, results)."""
        return self.rank == 0

    # ------------------------------------------------------------------------------- collectives
    def all_reduce(self, x: Tensor, op: str = "sum") -> Tensor:
        """The sum (or ``op="max"``: the largest) of ``x`` over the ranks (a row-parallel layer's partial
        products; a row's fullest KV head)."""
        if torch.compiler.is_compiling() or (torch.is_grad_enabled() and x.requires_grad):
            out = funcol.all_reduce(x, op, self.group)
            return out.wait() if isinstance(out, funcol.AsyncCollectiveTensor) else out
        dist.all_reduce(x, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=self.group)
        return x

    def all_gather(self, x: Tensor, dim: int, lengths: Sequence[int] | None = None) -> Tensor:
        """The ranks' ``x`` concatenated along ``dim`` in rank order (a column-parallel output, per-head scores).

        Args:
            x: This rank's part; every rank's part has the same shape except perhaps along ``dim``.
            dim: The dimension to concatenate along.
            lengths: Each rank's length along ``dim`` when they differ (an uneven split: the parts are padded
                to the longest for the collective and cut back); None: all equal to ``x.shape[dim]``.
        """
        dim = dim % x.dim()
        part = x.shape[dim] if lengths is None else max(lengths)
        moved = x.movedim(dim, 0)
        if moved.shape[0] < part:  # a shorter part
            moved = torch.cat([moved, moved.new_zeros((part - moved.shape[0], *moved.shape[1:]))])
        moved = moved.contiguous()
        if torch.compiler.is_compiling():
            out = funcol.all_gather_single(moved, 0, self.group)
            out = out.wait() if isinstance(out, funcol.AsyncCollectiveTensor) else out
        else:
            out = moved.new_empty((self.size * part, *moved.shape[1:]))
            dist.all_gather_single(out, moved, group=self.group)
        if lengths is not None and any(n != part for n in lengths):
            out = torch.cat([out[r * part:r * part + n] for r, n in enumerate(lengths)])
        return out.movedim(0, dim)

    def broadcast(self, x: Tensor, control: bool = False) -> Tensor:
        """Rank 0's ``x`` on every rank, in place (the others pass a buffer of the same shape and dtype);
        ``control``: on the :attr:`control` group (a CPU tensor)."""
        dist.broadcast(x, group=self._group(control), group_src=0)
        return x

    def broadcast_object(self, obj: Any = None, control: bool = False) -> Any:
        """Rank 0's ``obj`` (pickled) on every rank; the others pass anything and get rank 0's back
        (``control``: on the :attr:`control` group)."""
        box = [obj if self.is_main else None]
        group = self._group(control)
        device = None if group is not self.group else self._object_device
        dist.broadcast_object_list(box, group=group, group_src=0, device=device)
        return box[0]

    def _group(self, control: bool) -> Any:
        return self.control if control and self.control is not None else self.group

    def gather_objects(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0, in rank order (None on the other ranks), on the control group."""
        out: list[Any] | None = [None] * self.size if self.is_main else None
        dist.gather_object(obj, out, group=self._group(True), group_dst=0)
        return out

    def all_gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` on every rank, in rank order, on the control group."""
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self._group(True))
        return out

    def barrier(self) -> None:
        """Waits until every rank of the group arrives (on the control group: the slowest rank may take long
        to load its shard; a rank that died fails it at once)."""
        dist.barrier(group=self._group(True))

    @property
    def _object_device(self) -> torch.device | None:
        return self.device if self.device.type == "cuda" else None

    def close(self) -> None:
        """Destroys the process group if this object made it (idempotent)."""
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self.owns_group = False


def ranks_text(ranks: Sequence[int]) -> str:
    """``"rank 1"`` / ``"ranks 1, 3"`` (for messages)."""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
