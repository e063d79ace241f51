"""Loading a rank's shard straight from safetensors: the rank reads its slices, never the whole model.

:func:`load_shard` runs the ordinary :func:`~beaconkv.models.loading.load_model` — every check of the
whole checkpoint (config fields, header dtypes, the config against the tensors' names and shapes, finite
weights) — with three differences, all given through its hooks: the model is built from the rank's
local config with the sharded layers (:mod:`beaconkv.distributed.layers`), each tensor's header is
compared with the whole tensor's shape the rank's part implies, and each tensor is read with
safetensors' ``get_slice``, which maps only the rank's rows or columns (:class:`RankShard`). So a rank's
memory holds its shard, never the whole model, and a checkpoint that disagrees with the config is refused
by every rank, before any weight is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..models.config import ModelConfig
from ..models.decoder import CausalLM
from ..models.loading import load_model, resolve_checkpoint
from .group import TensorParallel
from .layers import attention_factory, mlp_factory, use_vocab_parallel
from .plan import ShardPlan

__all__ = ["RankShard", "load_shard"]


@dataclass
class RankShard:
    """A rank's part of a checkpoint, as :func:`~beaconkv.models.loading.load_model`'s ``shard`` hook
    (:class:`~beaconkv.models.loading.CheckpointShard`).

    Args:
        tp: The group (the sharded layers' collectives).
        vocab_parallel: Split the embedding and LM head by vocabulary rows (else replicate them).

    Attributes:
        plan: The rank's :class:`~beaconkv.distributed.plan.ShardPlan`, made when the config is known.
    """

    tp: TensorParallel
    vocab_parallel: bool = True
    plan: ShardPlan | None = None

    def model_config(self, config: ModelConfig) -> ModelConfig:
        """Makes the plan for ``config`` and returns the rank's local config."""
        self.plan = ShardPlan(config, self.tp.size, self.tp.rank, self.vocab_parallel)
        return self.plan.local_config()

    def adapt(self, model: CausalLM) -> None:
        """Vocab-parallel embedding and head (the attention and MLP come from the factories)."""
        if self.vocab_parallel:
            use_vocab_parallel(model, self._plan, self.tp)

    def stored_shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """See :meth:`~beaconkv.distributed.plan.ShardPlan.stored_shape`."""
        return self._plan.stored_shape(name, shape)

    def read(self, stored: Any, name: str) -> torch.Tensor:
        """Reads the rank's rows or columns of ``name`` from its safetensors slice."""
        s = self._plan.tensor_slice(name)
        if s is None:
            return stored[:]
        return stored[s.start:s.stop] if s.dim == 0 else stored[:, s.start:s.stop]

    @property
    def _plan(self) -> ShardPlan:
        if self.plan is None:
            raise RuntimeError("RankShard.model_config must run first (load_model calls it before building).")
        return self.plan


def load_shard(path_or_id: str | Path, tp: TensorParallel, dtype: torch.dtype | str | None = torch.float32,
               device: torch.device | str | None = None, *, vocab_parallel: bool = True,
               check_finite: bool = True) -> CausalLM:
    """Loads this rank's shard of a llama / qwen2 / qwen3 checkpoint.

    Args:
        path_or_id: Checkpoint directory or hub id (each rank resolves it; the hub's cache is shared).
        tp: This process's group.
        dtype: Parameter dtype (see :func:`~beaconkv.models.load_model`).
        device: Where the shard lives (None: ``tp.device``).
        vocab_parallel: Split the embedding and LM head over the ranks (default; saves their memory, costs
            an all-reduce and an all-gather per step) or replicate them.
        check_finite: Refuse NaN or infinite weights (see :func:`~beaconkv.models.load_model`).

    Returns:
        The rank's model: a :class:`~beaconkv.models.CausalLM` over its local heads, whose ``config`` is
        the local config; ``model.tensor_parallel`` is ``tp`` and ``model.shard_plan`` its plan.

    Raises:
        TensorParallelError: The model cannot be split over ``tp.size`` ranks.
        CheckpointError: Everything else :func:`~beaconkv.models.load_model` refuses (missing or mis-shaped
            tensors, a config that disagrees with them, non-finite weights; also its ``FileNotFoundError``,
            ``ConfigFileError`` and ``UnsupportedModelError``).
    """
    directory = resolve_checkpoint(path_or_id)
    shard = RankShard(tp, vocab_parallel)
    plan = ShardPlan(ModelConfig.from_file(directory), tp.size, tp.rank, vocab_parallel)  # refuse a bad size first
    model = load_model(directory, dtype=dtype, device=tp.device if device is None else device,
                       attention=attention_factory(plan, tp), mlp=mlp_factory(tp), shard=shard,
                       check_finite=check_finite)
    model.tensor_parallel = tp
    model.shard_plan = plan
    return model
