"""Fixed-capacity KV cache: storage, writes, validity masks and in-place compaction.

Layout of one layer (:class:`LayerKVCache`), all buffers allocated once per generation:

* ``k``, ``v``: ``(batch, kv_heads, capacity, head_dim)``. Keys are stored **post-RoPE** at their
  own absolute positions and are never re-rotated.
* ``pos``: ``(batch, kv_heads, capacity)`` int64, the absolute position held by every slot, ``-1``
  for an empty slot. Each (sequence, KV head) may hold a *different* set of positions, always in
  increasing order in slots ``0 .. length-1``.
* ``length``: ``(batch,)`` filled slots per sequence (the same for every KV head of a sequence,
  because every eviction keeps the same number of tokens per head).
* ``queries`` / ``query_pos``: an optional ring of the last ``query_window`` **pre-RoPE** queries
  per query head, slot ``position % query_window``; eviction policies read their observation
  windows from it.
* slot buffers: per-slot tensors a policy registers (e.g. H2O's accumulated attention); they move
  with the keys on compaction.

The decode-time write (:meth:`LayerKVCache.append`) is a handful of in-place scatters with static
shapes and no host synchronisation, so it can be compiled and captured in a CUDA graph. Buffers
are mutated with ``copy_``/``scatter_``, never rebound, so compiled graphs keep their addresses.

The policy decides *what* to keep; :meth:`LayerKVCache.compact` does the moving.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn


class CacheCapacityError(ValueError):
    """A write would exceed the cache's fixed capacity."""


class LayerKVCache(nn.Module):
    """Fixed-capacity key/value storage for one attention layer.

    Args:
        batch: Sequences in the batch.
        n_kv_heads: Key/value heads.
        n_heads: Query heads (for the query ring).
        capacity: Slots per (sequence, KV head).
        head_dim: Width of a head.
        dtype: Storage dtype of keys, values and queries.
        device: Storage device.
        query_window: Length of the pre-RoPE query ring (0: no ring).
        track_attention: Whether attention layers must report decode attention weights through
            :meth:`record_attention` (H2O-style policies).

    Invariants:
        * ``length[b] <= capacity``; slots ``>= length[b]`` have ``pos == -1``.
        * Positions in slots ``0 .. length[b]-1`` are strictly increasing per (sequence, KV head).
        * Stored K/V of kept positions are bit-identical to what was written.
    """

    def __init__(
        self,
        batch: int,
        n_kv_heads: int,
        n_heads: int,
        capacity: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        query_window: int = 0,
        track_attention: bool = False,
    ) -> None:
        super().__init__()
        if capacity < 1:
            raise CacheCapacityError(f"capacity={capacity} must be at least 1.")
        self.batch, self.n_kv_heads, self.n_heads = batch, n_kv_heads, n_heads
        self.capacity, self.head_dim, self.query_window = capacity, head_dim, query_window
        self.track_attention = track_attention
        shape = (batch, n_kv_heads, capacity, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer(
            "pos", torch.full(shape[:3], -1, dtype=torch.long, device=device), persistent=False
        )
        self.register_buffer("length", torch.zeros(batch, dtype=torch.long, device=device), persistent=False)
        qshape = (batch, n_heads, query_window, head_dim)
        self.register_buffer("queries", torch.zeros(qshape, dtype=dtype, device=device), persistent=False)
        self.register_buffer(
            "query_pos", torch.full((batch, query_window), -1, dtype=torch.long, device=device), persistent=False
        )
        self.slot_buffers: dict[str, Tensor] = {}
        #: Called as ``hook(q_pre, positions, valid)`` at prefill; set by the policy.
        self.prefill_hook: Callable[[Tensor, Tensor, Tensor], None] | None = None
        #: Called as ``hook(weights)`` with decode attention weights ``(batch, kv_heads, group, capacity)``.
        self.attention_hook: Callable[[Tensor], None] | None = None

    # ------------------------------------------------------------------ writes
    def write_prefill(self, k: Tensor, v: Tensor, q_pre: Tensor, positions: Tensor, valid: Tensor) -> None:
        """Writes a (right-padded) prompt into slots ``0 .. L-1``.

        Args:
            k: Post-RoPE keys ``(batch, kv_heads, L, head_dim)``.
            v: Values, same shape.
            q_pre: Pre-RoPE queries ``(batch, heads, L, head_dim)``.
            positions: ``(batch, L)`` absolute positions.
            valid: ``(batch, L)`` bool, False on padding.

        Raises:
            CacheCapacityError: ``L`` exceeds the capacity.
        """
        L = k.shape[2]
        if L > self.capacity:
            raise CacheCapacityError(
                f"prompt of {L} tokens does not fit a cache of capacity {self.capacity}; "
                "raise the budget / max_new_tokens or shorten the prompt."
            )
        self.k[:, :, :L].copy_(k)
        self.v[:, :, :L].copy_(v)
        self.pos.fill_(-1)
        self.pos[:, :, :L].copy_(torch.where(valid, positions, -1)[:, None, :].expand(-1, self.n_kv_heads, -1))
        self.length.copy_(valid.sum(-1))
        for buf in self.slot_buffers.values():
            buf.zero_()
        if self.query_window:
            self._write_prefill_queries(q_pre, self.length)
        if self.prefill_hook is not None:
            self.prefill_hook(q_pre, positions, valid)

    def _write_prefill_queries(self, q_pre: Tensor, lengths: Tensor) -> None:
        """Puts the last ``query_window`` prompt queries of each sequence into the ring."""
        R = self.query_window
        slots = torch.arange(R, device=lengths.device)
        last = lengths[:, None] - 1  # (batch, 1)
        # the latest prompt position p <= last with p % R == slot
        p = last - torch.remainder(last - slots, R)  # (batch, R)
        ok = p >= 0
        idx = p.clamp(min=0)
        gathered = torch.gather(q_pre, 2, idx[:, None, :, None].expand(-1, q_pre.shape[1], -1, q_pre.shape[3]))
        self.queries.copy_(torch.where(ok[:, None, :, None], gathered, 0).to(self.queries.dtype))
        self.query_pos.copy_(torch.where(ok, p, -1))

    def append(self, k: Tensor, v: Tensor, q_pre: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Writes one decode token per sequence at slot ``length[b]`` and returns the whole cache.

        Static shapes, in-place, no host sync. The caller (the policy driver) guarantees there is a
        free slot: it evicts before the cache is full.

        Args:
            k: Post-RoPE key ``(batch, kv_heads, 1, head_dim)``.
            v: Value, same shape.
            q_pre: Pre-RoPE query ``(batch, heads, 1, head_dim)``.
            positions: ``(batch,)`` absolute position of the new token.

        Returns:
            ``(k, v, valid)``: the full key/value buffers and the ``(batch, kv_heads, capacity)`` bool
            mask of filled slots.
        """
        B, H, _, D = k.shape
        slot = self.length.view(B, 1, 1, 1).expand(B, H, 1, D)
        self.k.scatter_(2, slot, k.to(self.k.dtype))
        self.v.scatter_(2, slot, v.to(self.v.dtype))
        self.pos.scatter_(2, slot[..., 0], positions.view(B, 1, 1).expand(B, H, 1))
        for buf in self.slot_buffers.values():
            buf.scatter_(2, slot[..., 0], 0)
        self.length.add_(1)
        if self.query_window:
            qslot = torch.remainder(positions, self.query_window).view(B, 1)
            self.queries.scatter_(
                2, qslot.view(B, 1, 1, 1).expand(B, self.n_heads, 1, D), q_pre.to(self.queries.dtype)
            )
            self.query_pos.scatter_(1, qslot, positions.view(B, 1))
        return self.k, self.v, self.pos >= 0

    def record_attention(self, weights: Tensor) -> None:
        """Forwards decode attention weights ``(batch, kv_heads, group, capacity)`` to the policy hook."""
        if self.attention_hook is not None:
            self.attention_hook(weights)

    def register_slot_buffer(self, name: str, dtype: torch.dtype = torch.float32) -> Tensor:
        """Allocates a zeroed per-slot buffer ``(batch, kv_heads, capacity)`` that moves with the keys.

        Args:
            name: Key of the buffer in :attr:`slot_buffers`.
            dtype: Its dtype.

        Returns:
            The buffer (mutate it in place).
        """
        buf = torch.zeros(self.pos.shape, dtype=dtype, device=self.pos.device)
        self.slot_buffers[name] = buf
        return buf

    # ------------------------------------------------------------- compaction
    def compact(self, rows: Tensor, keep: Tensor, keep_valid: Tensor) -> None:
        """Keeps the given slots of some sequences, moved to the front in the given (position) order.

        Args:
            rows: ``(b,)`` batch indices of the sequences to compact.
            keep: ``(b, kv_heads, K)`` slot indices to keep, sorted by position.
            keep_valid: ``(b, kv_heads, K)`` bool; False entries are dropped (they must come last, and
                every KV head of a sequence must keep the same number of slots).
        """
        K = keep.shape[-1]
        D = self.head_dim
        idx4 = keep.unsqueeze(-1).expand(-1, -1, -1, D)
        for name in ("k", "v"):
            buf = getattr(self, name)
            kept = torch.gather(buf[rows], 2, idx4)
            buf[rows, :, :K] = kept
        new_pos = torch.where(keep_valid, torch.gather(self.pos[rows], 2, keep), -1)
        self.pos[rows, :, :K] = new_pos
        self.pos[rows, :, K:] = -1
        for buf in self.slot_buffers.values():
            kept = torch.where(keep_valid, torch.gather(buf[rows], 2, keep), 0)
            buf[rows, :, :K] = kept
            buf[rows, :, K:] = 0
        self.length[rows] = keep_valid[:, 0].sum(-1)

    def positions_of(self, rows: Tensor | None = None) -> Tensor:
        """Returns the ``pos`` buffer (optionally for some sequences)."""
        return self.pos if rows is None else self.pos[rows]


class KVCache(nn.Module):
    """The per-layer caches of one model, allocated once per generation.

    Args:
        layers: One :class:`LayerKVCache` per decoder layer.
    """

    def __init__(self, layers: list[LayerKVCache]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

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
        query_window: int = 0,
        track_attention: bool = False,
    ) -> "KVCache":
        """Allocates ``n_layers`` identical layer caches (see :class:`LayerKVCache` for the arguments)."""
        return cls(
            [
                LayerKVCache(
                    batch, n_kv_heads, n_heads, capacity, head_dim, dtype, device, query_window, track_attention
                )
                for _ in range(n_layers)
            ]
        )

    def __getitem__(self, i: int) -> LayerKVCache:
        return self.layers[i]

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def capacity(self) -> int:
        """Slots per (sequence, KV head)."""
        return self.layers[0].capacity

    def nbytes(self) -> int:
        """Bytes held by keys and values of all layers."""
        return sum(layer.k.nbytes + layer.v.nbytes for layer in self.layers)
