"""``--tensor-parallel-size`` on the command line: the option, and the group a command starts with it.

``beaconkv generate --tensor-parallel-size N`` (vLLM's spelling) splits the model over ``N`` ranks. When
the command was not started by ``torchrun`` it becomes rank 0 and spawns the others
(:class:`~beaconkv.distributed.launch.TensorParallelRun`); rank 0 prints, streams and reports, as a
single-process run does. The figures it prints about the cache are rank 0's: each rank holds the same
number of slots for its own KV heads.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..arguments import positive_int
from .group import TensorParallelError
from .launch import TensorParallelRun

__all__ = ["add_tensor_parallel_argument", "start_run"]


def add_tensor_parallel_argument(parser: Any) -> None:
    """``--tensor-parallel-size N``: ranks the model is split over (default 1: this process alone)."""
    parser.add_argument("--tensor-parallel-size", type=positive_int, default=1, metavar="N",
                        help="split the model over N processes (tensor parallelism: attention heads, KV heads and "
                             "the MLP sharded, each rank evicting its own KV heads); this process is rank 0 and "
                             "spawns the others (default 1)")


def start_run(args: argparse.Namespace, path: str | Path) -> TensorParallelRun | None:
    """The tensor-parallel group ``args`` ask for (None for ``--tensor-parallel-size 1``).

    Args:
        args: Parsed options: ``tensor_parallel_size``, ``dtype``, ``device``, ``threads`` (each rank's threads);
            ``compile`` and ``backend`` must leave the defaults.
        path: The checkpoint.

    Raises:
        TensorParallelError: ``--compile`` or ``--backend hf`` with more than one rank, or the run's own errors.
    """
    size = getattr(args, "tensor_parallel_size", 1)
    if size == 1:
        return None
    if getattr(args, "compile", False):
        raise TensorParallelError("--compile is not supported with --tensor-parallel-size yet; use --no-compile.")
    if getattr(args, "backend", "native") != "native":
        raise TensorParallelError(f"--backend {args.backend} runs in transformers, in one process; "
                                  "--tensor-parallel-size needs --backend native.")
    return TensorParallelRun(path, size, dtype=args.dtype, device=args.device, threads=getattr(args, "threads", None))
