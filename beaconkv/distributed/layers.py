"""The sharded layers of a tensor-parallel rank, and the factories that put them into
:func:`~beaconkv.models.build_model`.

A rank's model is the ordinary :class:`~beaconkv.models.CausalLM` built from its local config
(:meth:`~beaconkv.distributed.plan.ShardPlan.local_config`): ``q_proj``/``k_proj``/``v_proj``,
``gate_proj``/``up_proj`` are plain ``nn.Linear`` layers over the rank's heads and MLP columns
(column-parallel: their outputs stay on the rank), and the cache, the attention and every eviction
policy see only the rank's KV heads. Four layers differ, each keeping Hugging Face's parameter names so
the checkpoint's slices load by name:

* :class:`RowParallelLinear` — ``o_proj`` and ``down_proj``: the rank's columns, then one all-reduce;
* :class:`VocabParallelEmbedding` — the rank's vocabulary rows; ids outside them give zeros, and the
  all-reduce adds the one rank's row (exact: the others add zeros);
* :class:`VocabParallelLMHead` — the logits of the rank's rows, gathered in vocabulary order;
* or, with ``vocab_parallel=False``, the plain embedding and head, replicated.

So a decode step costs two all-reduces per layer (attention, MLP), one for the embedding and one
all-gather for the logits (none of these two when replicated), and nothing more: evictions add none
(each rank evicts its own KV heads; only :class:`~beaconkv.policies.HeadAdaptive` exchanges scores, through
:mod:`beaconkv.distributed.heads`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..models.attention import Attention
from ..models.config import ModelConfig
from ..models.decoder import CausalLM
from ..models.layers import SwiGLUMLP
from .group import TensorParallel
from .plan import ShardPlan

__all__ = ["RowParallelLinear", "TensorParallelMLP", "VocabParallelEmbedding", "VocabParallelLMHead",
           "attention_factory", "mlp_factory", "use_vocab_parallel"]


class RowParallelLinear(nn.Linear):
    """A linear layer whose input features are split between the ranks: each multiplies its own columns,
    the all-reduce sums the partial products (``o_proj``, ``down_proj``).

    Args:
        in_features: The rank's input features (its columns of the full weight).
        out_features: Output features (the full width).
        tp: The group.
        bias: Add a bias after the sum (held by every rank).
        input_slice: ``(start, stop)``: the rank projects only these features of its input (its share of
            a replicated KV head's query heads; see :mod:`beaconkv.distributed.plan`). None: all of them.
    """

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel, *, bias: bool = False,
                 input_slice: tuple[int, int] | None = None) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp
        self.input_slice = input_slice

    def forward(self, x: Tensor) -> Tensor:
        """``sum over ranks of x[..., own columns] @ W_own.T`` (+ bias): ``(..., in) -> (..., out)``."""
        if self.input_slice is not None:
            x = x[..., self.input_slice[0]:self.input_slice[1]]
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return super().extra_repr() + f", ranks={self.tp.size}" + (
            f", input_slice={self.input_slice}" if self.input_slice is not None else "")


class VocabParallelEmbedding(nn.Embedding):
    """The embedding rows ``[start, stop)`` of the vocabulary; a token another rank holds gives zeros here,
    and the all-reduce returns each token's one row.

    Args:
        rows: This rank's vocabulary rows.
        embedding_dim: Hidden size.
        tp: The group.
    """

    def __init__(self, rows: range, embedding_dim: int, tp: TensorParallel) -> None:
        super().__init__(len(rows), embedding_dim)
        self.start, self.stop, self.tp = rows.start, rows.stop, tp

    def forward(self, ids: Tensor) -> Tensor:
        """``(...)`` token ids -> ``(..., hidden)`` embeddings (every rank gets the same)."""
        mine = (ids >= self.start) & (ids < self.stop)
        local = torch.where(mine, ids - self.start, 0)
        out = F.embedding(local, self.weight).masked_fill(~mine[..., None], 0.0)
        return self.tp.all_reduce(out)

    def extra_repr(self) -> str:
        return f"rows {self.start}..{self.stop - 1}, {self.embedding_dim}, ranks={self.tp.size}"


class VocabParallelLMHead(nn.Linear):
    """The LM head's vocabulary rows ``[start, stop)``; the ranks' logits are gathered in vocabulary order.

    Args:
        hidden_size: Input features.
        rows: This rank's vocabulary rows.
        lengths: Every rank's number of rows, in rank order (the gathered width is their sum).
        tp: The group.
    """

    def __init__(self, hidden_size: int, rows: range, lengths: list[int], tp: TensorParallel) -> None:
        super().__init__(hidden_size, len(rows), bias=False)
        self.start, self.stop, self.lengths, self.tp = rows.start, rows.stop, list(lengths), tp

    def forward(self, x: Tensor) -> Tensor:
        """``(..., hidden) -> (..., vocab)``: every rank gets every logit."""
        return self.tp.all_gather(F.linear(x, self.weight), -1, self.lengths)

    def extra_repr(self) -> str:
        return (f"{self.in_features}, rows {self.start}..{self.stop - 1} of {sum(self.lengths)}, "
                f"ranks={self.tp.size}")


class TensorParallelMLP(SwiGLUMLP):
    """The SwiGLU MLP over the rank's inner columns: ``gate_proj``/``up_proj`` column-parallel, ``down_proj``
    row-parallel (one all-reduce).

    Args:
        hidden_size: Input and output width.
        intermediate_size: The rank's inner columns.
        tp: The group.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TensorParallel) -> None:
        super().__init__(hidden_size, intermediate_size)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, tp)


def attention_factory(plan: ShardPlan, tp: TensorParallel) -> Callable[..., nn.Module]:
    """``build_model``'s ``attention=`` for a rank: :class:`~beaconkv.models.attention.Attention` over the
    rank's heads (from the local config), its ``o_proj`` a :class:`RowParallelLinear` over the rank's
    :attr:`~beaconkv.distributed.plan.ShardPlan.output_heads`."""
    hd, hidden = plan.config.head_dim, plan.config.hidden_size
    start = (plan.output_heads.start - plan.attention_heads.start) * hd
    stop = start + len(plan.output_heads) * hd
    whole = (start, stop) == (0, len(plan.attention_heads) * hd)

    def make(**parts) -> nn.Module:
        parts["o_proj"] = RowParallelLinear(stop - start, hidden, tp, input_slice=None if whole else (start, stop))
        return Attention(**parts)

    return make


def mlp_factory(tp: TensorParallel) -> Callable[[ModelConfig], nn.Module]:
    """``build_model``'s ``mlp=`` for a rank: :class:`TensorParallelMLP` over the local config's columns."""
    return lambda cfg: TensorParallelMLP(cfg.hidden_size, cfg.intermediate_size, tp)


def use_vocab_parallel(model: CausalLM, plan: ShardPlan, tp: TensorParallel) -> None:
    """Replaces a freshly built model's embedding and LM head by their vocab-parallel forms (before its
    weights load; a tied head shares the embedding's rows again)."""
    c = plan.config
    model.model.embed_tokens = VocabParallelEmbedding(plan.vocab, c.hidden_size, tp)
    model.lm_head = VocabParallelLMHead(c.hidden_size, plan.vocab, plan.vocab_lengths, tp)
    if c.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
