"""The contract every KV storage fulfils: the seam that lets dense, quantised or paged storage exist.

A storage holds the keys and values of one attention layer in ``capacity`` slots per (sequence,
KV head). It knows nothing of positions, budgets or policies: :class:`beaconkv.cache.LayerKVCache`
keeps the bookkeeping (which position each slot holds, how many are filled) and tells the storage
where to write and what to move.

What the cache asks of a storage:

* **write** — :meth:`KVStorage.write` puts a block of tokens into given slots of given sequences
  (the prefill, an admission); :meth:`KVStorage.append` one token per sequence at one slot each (the
  decode step: static shapes, in place, no host synchronisation, so it can be compiled).
* **attend** — :meth:`KVStorage.attend`: attention of a step's queries over every slot, under a
  validity mask; a storage that compresses may compute it without materialising full-precision
  keys (the int8 storage folds its scales into the logits and the weights).
* **move** — :meth:`KVStorage.compact` keeps some slots of some sequences, moved to the front in the
  given order (after an eviction). Kept entries must come back bit-identical.

What a policy may read, for scoring: :meth:`KVStorage.keys` and :meth:`KVStorage.values`, in the
compute dtype (dequantised where the storage quantises), for all sequences or some. Keys are
**post-RoPE** — stored at their own positions and never re-rotated.

Buffers are registered on the module and mutated in place (``copy_``, ``scatter_``, indexed
assignment), never rebound, so compiled graphs and CUDA graphs keep their addresses.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import BeaconKVError


class StorageError(BeaconKVError, ValueError):
    """Bad storage settings (unknown kind, a dtype it cannot hold, non-positive sizes)."""


class KVStorage(nn.Module, ABC):
    """Keys and values of one attention layer: ``(batch, kv_heads, capacity, head_dim)`` slots.

    Args:
        batch: Sequences.
        n_kv_heads: Key/value heads.
        capacity: Slots per (sequence, KV head).
        head_dim: Width of a head.
        dtype: The compute dtype: what :meth:`keys`, :meth:`values` and :meth:`attend` return, and
            the dtype of the tensors handed to :meth:`write`.
        device: Where the buffers live.

    Raises:
        StorageError: A size below 1.
    """

    #: Registry name (:func:`beaconkv.storage.make_storage`).
    kind: str = "base"

    def __init__(
        self, batch: int, n_kv_heads: int, capacity: int, head_dim: int, dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        for name, value in (("batch", batch), ("n_kv_heads", n_kv_heads), ("capacity", capacity),
                            ("head_dim", head_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise StorageError(f"{name}={value!r} must be an int >= 1.")
        self.batch, self.n_kv_heads, self.capacity, self.head_dim = batch, n_kv_heads, capacity, head_dim
        self.dtype, self.device = dtype, torch.device(device)

    # ----------------------------------------------------------------------------------- writes
    @abstractmethod
    def write(self, rows: Tensor, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Writes a block of tokens of some sequences.

        Args:
            rows: ``(b,)`` sequence indices.
            slots: ``(b, L)`` the slot each token goes to.
            k: Keys ``(b, kv_heads, L, head_dim)``, post-RoPE.
            v: Values, same shape.
        """

    @abstractmethod
    def append(self, slot: Tensor, k: Tensor, v: Tensor) -> None:
        """Writes one token of every sequence (the decode step): static shapes, in place.

        Args:
            slot: ``(batch,)`` the slot of each sequence's token.
            k: Keys ``(batch, kv_heads, 1, head_dim)``, post-RoPE.
            v: Values, same shape.
        """

    # ------------------------------------------------------------------------------------ reads
    @abstractmethod
    def keys(self, rows: Tensor | None = None) -> Tensor:
        """Keys in the compute dtype, ``(batch or b, kv_heads, capacity, head_dim)`` (post-RoPE).

        Args:
            rows: ``(b,)`` sequences to read (None: all; a dense storage then returns its buffer itself).
        """

    @abstractmethod
    def values(self, rows: Tensor | None = None) -> Tensor:
        """Values in the compute dtype, like :meth:`keys`."""

    def attend(self, q: Tensor, mask: Tensor, scale: float, need_weights: bool = False) -> tuple[Tensor, Tensor | None]:
        """Attention of one step's queries over every slot of every sequence.

        The default reads :meth:`keys` and :meth:`values`; storages that compress override it.

        Args:
            q: ``(batch, kv_heads, group, head_dim)`` queries (the GQA group plays the query axis).
            mask: ``(batch, kv_heads, 1, capacity)`` bool, the slots that may be attended.
            scale: Logit scale (``1 / sqrt(head_dim)`` by default).
            need_weights: Also return the float32 weights (for policies that observe attention).

        Returns:
            ``(out (batch, kv_heads, group, head_dim), weights (batch, kv_heads, group, capacity) or None)``.
        """
        keys, values = self.keys(), self.values()
        if not need_weights:
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale), None
        logits = torch.matmul(q, keys.transpose(-1, -2)).float() * scale
        weights = logits.masked_fill(~mask, -math.inf).softmax(-1)
        return torch.matmul(weights.to(values.dtype), values), weights

    # ------------------------------------------------------------------------------------ moves
    @abstractmethod
    def compact(self, rows: Tensor, keep: Tensor) -> None:
        """Moves the kept slots of some sequences to the front, in the given order.

        Args:
            rows: ``(b,)`` sequence indices.
            keep: ``(b, kv_heads, K)`` slot indices to keep; entry ``j`` moves to slot ``j``. Slots
                ``>= K`` keep stale data (the cache marks them empty).
        """

    def nbytes(self) -> int:
        """Bytes held by every buffer (keys, values and any scales)."""
        return sum(b.nbytes for b in self.buffers())

    def extra_repr(self) -> str:
        return (f"batch={self.batch}, kv_heads={self.n_kv_heads}, capacity={self.capacity}, "
                f"head_dim={self.head_dim}, dtype={self.dtype}")


def token_index(rows: Tensor, slots: Tensor, n_kv_heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """Advanced-indexing triple ``(rows, heads, slots)`` addressing ``(b, kv_heads, L)`` token slots."""
    heads = torch.arange(n_kv_heads, device=slots.device)
    return rows[:, None, None], heads[None, :, None], slots[:, None, :]


def put_front(buf: Tensor, rows: Tensor, values: Tensor) -> None:
    """Writes ``values (b, kv_heads, K, ...)`` into slots ``[0, K)`` of sequences ``rows`` of ``buf``, in place.

    Every index is an index tensor, so a compiled eviction writes those ``b`` sequences in place;
    ``buf[rows, :, :K] = values`` (a slice) becomes a rewrite of the whole buffer once functionalised.
    """
    slots = torch.arange(values.shape[2], device=buf.device).expand(values.shape[0], -1)
    buf.index_put_(token_index(rows, slots, values.shape[1]), values)


def gather_slots(buf: Tensor, rows: Tensor, keep: Tensor) -> Tensor:
    """``buf[rows]`` gathered along the slot axis (2) at ``keep (b, kv_heads, K)``; trailing dims follow."""
    sub = buf[rows]
    idx = keep.view(*keep.shape, *([1] * (sub.dim() - 3))).expand(*keep.shape, *sub.shape[3:])
    return torch.gather(sub, 2, idx)
