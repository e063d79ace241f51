"""Tensor parallelism on ``torch.distributed``: one model over several processes, each evicting its own KV heads.

A model too large for one device is split over ``N`` ranks: attention heads and KV heads column-wise,
``o_proj`` and the MLP row/column-parallel with one all-reduce each, the embedding and LM head by
vocabulary rows (:mod:`~beaconkv.distributed.plan`, :mod:`~beaconkv.distributed.layers`), every rank
reading only its slices of the safetensors files (:mod:`~beaconkv.distributed.loading`). Since every
eviction policy keeps tokens per KV head, each rank's cache and policy see its own KV heads and evict
them with no communication — the kept sets are the single process's, head for head
(:mod:`~beaconkv.distributed.heads`; a head-adaptive split gathers the per-head keys it compares). Rank 0
owns the tokenizer and the engine and sends each call that changes its session to the others
(:mod:`~beaconkv.distributed.mirror`).

Four ways in:

* ``beaconkv.generate(model, tok, prompts, tensor_parallel_size=2)`` or ``beaconkv generate
  --tensor-parallel-size 2``: this process is rank 0 and spawns the others
  (:class:`~beaconkv.distributed.launch.TensorParallelRun`, also usable directly);
* under ``torchrun``: :meth:`TensorParallel.split`, :func:`load_shard`, then :func:`lead` on rank 0 and
  :func:`follow` elsewhere (:mod:`~beaconkv.distributed.mirror` shows the script);
* ``beaconkv eval --tensor-parallel-size 2``, alone or under ``torchrun`` (world = data parallel x tensor
  parallel): :mod:`~beaconkv.eval.tensor_parallel`.

See the guide ``docs/guides/distributed.md`` for the memory arithmetic and the measured costs.
"""

from .group import DEFAULT_TIMEOUT_S, TensorParallel, TensorParallelError, under_torchrun
from .heads import RankHeads, for_rank
from .launch import TensorParallelRun
from .layers import RowParallelLinear, VocabParallelEmbedding, VocabParallelLMHead
from .loading import RankShard, load_shard
from .mirror import MirroredEngine, SessionMirror, follow, lead, send_exit
from .plan import ShardPlan, check_tensor_parallel_size

__all__ = [
    "DEFAULT_TIMEOUT_S", "MirroredEngine", "RankHeads", "RankShard", "RowParallelLinear", "SessionMirror",
    "ShardPlan", "TensorParallel", "TensorParallelError", "TensorParallelRun", "VocabParallelEmbedding",
    "VocabParallelLMHead", "check_tensor_parallel_size", "follow", "for_rank", "lead",
    "load_shard", "send_exit", "under_torchrun",
]
