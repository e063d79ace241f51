"""Data-parallel execution: which rank am I, and a barrier before rank 0 merges.

Started by ``torchrun`` (or any launcher that sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``), the evaluation joins a ``torch.distributed`` process group:
``nccl`` when it runs on CUDA, ``gloo`` on CPU. Ranks share no tensors; the group only provides the
barrier after which rank 0 merges the per-rank results files. Without those variables the run is
a single process and nothing is initialised.

The group's timeout must exceed the longest difference between ranks' finishing times (a rank that
finishes early waits at the barrier), hence a default of 24 hours rather than torch's 30 minutes.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

__all__ = ["DistContext", "barrier", "init_distributed", "shutdown_distributed"]


@dataclass(frozen=True)
class DistContext:
    """The place of this process in the data-parallel run.

    Attributes:
        rank: Global rank (0 in a single-process run).
        world_size: Number of ranks.
        local_rank: Rank on this machine (selects the GPU).
        backend: ``"gloo"``, ``"nccl"`` or ``None`` (no process group).
        owns_group: Whether :func:`init_distributed` created the group (and should destroy it).
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None
    owns_group: bool = False

    @property
    def is_main(self) -> bool:
        """Whether this is rank 0."""
        return self.rank == 0


def init_distributed(device: str, *, timeout_min: float = 24 * 60) -> DistContext:
    """Join the process group described by the environment, if any.

    Args:
        device: ``"cpu"`` or ``"cuda[:i]"``; selects the backend (gloo / nccl).
        timeout_min: Collective timeout in minutes.

    Returns:
        The :class:`DistContext` (a single-process one when ``WORLD_SIZE`` is unset or 1).

    Raises:
        ValueError: If ``RANK``/``WORLD_SIZE`` are inconsistent.
    """
    import torch.distributed as dist

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    if world_size <= 1:
        return DistContext()
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank} is outside [0, WORLD_SIZE={world_size}); check the launcher")
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if dist.is_initialized():
        return DistContext(rank, world_size, local_rank, dist.get_backend(), owns_group=False)
    dist.init_process_group(
        backend=backend,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(minutes=timeout_min),
    )
    return DistContext(rank, world_size, local_rank, backend, owns_group=True)


def barrier(ctx: DistContext) -> None:
    """Wait until every rank gets here (no-op in a single-process run).

    Args:
        ctx: The context from :func:`init_distributed`.
    """
    if ctx.world_size <= 1:
        return
    import torch.distributed as dist

    if ctx.backend == "nccl":
        dist.barrier(device_ids=[ctx.local_rank])
    else:
        dist.barrier()


def shutdown_distributed(ctx: DistContext) -> None:
    """Destroy the process group if :func:`init_distributed` created it.

    Args:
        ctx: The context from :func:`init_distributed`.
    """
    if ctx.owns_group:
        import torch.distributed as dist

        dist.destroy_process_group()
