"""The sharding plan: which heads, MLP columns and vocabulary rows each tensor-parallel rank holds.

Pure arithmetic over a :class:`~beaconkv.models.config.ModelConfig`, the tensor-parallel size and a rank;
nothing here touches a process group. :class:`ShardPlan` says, for one rank:

* **attention** (column-parallel ``q_proj``/``k_proj``/``v_proj``, row-parallel ``o_proj``): with at least
  as many KV heads as ranks, rank ``r`` holds a run of consecutive KV heads — ``kv / size`` of them, or,
  when ``size`` does not divide ``kv``, one more on the first ``kv % size`` ranks (the embedded
  SmolLM2-135M's 3 KV heads over 2 ranks: 2 and 1) — and the query heads of their GQA groups (a group's
  query heads are consecutive: query head ``i`` reads KV head ``i // group``), and projects all of them
  in ``o_proj``;
* **fewer KV heads than ranks** (``size`` a multiple of ``num_key_value_heads``, and of the query heads'
  count): each KV head is *replicated* on ``size / kv`` consecutive ranks. Every replica holds the KV
  head's projections, its cache and the queries of its whole GQA group, so it attends and evicts exactly
  as the single process would — the replicas keep identical caches with no communication — while
  ``o_proj`` is split between the replicas: each projects only its own ``heads / size`` query heads of
  the group (the columns of ``o_proj`` it holds). The price is attention computed ``size / kv`` times; the
  MLP and ``o_proj`` stay split;
* **MLP**: ``gate_proj``/``up_proj`` column-parallel, ``down_proj`` row-parallel, over about
  ``intermediate_size / size`` columns each (the first ranks one more when it does not divide);
* **embedding and LM head**: vocab-parallel (rank ``r`` holds a run of about ``V / size`` rows, the first
  ranks one more) or replicated (every rank holds all rows).

An uneven split balances the work less (the rank with more heads sets the pace of every step) but lets
a model run on a rank count its head counts do not divide.

:meth:`ShardPlan.local_config` is the config a rank's model is built from (its local head and MLP
counts), and :meth:`ShardPlan.tensor_slice` says which part of each checkpoint tensor it reads.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from ..models.config import ModelConfig
from .group import TensorParallelError

__all__ = ["ShardPlan", "TensorSlice", "check_tensor_parallel_size", "part", "part_lengths"]


@dataclass(frozen=True)
class TensorSlice:
    """The part of a checkpoint tensor one rank reads: ``[start, stop)`` along dimension ``dim``.

    Attributes:
        dim: 0 (rows) or 1 (columns).
        start: First index.
        stop: One past the last index.
    """

    dim: int
    start: int
    stop: int


def part(n: int, size: int, rank: int) -> range:
    """Rank ``rank``'s run of ``n`` items split as evenly as possible over ``size`` ranks (the first
    ``n % size`` ranks one more): ``part(3, 2, 0) == range(0, 2)``, ``part(3, 2, 1) == range(2, 3)``."""
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def part_lengths(n: int, size: int) -> list[int]:
    """The lengths of every rank's :func:`part` of ``n`` items."""
    return [len(part(n, size, r)) for r in range(size)]


def _splits(config: ModelConfig, size: int) -> bool:
    c = config
    if size > c.intermediate_size or size > c.vocab_size:
        return False
    if size <= c.num_key_value_heads:
        return True
    return size % c.num_key_value_heads == 0 and c.num_attention_heads % size == 0


def check_tensor_parallel_size(config: ModelConfig, size: int) -> None:
    """Refuses a tensor-parallel size the model cannot be split by.

    Any size up to the number of KV heads splits them (unevenly when it does not divide them); a larger one
    must be a multiple of the KV heads (each is replicated on ``size / kv`` ranks) that divides the query
    heads (each replica projects ``heads / size`` of them).

    Args:
        config: The full model's config.
        size: Ranks.

    Raises:
        TensorParallelError: ``size`` is not a positive int, or more ranks than the KV heads that do not
            replicate them evenly (the message lists the sizes that work).
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise TensorParallelError(f"tensor_parallel_size={size!r} must be an int >= 1.")
    if _splits(config, size):
        return
    c = config
    sizes = [d for d in range(1, max(c.num_attention_heads, c.num_key_value_heads) + 1) if _splits(c, d)]
    if size % c.num_key_value_heads:
        why = (f"{size} ranks are more than its num_key_value_heads={c.num_key_value_heads} and not a multiple of "
               f"them (each KV head is replicated on the same number of ranks)")
    else:
        why = (f"num_attention_heads={c.num_attention_heads} is not a multiple of {size} (each rank projects as "
               f"many query heads)")
    raise TensorParallelError(f"tensor_parallel_size={size} cannot split this {c.model_type} model: {why}; use one "
                              f"of {', '.join(map(str, sizes))}.")


_ATTN = re.compile(r"model\.layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj|o_proj)\.(weight|bias)$")
_MLP = re.compile(r"model\.layers\.\d+\.mlp\.(gate_proj|up_proj|down_proj)\.weight$")


@dataclass(frozen=True)
class ShardPlan:
    """What one rank of a tensor-parallel group holds of a model (see the module docstring).

    Args:
        config: The full model's config.
        size: Ranks in the group.
        rank: This rank.
        vocab_parallel: Split the embedding and the LM head by vocabulary rows (True) or replicate them.

    Raises:
        TensorParallelError: A size the model cannot be split by (:func:`check_tensor_parallel_size`), or a
            rank outside ``[0, size)``.
    """

    config: ModelConfig
    size: int
    rank: int
    vocab_parallel: bool = True

    def __post_init__(self) -> None:
        check_tensor_parallel_size(self.config, self.size)
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.size:
            raise TensorParallelError(f"rank={self.rank!r} is outside [0, size={self.size}).")

    # ------------------------------------------------------------------------------- heads
    @property
    def replicas(self) -> int:
        """Ranks holding each KV head: 1 when the KV heads split, ``size / kv`` when they are replicated."""
        return max(1, self.size // self.config.num_key_value_heads)

    @property
    def kv_heads(self) -> range:
        """The KV heads this rank holds (their keys, values and cache), in the model's numbering."""
        if self.replicas > 1:
            head = self.rank // self.replicas
            return range(head, head + 1)
        return part(self.config.num_key_value_heads, self.size, self.rank)

    @property
    def kv_head_counts(self) -> list[int]:
        """How many KV heads each rank holds (replicas included), in rank order."""
        if self.replicas > 1:
            return [1] * self.size
        return part_lengths(self.config.num_key_value_heads, self.size)

    @property
    def attention_heads(self) -> range:
        """The query heads this rank attends with: the whole GQA groups of its KV heads."""
        g = self.config.n_groups
        return range(self.kv_heads.start * g, self.kv_heads.stop * g)

    @property
    def output_heads(self) -> range:
        """The query heads whose outputs this rank projects in ``o_proj`` (its share of :attr:`attention_heads`)."""
        if self.replicas == 1:
            return self.attention_heads
        n = self.config.num_attention_heads // self.size
        return range(self.rank * n, (self.rank + 1) * n)

    @property
    def is_first_replica(self) -> bool:
        """Whether this rank is the first holder of its KV heads (the one whose heads count when every rank's
        heads are put together: :mod:`beaconkv.distributed.heads`)."""
        return self.rank % self.replicas == 0

    # ------------------------------------------------------------------------------- MLP and vocabulary
    @property
    def intermediate(self) -> range:
        """The MLP's inner columns this rank holds."""
        return part(self.config.intermediate_size, self.size, self.rank)

    @property
    def vocab(self) -> range:
        """The vocabulary rows of the embedding and LM head this rank holds (all of them when replicated)."""
        if not self.vocab_parallel:
            return range(self.config.vocab_size)
        return part(self.config.vocab_size, self.size, self.rank)

    @property
    def vocab_lengths(self) -> list[int]:
        """How many vocabulary rows each rank holds, in rank order."""
        v = self.config.vocab_size
        return part_lengths(v, self.size) if self.vocab_parallel else [v] * self.size

    # ------------------------------------------------------------------------------- config and tensors
    def local_config(self) -> ModelConfig:
        """The config this rank's model is built from: its attention heads, KV heads and MLP width
        (everything else, the vocabulary included, as the full model's)."""
        return dataclasses.replace(self.config, num_attention_heads=len(self.attention_heads),
                                   num_key_value_heads=len(self.kv_heads), intermediate_size=len(self.intermediate))

    def tensor_slice(self, name: str) -> TensorSlice | None:
        """The part of checkpoint tensor ``name`` this rank reads (None: all of it, a replicated tensor).

        Column-parallel weights and biases (``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj``, ``up_proj``)
        are cut along their output rows, row-parallel weights (``o_proj``, ``down_proj``) along their input
        columns, the embedding and LM head along the vocabulary when vocab-parallel; norms are replicated.
        """
        hd = self.config.head_dim
        m = _ATTN.match(name)
        if m:
            proj, kind = m.groups()
            if proj == "q_proj":
                heads = self.attention_heads
            elif proj in ("k_proj", "v_proj"):
                heads = self.kv_heads
            else:
                return TensorSlice(1, self.output_heads.start * hd, self.output_heads.stop * hd) \
                    if kind == "weight" else None
            return TensorSlice(0, heads.start * hd, heads.stop * hd)
        m = _MLP.match(name)
        if m:
            cols = self.intermediate
            return TensorSlice(1 if m.group(1) == "down_proj" else 0, cols.start, cols.stop)
        if name in ("model.embed_tokens.weight", "lm_head.weight") and self.vocab_parallel:
            return TensorSlice(0, self.vocab.start, self.vocab.stop)
        return None

    def stored_shape(self, name: str, local_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The checkpoint shape of tensor ``name`` whose slice this rank holds with ``local_shape``
        (for the loader's shape check: a checkpoint that disagrees is refused before any read)."""
        s = self.tensor_slice(name)
        if s is None:
            return tuple(local_shape)
        c, hd = self.config, self.config.head_dim
        full = {"q_proj": c.num_attention_heads * hd, "k_proj": c.num_key_value_heads * hd,
                "v_proj": c.num_key_value_heads * hd, "o_proj": c.num_attention_heads * hd,
                "gate_proj": c.intermediate_size, "up_proj": c.intermediate_size,
                "down_proj": c.intermediate_size, "embed_tokens": c.vocab_size, "lm_head": c.vocab_size}
        key = next(k for k in full if f".{k}." in f".{name}")
        shape = list(local_shape)
        if shape[s.dim] == s.stop - s.start:
            shape[s.dim] = full[key]
        return tuple(shape)

    @property
    def parameters(self) -> int:
        """The parameters this rank holds (its slices, the replicated norms and its vocabulary rows), from the
        config alone: what its weights cost is ``parameters * bytes per element``."""
        c, hd = self.config, self.config.head_dim
        q, kv, out = len(self.attention_heads) * hd, len(self.kv_heads) * hd, len(self.output_heads) * hd
        attention = c.hidden_size * (q + 2 * kv) + out * c.hidden_size
        attention += (q + 2 * kv) if c.attention_bias else 0
        attention += 2 * hd if c.qk_norm else 0
        layer = attention + 3 * c.hidden_size * len(self.intermediate) + 2 * c.hidden_size
        vocab = len(self.vocab) * c.hidden_size * (1 if c.tie_word_embeddings else 2)
        return c.num_hidden_layers * layer + vocab + c.hidden_size

    def kv_bytes_per_token(self, element_size: int = 2) -> int:
        """Bytes of keys and values one token takes in this rank's cache (every layer, its KV heads; dense
        storage of ``element_size``-byte elements: 2 for bfloat16)."""
        return 2 * self.config.num_hidden_layers * len(self.kv_heads) * self.config.head_dim * element_size

    def describe(self) -> str:
        """One line for logs: ``rank 1/2: KV heads 1..1 (1 of 2), query heads 2..3, MLP 48 of 96, vocab 49..96``."""
        c = self.config
        kv, q, out = self.kv_heads, self.attention_heads, self.output_heads
        rep = f", replicated x{self.replicas}" if self.replicas > 1 else ""
        return (f"rank {self.rank}/{self.size}: KV heads {kv.start}..{kv.stop - 1} ({len(kv)} of "
                f"{c.num_key_value_heads}{rep}), query heads {q.start}..{q.stop - 1} (o_proj {out.start}.."
                f"{out.stop - 1}), MLP {len(self.intermediate)} of {c.intermediate_size}, vocab "
                f"{self.vocab.start}..{self.vocab.stop - 1}" + ("" if self.vocab_parallel else " (replicated)"))
