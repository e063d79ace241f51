"""``beaconkv eval --tensor-parallel-size N``: the evaluation over groups of ranks that share one copy of the model.

Started alone, the run becomes rank 0 of a :class:`~beaconkv.distributed.launch.TensorParallelRun` (its
other ranks spawned) and evaluates every sample itself. Under ``torchrun`` the world is cut into groups
of ``N`` consecutive ranks (:meth:`~beaconkv.distributed.group.TensorParallel.split`): each group is one
data-parallel rank of the harness — its rank 0 takes the group's share of the samples, writes its
results part and, on global rank 0, merges them — while the group's other ranks mirror its engine
(:func:`~beaconkv.distributed.mirror.follow`) and join the final barrier. So ``torchrun --nproc-per-node 8
... --tensor-parallel-size 2`` evaluates with 4 copies of the model, each on 2 GPUs, and the records are
the ones a single process writes (every sample has its own seed).

Every rank loads its shard before the harness knows whether anything is left to generate (the ranks that
mirror cannot ask), so a resumed run that is already complete still loads the model once.

**Failures.** Started alone, a rank that dies or fails ends the run with one
:class:`~beaconkv.distributed.group.TensorParallelError` naming it
(:meth:`~beaconkv.distributed.launch.TensorParallelRun.guard`), and the other ranks are stopped. Under
``torchrun`` a group's rank 0 that sees its group fail raises one
:class:`~beaconkv.distributed.group.TensorParallelError` naming its global rank; rank 0 failing on its own
tells the ranks that mirror it to stop first, and the launcher ends the rest of the world when a process
exits with an error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..arguments import model_path
from .backend import CoreEvalEngine, GenerationBackend, make_core_engine, resolve_eval_dtype
from .config import EvalConfig
from .distributed import DistContext, barrier
from ..models.decoder import CausalLM
from ..tokenizer import load_tokenizer
from ..distributed.group import TensorParallel, TensorParallelError
from ..distributed.launch import TensorParallelRun, _group_broken
from ..distributed.loading import load_shard
from ..distributed.mirror import MirroredEngine, follow, send_exit

__all__ = ["MirroredEvalEngine", "run_tensor_parallel", "tensor_parallel_backend"]


class MirroredEvalEngine(MirroredEngine, CoreEvalEngine):
    """Rank 0's engine of an evaluation: mirrored on the group's ranks
    (:class:`~beaconkv.distributed.mirror.MirroredEngine`), reporting each record's cache figures
    (:class:`~beaconkv.eval.backend.CoreEvalEngine`)."""


def tensor_parallel_backend(model: CausalLM, tokenizer: Any, finish: Callable[[], None] | None = None
                            ) -> GenerationBackend:
    """The harness's backend on rank 0's shard: its engines are :class:`MirroredEvalEngine` (see
    :func:`~beaconkv.eval.backend.make_core_engine`).

    Args:
        model: Rank 0's shard.
        tokenizer: The tokenizer.
        finish: Called when this rank is done generating (releases the ranks that mirror it).
    """

    def make_engine(**kwargs: Any) -> CoreEvalEngine:
        return make_core_engine(model, tokenizer, engine_class=MirroredEvalEngine, **kwargs)

    return GenerationBackend(tokenizer, make_engine, finish)


def run_tensor_parallel(config: EvalConfig, device: str, ctx: DistContext,
                        run: Callable[[DistContext, GenerationBackend], Any]) -> Any | None:
    """Runs the evaluation with ``config.tensor_parallel_size`` ranks per copy of the model.

    Args:
        config: The run's configuration.
        device: The resolved device (``"cpu"`` or ``"cuda"``).
        ctx: The process's place in the ``torchrun`` world (a single process: world size 1).
        run: ``run(data_ctx, backend)``: the harness's run for one data-parallel rank (the runner's own).

    Returns:
        What ``run`` returns (the harness's :class:`~beaconkv.eval.runner.EvalReport`) on rank 0 of each
        group; ``None`` on the group's other ranks, which only mirrored rank 0 and generated nothing (the
        caller makes their report: :func:`~beaconkv.eval.runner.run_eval` gives them an empty one).
    """
    size = config.tensor_parallel_size
    path = model_path(config.model)
    dtype = resolve_eval_dtype(config.dtype, device)
    if ctx.world_size == 1:  # started alone: this process is rank 0, the others are spawned
        with TensorParallelRun(path, size, dtype=dtype, device=device) as tp_run:
            backend = tensor_parallel_backend(tp_run.model, load_tokenizer(path))
            with tp_run.guard("evaluating"):
                return run(ctx, backend)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(ctx.local_rank)
    tp = TensorParallel.split(size, device=f"cuda:{ctx.local_rank}" if cuda else "cpu")
    # the harness sees one rank per group: its results part, its share of the samples; global rank 0 merges
    data = DistContext(ctx.rank // size, ctx.world_size // size, ctx.local_rank, ctx.backend, owns_group=False)
    model = load_shard(path, tp, dtype)
    if not tp.is_main:
        follow(model)
        barrier(data)  # the harness's final barrier, which every rank of the world joins
        return None
    released: list[bool] = []

    def finish() -> None:  # the harness calls it before its final barrier: the group's other ranks go there too
        if not released:
            released.append(True)
            send_exit(model)

    try:
        return run(data, tensor_parallel_backend(model, load_tokenizer(path), finish))
    except Exception as err:
        if _group_broken(err):
            raise TensorParallelError(f"tensor parallelism stopped while evaluating: the group of global rank "
                                      f"{ctx.rank} failed ({type(err).__name__}: {str(err).strip()[:300]})") from err
        raise
    finally:
        if not released:  # the run failed before finishing: stop the group's other ranks
            try:
                finish()
            except Exception:  # the group itself may be what failed; the first error is the one to see
                pass
