"""Fixed-capacity KV cache: one layer's storage plus the bookkeeping every policy reads.

Layout of one layer (:class:`LayerKVCache`), all buffers allocated once:

* ``storage``: a :class:`~beaconkv.storage.KVStorage` holding keys and values in ``capacity`` slots
  per (sequence, KV head) — dense or int8, see :mod:`beaconkv.storage`. Keys are stored **post-RoPE**
  at their own absolute positions and are never re-rotated.
* ``pos``: ``(batch, kv_heads, capacity)`` int64, the absolute position each slot holds, ``-1`` for an
  empty slot. Each (sequence, KV head) may hold a *different* set of positions, increasing over its
  filled slots.
* ``length``: ``(batch,)`` slots in use per sequence: the next token goes to slot ``length[b]`` of every
  KV head. Every head is filled up to it unless the last eviction let heads keep different numbers of
  tokens (a head-adaptive allocation): a head that kept fewer holds empty slots below ``length``.
* ``active``: ``(batch,)`` bool, shared by every layer of a :class:`KVCache`: the rows that decode.
  A slot pool's idle rows write nothing that counts (their slot stays empty, their length fixed).

The cache is a store: it holds keys, values and positions and moves them when told. What a policy
observes (pre-RoPE queries, attention weights, per-slot scores) is the policy's own, handed to it by
attention through the layer's observer (:mod:`beaconkv.observation`); a per-slot tensor that must move
with the keys rides along on :meth:`LayerKVCache.compact` (its ``carry``).

The attention ↔ cache contract (what :class:`~beaconkv.models.attention.Attention` calls, and what
any replacement attention must call to keep every policy working) is declared once, as the protocol
:class:`LayerCache`; :class:`ModelCache` is the per-model sequence of them the decoder takes. Every
cache-like class implements it: :class:`LayerKVCache`, the prefill view :class:`LayerRows`, and
:class:`~beaconkv.measure.fidelity.cache_stack.LayerStack`:

1. prefill: :meth:`LayerKVCache.write_prefill` with the prompt's post-RoPE keys and values;
2. decode: :meth:`LayerKVCache.append` with the step's key and value, then :meth:`LayerKVCache.attend`
   with the step's (rotated) query: attention over every filled slot, with its weights when asked.

A cache that also implements :class:`ChunkedLayerCache` takes a **chunk**: several tokens per row
written after what the row holds (:meth:`LayerKVCache.write_chunk`), then attended causally over every
filled slot (:meth:`LayerKVCache.attend_chunk`) — a prompt prefilled in chunks with evictions in
between, or a question asked on a cache that holds a compressed context. Chunks are eager work,
outside the static-shape decode step.

Both decode calls have static shapes, write in place and never read the device from the host, so the
whole decode step compiles into one graph (and a CUDA graph).

The policy decides *what* to keep; :meth:`LayerKVCache.compact` does the moving.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .errors import BeaconKVError
from .inplace import scatter_
from .storage import KVStorage, make_storage


class CacheCapacityError(BeaconKVError, ValueError):
    """A write would exceed the cache's fixed capacity."""


@runtime_checkable
class LayerCache(Protocol):
    """What an attention layer needs from its layer's cache: the whole attention ↔ cache contract.

    Keys arrive post-RoPE, at their absolute positions. Decode calls have static shapes and write in
    place, so a decode step compiles into one graph. (Queries go to the layer's observer, not here:
    see :mod:`beaconkv.observation`.)
    """

    def write_prefill(self, k: Tensor, v: Tensor, positions: Tensor, valid: Tensor) -> None:
        """Writes right-padded prompts: keys ``(b, kv_heads, L, head_dim)``, values, positions ``(b, L)``
        and ``valid`` ``(b, L)`` (False on padding)."""

    def append(self, k: Tensor, v: Tensor, positions: Tensor) -> None:
        """Writes one decode token per row: key and value ``(batch, kv_heads, 1, head_dim)`` at positions
        ``(batch,)``."""

    def attend(self, q: Tensor, scale: float, need_weights: bool = False) -> tuple[Tensor, Tensor | None]:
        """Attention of the step's rotated queries ``(batch, heads, 1, head_dim)`` over every filled slot,
        after :meth:`append`: ``(out (batch, heads, 1, head_dim), weights)``, the weights
        ``(batch, kv_heads, group, capacity)`` when ``need_weights`` (else None)."""


@runtime_checkable
class ChunkedLayerCache(LayerCache, Protocol):
    """A :class:`LayerCache` that also takes chunks: several tokens per row after what each row holds."""

    def write_chunk(self, k: Tensor, v: Tensor, positions: Tensor, valid: Tensor) -> None:
        """Writes right-padded chunks after each row's filled slots: keys ``(b, kv_heads, L, head_dim)``,
        values, positions ``(b, L)`` and ``valid`` ``(b, L)`` (False on padding)."""

    def attend_chunk(self, q: Tensor, positions: Tensor, scale: float) -> Tensor:
        """Attention of a chunk's rotated queries ``(b, heads, L, head_dim)`` at ``positions`` ``(b, L)``
        over every filled slot holding a position no later than the query's (after
        :meth:`write_chunk`): ``(b, heads, L, head_dim)``."""


@runtime_checkable
class ModelCache(Protocol):
    """What the decoder needs from a model's cache: one :class:`LayerCache` per decoder layer."""

    def __getitem__(self, i: int) -> LayerCache:
        """The cache of decoder layer ``i``."""

    def __len__(self) -> int:
        """The number of layers."""


class LayerKVCache(nn.Module):
    """Fixed-capacity key/value cache of one attention layer.

    Args:
        storage: Holds the keys and values (its sizes are the cache's).
        n_heads: Query heads (for the GQA grouping).

    Invariants:
        * ``length[b] <= capacity``; slots ``>= length[b]`` have ``pos == -1``.
        * Positions of the filled slots below ``length[b]`` are strictly increasing per (sequence, KV
          head); with a uniform allocation every slot below ``length[b]`` is filled.
        * Kept K/V are the values written for those positions (bit-identical in dense storage).
    """

    def __init__(self, storage: KVStorage, n_heads: int) -> None:
        super().__init__()
        if n_heads % storage.n_kv_heads:
            raise CacheCapacityError(f"n_heads={n_heads} is not a multiple of n_kv_heads={storage.n_kv_heads}.")
        self.storage = storage
        self.batch, self.n_kv_heads, self.n_heads = storage.batch, storage.n_kv_heads, n_heads
        self.capacity, self.head_dim = storage.capacity, storage.head_dim
        device = storage.device
        shape = (self.batch, self.n_kv_heads, self.capacity)
        self.register_buffer("pos", torch.full(shape, -1, dtype=torch.long, device=device), persistent=False)
        self.register_buffer("length", torch.zeros(self.batch, dtype=torch.long, device=device), persistent=False)
        self.register_buffer("active", torch.ones(self.batch, dtype=torch.bool, device=device), persistent=False)
        #: A row's length after a compaction from its heads' kept counts ``(b, kv_heads) -> (b,)`` when other
        #: processes hold more of the layer's KV heads (tensor parallelism under a head-adaptive allocation: the
        #: fullest head of the whole layer, so the slots match the single process's; see
        #: :mod:`beaconkv.distributed.heads`). None: the fullest head here.
        self.row_length: Callable[[Tensor], Tensor] | None = None

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (what :meth:`keys` returns and attention computes in)."""
        return self.storage.dtype

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.n_heads // self.n_kv_heads

    # ------------------------------------------------------------------------------- writes
    def write_prefill(self, k: Tensor, v: Tensor, positions: Tensor, valid: Tensor, rows: Tensor | None = None) -> None:
        """Writes (right-padded) prompts into slots ``0 .. L-1`` of some sequences, emptying the rest.

        Args:
            k: Post-RoPE keys ``(b, kv_heads, L, head_dim)``.
            v: Values, same shape.
            positions: ``(b, L)`` absolute positions.
            valid: ``(b, L)`` bool, False on padding.
            rows: ``(b,)`` the sequences written (None: all, ``b == batch``).

        Raises:
            CacheCapacityError: ``L`` exceeds the capacity.
        """
        b, _, L, _ = k.shape
        if L > self.capacity:
            raise CacheCapacityError(
                f"prompt of {L} tokens does not fit a cache of capacity {self.capacity}; "
                "raise the budget / max_new_tokens or shorten the prompt."
            )
        rows_t = torch.arange(b, device=k.device) if rows is None else rows
        slots = torch.arange(L, device=k.device).expand(b, L)
        self.storage.write(rows_t, slots, k, v)
        pos = torch.full((b, self.n_kv_heads, self.capacity), -1, dtype=torch.long, device=k.device)
        pos[:, :, :L] = torch.where(valid, positions, -1)[:, None, :]
        lengths = valid.sum(-1)
        if rows is None:
            self.pos.copy_(pos)
            self.length.copy_(lengths)
        else:
            self.pos[rows] = pos
            self.length[rows] = lengths

    def append(self, k: Tensor, v: Tensor, positions: Tensor) -> None:
        """Writes one decode token per sequence at slot ``length[b]``.

        Static shapes, in place, no host sync. The caller (the policy) guarantees a free slot for
        every active sequence: it evicts before the cache is full. Rows that are not :attr:`active`
        write an empty slot (position ``-1``) and keep their length.

        Args:
            k: Post-RoPE key ``(batch, kv_heads, 1, head_dim)``.
            v: Value, same shape.
            positions: ``(batch,)`` absolute position of the new token.
        """
        B = k.shape[0]
        slot = self.length.clamp(max=self.capacity - 1)  # an idle row may sit on a full cache
        self.storage.append(slot, k, v)
        held = torch.where(self.active, positions, -1)
        index = slot.view(B, 1, 1).expand(B, self.n_kv_heads, 1)
        scatter_(self.pos, 2, index, held.view(B, 1, 1).expand(B, self.n_kv_heads, 1))
        self.length.add_(self.active.long())

    def write_chunk(self, k: Tensor, v: Tensor, positions: Tensor, valid: Tensor, rows: Tensor | None = None) -> None:
        """Writes (right-padded) chunks after the filled slots of some rows: slots ``length .. length+n-1``.

        Eager work (it reads the rows' lengths on the host to check the capacity). A padded token
        writes an empty slot (position ``-1``) past the row's new length.

        Args:
            k: Post-RoPE keys ``(b, kv_heads, L, head_dim)``.
            v: Values, same shape.
            positions: ``(b, L)`` absolute positions (after every position the row holds).
            valid: ``(b, L)`` bool, False on padding.
            rows: ``(b,)`` the rows written (None: all, ``b == batch``).

        Raises:
            CacheCapacityError: A row's length plus its real tokens exceed the capacity.
        """
        b, _, L, _ = k.shape
        rows_t = torch.arange(b, device=k.device) if rows is None else rows
        start = self.length[rows_t]  # (b,)
        count = valid.sum(-1)
        need = start + count
        if int(need.max()) > self.capacity:
            worst = int(need.argmax())
            raise CacheCapacityError(
                f"a chunk of {int(count[worst])} tokens after {int(start[worst])} held slots does not fit a cache of "
                f"capacity {self.capacity}; size the cache for the chunk (the policy's capacity(..., "
                "prefill_chunk=)) or use a smaller chunk."
            )
        if int((start + L).max()) > self.capacity:  # a short row's padding would run past the end: row by row
            for i in range(b):
                n = int(count[i])
                self.write_chunk(k[i:i + 1, :, :n], v[i:i + 1, :, :n], positions[i:i + 1, :n], valid[i:i + 1, :n],
                                 rows=rows_t[i:i + 1])
            return
        slots = start[:, None] + torch.arange(L, device=k.device)  # (b, L)
        self.storage.write(rows_t, slots, k, v)
        held = torch.where(valid, positions, -1)[:, None, :].expand(b, self.n_kv_heads, L)
        self.pos[rows_t[:, None, None], torch.arange(self.n_kv_heads, device=k.device)[None, :, None],
                 slots[:, None, :]] = held
        self.length[rows_t] = need

    def attend_chunk(self, q: Tensor, positions: Tensor, scale: float, rows: Tensor | None = None) -> Tensor:
        """Attention of a chunk's queries over every filled slot at or before each query's position.

        Args:
            q: ``(b, heads, L, head_dim)`` post-RoPE queries.
            positions: ``(b, L)`` their positions.
            scale: Logit scale.
            rows: ``(b,)`` the rows (None: all).

        Returns:
            ``(b, heads, L, head_dim)``.
        """
        b, H, L, d = q.shape
        keys, values, pos = self.keys(rows), self.values(rows), self.positions(rows)  # (b, kv, cap, ...)
        visible = (pos[:, :, None, :] >= 0) & (pos[:, :, None, :] <= positions[:, None, :, None])  # (b, kv, L, cap)
        qg = q.view(b, self.n_kv_heads, self.group, L, d)  # b (kv g) L d -> b kv g L d
        out = F.scaled_dot_product_attention(qg, keys[:, :, None], values[:, :, None],
                                             attn_mask=visible[:, :, None], scale=scale)
        return out.reshape(b, H, L, d)

    def last_slot(self) -> Tensor:
        """``(batch,)`` the slot the latest :meth:`append` wrote in each row (an idle row's: the one it
        would write), for per-slot tensors kept beside the cache (an observer's)."""
        return (self.length - self.active.long()).clamp(max=self.capacity - 1)

    def attend(self, q: Tensor, scale: float, need_weights: bool = False) -> tuple[Tensor, Tensor | None]:
        """Attention of the step's rotated queries over every filled slot (call after :meth:`append`).

        Args:
            q: ``(batch, heads, 1, head_dim)`` post-RoPE queries.
            scale: Logit scale.
            need_weights: Also return the attention weights (an explicit softmax instead of a fused
                kernel where the storage has one).

        Returns:
            ``(out (batch, heads, 1, head_dim), weights (batch, kv_heads, group, capacity) or None)``;
            empty slots carry weight 0.
        """
        # the GQA group plays the role of the query length: no repeat of K/V needed. A view, not einops:
        # this runs once per layer and step, and eager decoding feels every microsecond of overhead.
        B = q.shape[0]
        qg = q.view(B, self.n_kv_heads, self.group, self.head_dim)  # b (kv g) 1 d -> b kv g d
        mask = (self.pos >= 0).unsqueeze(2)  # (batch, kv_heads, 1, capacity)
        out, weights = self.storage.attend(qg, mask, scale, need_weights=need_weights)
        # reshape: a CUDA attention kernel may return (b, kv, g, d) in another memory layout than contiguous
        return out.reshape(B, self.n_heads, 1, self.head_dim), weights  # b kv g d -> b (kv g) 1 d

    # ------------------------------------------------------------------------------- reads
    def keys(self, rows: Tensor | None = None) -> Tensor:
        """Post-RoPE keys in the compute dtype, ``(b, kv_heads, capacity, head_dim)`` (see :meth:`KVStorage.keys`)."""
        return self.storage.keys(rows)

    def values(self, rows: Tensor | None = None) -> Tensor:
        """Values in the compute dtype, like :meth:`keys`."""
        return self.storage.values(rows)

    def positions(self, rows: Tensor | None = None) -> Tensor:
        """``(b, kv_heads, capacity)`` position held by each slot (``-1`` empty)."""
        return self.pos if rows is None else self.pos[rows]

    @property
    def k(self) -> Tensor:
        """All keys in the compute dtype (read-only for non-dense storages); see :meth:`keys`."""
        return self.storage.keys()

    @property
    def v(self) -> Tensor:
        """All values in the compute dtype; see :meth:`values`."""
        return self.storage.values()

    # ------------------------------------------------------------------------------- moves
    def compact(self, rows: Tensor, keep: Tensor, keep_valid: Tensor, carry: Sequence[Tensor] = ()) -> None:
        """Keeps the given slots of some sequences, moved to the front in the given (position) order.

        Args:
            rows: ``(b,)`` batch indices of the sequences to compact.
            keep: ``(b, kv_heads, K)`` slot indices to keep, sorted by position.
            keep_valid: ``(b, kv_heads, K)`` bool; False entries are dropped (they must come last). Heads
                may keep different numbers of slots (a head-adaptive allocation): the row's length is then
                the largest, and a head that kept fewer holds empty slots (position ``-1``) below it.
            carry: Per-slot tensors ``(batch, kv_heads, capacity)`` kept beside the cache (a policy's
                accumulated scores) that move with the keys; their emptied slots become 0.
        """
        self.storage.compact(rows, keep)
        # whole rows written through an index tensor: in place for those rows only once compiled
        # (a slice assignment, pos[rows, :, :K] = ..., rewrites the whole buffer)
        tail = self.capacity - keep.shape[-1]
        for buf, empty in ((self.pos, -1), *((b, 0) for b in carry)):
            kept = torch.where(keep_valid, torch.gather(buf[rows], 2, keep), empty)
            buf.index_put_((rows,), torch.cat([kept, kept.new_full((*kept.shape[:2], tail), empty)], 2))
        counts = keep_valid.sum(-1)  # (b, kv_heads)
        self.length[rows] = counts.amax(-1) if self.row_length is None else self.row_length(counts)

    def nbytes(self) -> int:
        """Bytes of keys and values (and their scales) held by this layer."""
        return self.storage.nbytes()


class KVCache(nn.Module):
    """The per-layer caches of one model, allocated once.

    Args:
        layers: One :class:`LayerKVCache` per decoder layer.
    """

    def __init__(self, layers: list[LayerKVCache]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        for layer in layers[1:]:  # one active mask for the whole model
            layer.active = layers[0].active

    @property
    def active(self) -> Tensor:
        """``(batch,)`` bool: the rows that decode (shared by every layer; set it in place)."""
        return self.layers[0].active

    @classmethod
    def allocate(
        cls,
        n_layers: int,
        batch: int,
        n_kv_heads: int,
        n_heads: int,
        capacity: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        storage: str | type[KVStorage] = "dense",
        storage_dtype: torch.dtype | None = None,
    ) -> KVCache:
        """Allocates ``n_layers`` identical layer caches.

        Args:
            n_layers: Decoder layers.
            batch: Sequences (slots of a pool).
            n_kv_heads: Key/value heads.
            n_heads: Query heads.
            capacity: Slots per (sequence, KV head).
            head_dim: Width of a head.
            dtype: Compute dtype (the model's).
            device: Where the buffers live.
            storage: ``"dense"``, ``"int8"`` or a :class:`~beaconkv.storage.KVStorage` subclass.
            storage_dtype: Dtype a dense storage keeps keys and values in (None: ``dtype``).

        Raises:
            CacheCapacityError: ``capacity < 1``.
            beaconkv.storage.StorageError: Unknown storage or an impossible ``storage_dtype``.
        """
        if capacity < 1:
            raise CacheCapacityError(f"capacity={capacity} must be at least 1.")
        return cls([
            LayerKVCache(
                make_storage(storage, batch, n_kv_heads, capacity, head_dim, dtype, device, storage_dtype),
                n_heads,
            )
            for _ in range(n_layers)
        ])

    def __getitem__(self, i: int) -> LayerKVCache:
        return self.layers[i]

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def batch(self) -> int:
        """Sequences (rows) of the cache."""
        return self.layers[0].batch

    @property
    def capacity(self) -> int:
        """Slots per (sequence, KV head)."""
        return self.layers[0].capacity

    @property
    def device(self) -> torch.device:
        """Where the buffers live."""
        return self.layers[0].pos.device

    def nbytes(self) -> int:
        """Bytes held by keys and values (and scales) of all layers."""
        return sum(layer.nbytes() for layer in self.layers)

    def rows(self, rows: Tensor) -> CacheRows:
        """A view that prefills only ``rows`` (a slot pool admitting requests); see :class:`CacheRows`."""
        return CacheRows(self, rows)


class LayerRows:
    """One layer's cache seen through some of its rows: prefills and chunks write only those.

    Args:
        layer: The layer cache.
        rows: ``(b,)`` the rows the prompts go to.
    """

    def __init__(self, layer: LayerKVCache, rows: Tensor) -> None:
        self.layer, self.rows = layer, rows

    def write_prefill(self, k: Tensor, v: Tensor, positions: Tensor, valid: Tensor) -> None:
        """Writes ``b`` prompts into this view's rows (see :meth:`LayerKVCache.write_prefill`)."""
        self.layer.write_prefill(k, v, positions, valid, rows=self.rows)

    def write_chunk(self, k: Tensor, v: Tensor, positions: Tensor, valid: Tensor) -> None:
        """Writes ``b`` chunks after this view's rows' slots (see :meth:`LayerKVCache.write_chunk`)."""
        self.layer.write_chunk(k, v, positions, valid, rows=self.rows)

    def attend_chunk(self, q: Tensor, positions: Tensor, scale: float) -> Tensor:
        """Chunk attention over this view's rows (see :meth:`LayerKVCache.attend_chunk`)."""
        return self.layer.attend_chunk(q, positions, scale, rows=self.rows)

    def append(self, k: Tensor, v: Tensor, positions: Tensor) -> None:
        """Refused: a rows view only prefills; decode steps run every row of the whole cache.

        Raises:
            CacheCapacityError: Always, naming the fix.
        """
        raise _decode_refused()

    def attend(self, q: Tensor, scale: float, need_weights: bool = False) -> tuple[Tensor, Tensor | None]:
        """Refused, as :meth:`append`.

        Raises:
            CacheCapacityError: Always, naming the fix.
        """
        raise _decode_refused()


def _decode_refused() -> CacheCapacityError:
    return CacheCapacityError("a cache's rows view (KVCache.rows) only prefills and takes chunks; decode through "
                              "the whole KVCache (every row decodes, idle rows write nothing that counts).")


class CacheRows:
    """A :class:`KVCache` seen through some rows, for :meth:`~beaconkv.models.CausalLM.prefill` of a sub-batch.

    Args:
        cache: The whole cache.
        rows: ``(b,)`` the rows the prompts go to, in prompt order.
    """

    def __init__(self, cache: KVCache, rows: Tensor) -> None:
        self.cache, self.rows = cache, rows

    def __getitem__(self, i: int) -> LayerRows:
        return LayerRows(self.cache[i], self.rows)

    def __len__(self) -> int:
        return len(self.cache)
