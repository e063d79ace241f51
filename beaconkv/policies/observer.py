"""What a policy observes of each layer, owned by the policy's state: the query ring, per-slot buffers, the taps.

The cache (:mod:`beaconkv.cache`) stores keys and values; everything a policy learns from the model
lives here, one :class:`ObservedLayer` per layer in
:attr:`PolicyState.observers <beaconkv.policies.state.PolicyState.observers>`:

* a :class:`QueryRing` of the last ``window`` **pre-RoPE** queries per query head (slot
  ``position % window``), which SnapKV, RPC, R-KV and BeaconKV read their observation windows from;
* per-slot buffers (H2O's accumulated attention), which move with the keys on compaction
  (:meth:`ObservedLayer.compact` hands them to the cache as its ``carry``);
* the two taps attention calls (:class:`~beaconkv.observation.LayerObserver`): :meth:`ObservedLayer.prefill`
  writes the prompt's queries into the ring and runs the policy's
  :meth:`~beaconkv.policies.EvictionPolicy.observe_prefill` through the state's executor (BeaconKV's
  prompt FPS: eager or compiled, like an eviction); :meth:`ObservedLayer.decode` writes the step's query
  and hands the weights to :meth:`~beaconkv.policies.EvictionPolicy.observe_attention`.

An :class:`ObservedLayer` is also what a policy's device functions receive as a layer
(``score(state, layer_state, cache, rows, t)``): the cache's reads (keys, positions, sizes) and moves
(:meth:`~ObservedLayer.compact`) next to the policy's own observations, so a policy never needs more of
a host's cache than that (:mod:`tests.policies.test_second_host` runs policies on a plain-tensor cache).
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

import torch
from torch import Tensor

from ..cache import CacheCapacityError, LayerKVCache
from ..inplace import scatter_
from .state import PolicyState


class ObservingPolicy(Protocol):
    """What an observer uses of its policy (:class:`~beaconkv.policies.EvictionPolicy`): the taps it forwards."""

    track_attention: ClassVar[bool]

    @property
    def observes_prefill(self) -> bool: ...  # noqa: D102 - whether observe_prefill is overridden

    def observe_prefill(self, state: PolicyState, layer_state: Any, q_pre: Tensor, positions: Tensor, valid: Tensor,
                        rows: Tensor) -> None: ...  # noqa: D102

    def observe_attention(self, state: PolicyState, layer_state: Any, weights: Tensor) -> None: ...  # noqa: D102

    @property
    def observes_chunk(self) -> bool: ...  # noqa: D102 - whether observe_chunk is overridden

    def observe_chunk(self, state: PolicyState, layer_state: Any, q_pre: Tensor, positions: Tensor, valid: Tensor,
                      rows: Tensor) -> None: ...  # noqa: D102


class QueryRing:
    """The last ``window`` pre-RoPE queries of every row and query head, slot ``position % window``.

    Args:
        batch: Rows.
        n_heads: Query heads.
        window: Queries kept per (row, head), >= 1.
        head_dim: Width of a head.
        dtype: Dtype of the stored queries (the model's compute dtype).
        device: Where the buffers live.

    Attributes:
        queries: ``(batch, heads, window, head_dim)`` the stored queries.
        query_pos: ``(batch, window)`` the position each slot holds (``-1``: none).
    """

    def __init__(self, batch: int, n_heads: int, window: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        if window < 1:
            raise CacheCapacityError(f"a query ring needs window >= 1, got {window}.")
        self.window, self.n_heads, self.head_dim = window, n_heads, head_dim
        self.queries = torch.zeros(batch, n_heads, window, head_dim, dtype=dtype, device=device)
        self.query_pos = torch.full((batch, window), -1, dtype=torch.long, device=device)

    def write_prefill(self, q_pre: Tensor, valid: Tensor, rows: Tensor) -> None:
        """Puts the last ``window`` prompt queries of each prompt into the ring of its row.

        Args:
            q_pre: ``(b, heads, L, head_dim)`` right-padded prompt queries.
            valid: ``(b, L)`` False on padding.
            rows: ``(b,)`` the rows.
        """
        R = self.window
        slots = torch.arange(R, device=valid.device)
        last = valid.sum(-1)[:, None] - 1  # (b, 1)
        # the latest prompt position p <= last with p % R == slot
        p = last - torch.remainder(last - slots, R)  # (b, R)
        ok = p >= 0
        idx = p.clamp(min=0)
        gathered = torch.gather(q_pre, 2, idx[:, None, :, None].expand(-1, q_pre.shape[1], -1, q_pre.shape[3]))
        self.queries[rows] = torch.where(ok[:, None, :, None], gathered, 0).to(self.queries.dtype)
        self.query_pos[rows] = torch.where(ok, p, -1)

    def write_chunk(self, q_pre: Tensor, positions: Tensor, valid: Tensor, rows: Tensor) -> None:
        """Puts a chunk's queries into the ring after what each row holds: the chunk's last ``window``
        positions replace the slots they map to; the others keep their older queries.

        Args:
            q_pre: ``(b, heads, L, head_dim)`` right-padded chunk queries.
            positions: ``(b, L)`` their positions (consecutive from ``positions[:, 0]``).
            valid: ``(b, L)`` False on padding.
            rows: ``(b,)`` the rows.
        """
        R = self.window
        slots = torch.arange(R, device=valid.device)
        first = positions[:, :1]  # (b, 1)
        last = first + valid.sum(-1, keepdim=True) - 1
        p = last - torch.remainder(last - slots, R)  # (b, R): the chunk's latest position on each slot
        ok = p >= first
        idx = (p - first).clamp(min=0)
        gathered = torch.gather(q_pre, 2, idx[:, None, :, None].expand(-1, q_pre.shape[1], -1, q_pre.shape[3]))
        self.queries[rows] = torch.where(ok[:, None, :, None], gathered.to(self.queries.dtype), self.queries[rows])
        self.query_pos[rows] = torch.where(ok, p, self.query_pos[rows])

    def append(self, q_pre: Tensor, positions: Tensor, active: Tensor) -> None:
        """Writes one decode query per row in place (static shapes, no host read).

        Args:
            q_pre: ``(batch, heads, 1, head_dim)``.
            positions: ``(batch,)`` its position.
            active: ``(batch,)`` the rows that decode (the others' slot then holds no position).
        """
        B = q_pre.shape[0]
        held = torch.where(active, positions, -1)
        qslot = torch.remainder(positions, self.window).view(B, 1)
        scatter_(self.queries, 2, qslot.view(B, 1, 1, 1).expand(B, self.n_heads, 1, self.head_dim),
                 q_pre.to(self.queries.dtype))
        scatter_(self.query_pos, 1, qslot, held.view(B, 1))

    def ring(self, rows: Tensor, lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The queries whose positions lie in ``(lo, hi]``.

        Args:
            rows: ``(b,)`` rows.
            lo: ``(b,)`` exclusive lower position bound.
            hi: ``(b,)`` inclusive upper position bound.

        Returns:
            ``(queries (b, heads, R, head_dim), positions (b, R), mask (b, R))``.
        """
        q, qpos = self.queries[rows], self.query_pos[rows]
        mask = (qpos >= 0) & (qpos > lo[:, None]) & (qpos <= hi[:, None])
        return q, qpos, mask

    def ring_at(self, rows: Tensor | None, positions: Tensor) -> tuple[Tensor, Tensor]:
        """The queries at given positions.

        Args:
            rows: ``(b,)`` rows (None: every row, read in place: no copy of the ring).
            positions: ``(b, n)`` positions (any; those the ring no longer or never held come back unheld).

        Returns:
            ``(queries (b, heads, n, head_dim), held (b, n))``: ``held`` is False where the ring does not
            hold that position (its query there is whatever the slot holds).
        """
        slots = positions.remainder(self.window)
        queries, query_pos = (self.queries, self.query_pos) if rows is None else (self.queries[rows], self.query_pos[rows])
        held = torch.gather(query_pos, 1, slots) == positions
        idx = slots[:, None, :, None].expand(-1, self.n_heads, -1, self.head_dim)
        return torch.gather(queries, 2, idx), held

    def tensors(self) -> tuple[Tensor, Tensor]:
        """The ring's buffers (written in place by the decode step)."""
        return self.queries, self.query_pos


class ObservedLayer:
    """One layer as a policy sees it: the layer's cache, and the policy's own observations of it.

    Made by :meth:`~beaconkv.policies.EvictionPolicy.create_state`, one per layer; attention calls it
    as the layer's :class:`~beaconkv.observation.LayerObserver`, and the policy's device functions
    receive it as the layer they score and compact.

    Args:
        policy: The policy (its hooks are called with ``state``).
        state: The policy's state this observer belongs to.
        cache: The layer's cache: a :class:`~beaconkv.cache.LayerKVCache`, or any store with its sizes
            (``batch``, ``n_heads``, ``n_kv_heads``, ``head_dim``, ``capacity``, ``dtype``), reads (``keys``,
            ``values``, ``positions``) and moves (``compact`` with ``carry``, and ``last_slot`` when the
            policy keeps slot buffers). Which rows decode is the model-level cache's ``active``.
        ring: The layer's query ring (None: the policy reads no queries).

    Attributes:
        cache: The layer's cache.
        batch: Rows of the cache; likewise ``n_heads``, ``n_kv_heads``, ``group`` (query heads per KV head),
            ``head_dim``, ``capacity`` (slots per row and KV head) and ``dtype`` (of keys and queries): the
            cache's sizes.
        ring_buffer: The :class:`QueryRing` (None without one).
        slot_buffers: Per-slot tensors ``(batch, kv_heads, capacity)`` by name, moved with the keys.
        layer_state: ``state.layers[i]`` of this layer (set once the policy's ``init_state`` made it).
        needs_weights: Whether the decode step must hand over attention weights (the policy's
            ``track_attention``).
    """

    def __init__(self, policy: ObservingPolicy, state: PolicyState, cache: LayerKVCache,
                 ring: QueryRing | None = None) -> None:
        self.policy, self.state, self.cache, self.ring_buffer = policy, state, cache, ring
        # the store's sizes never change: read once, plain attributes on every hot path after
        self.batch, self.n_heads, self.n_kv_heads = cache.batch, cache.n_heads, cache.n_kv_heads
        self.head_dim, self.capacity, self.dtype = cache.head_dim, cache.capacity, cache.dtype
        self.group = self.n_heads // self.n_kv_heads
        self.slot_buffers: dict[str, Tensor] = {}
        self.layer_state: Any = None
        self.needs_weights = type(policy).track_attention

    # ------------------------------------------------------------------------------- the cache's reads
    def keys(self, rows: Tensor | None = None) -> Tensor:
        """Post-RoPE keys ``(b, kv_heads, capacity, head_dim)`` (see :meth:`~beaconkv.cache.LayerKVCache.keys`)."""
        return self.cache.keys(rows)

    def values(self, rows: Tensor | None = None) -> Tensor:
        """Values, like :meth:`keys`."""
        return self.cache.values(rows)

    def positions(self, rows: Tensor | None = None) -> Tensor:
        """``(b, kv_heads, capacity)`` the position each slot holds (``-1`` empty)."""
        return self.cache.positions(rows)

    def compact(self, rows: Tensor, keep: Tensor, keep_valid: Tensor) -> None:
        """Keeps the given slots (see :meth:`~beaconkv.cache.LayerKVCache.compact`); the slot buffers move along."""
        self.cache.compact(rows, keep, keep_valid, carry=tuple(self.slot_buffers.values()))

    # ------------------------------------------------------------------------------- the policy's observations
    @property
    def query_window(self) -> int:
        """Pre-RoPE queries the ring keeps per head (0: no ring)."""
        return 0 if self.ring_buffer is None else self.ring_buffer.window

    def ring(self, rows: Tensor, lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The ring's queries with positions in ``(lo, hi]`` (see :meth:`QueryRing.ring`)."""
        return self._ring().ring(rows, lo, hi)

    def ring_at(self, rows: Tensor | None, positions: Tensor) -> tuple[Tensor, Tensor]:
        """The ring's queries at given positions (see :meth:`QueryRing.ring_at`)."""
        return self._ring().ring_at(rows, positions)

    def _ring(self) -> QueryRing:
        if self.ring_buffer is None:
            raise CacheCapacityError(f"{type(self.policy).__name__} reads the query ring but its query_window() is 0; "
                                     "return the window it reads from query_window(max_tokens).")
        return self.ring_buffer

    def register_slot_buffer(self, name: str, dtype: torch.dtype = torch.float32) -> Tensor:
        """Allocates a zeroed per-slot buffer ``(batch, kv_heads, capacity)`` that moves with the keys.

        A decode step zeroes the slot it writes; a prefill zeroes its rows.

        Args:
            name: Key of the buffer in :attr:`slot_buffers`.
            dtype: Its dtype.

        Returns:
            The buffer (mutate it in place).
        """
        buf = torch.zeros(self.batch, self.n_kv_heads, self.capacity, dtype=dtype, device=self.state.device)
        self.slot_buffers[name] = buf
        return buf

    @property
    def observes_decode(self) -> bool:
        """Whether :meth:`decode` does anything (a ring, slot buffers or weights to hand over): a decode step
        skips an observer that does not."""
        return self.ring_buffer is not None or bool(self.slot_buffers) or self.needs_weights

    def tensors(self) -> list[Tensor]:
        """The tensors a decode step writes in place here (ring and slot buffers), for an executor's ``prepare``."""
        return [*(self.ring_buffer.tensors() if self.ring_buffer is not None else ()), *self.slot_buffers.values()]

    # ------------------------------------------------------------------------------- the taps attention calls
    def prefill(self, q_pre: Tensor, positions: Tensor, valid: Tensor, rows: Tensor | None = None) -> None:
        """Sees one layer's prompt queries (after the cache wrote the prompts); see
        :meth:`~beaconkv.observation.LayerObserver.prefill`.

        Args:
            q_pre: ``(b, heads, L, head_dim)`` pre-RoPE queries.
            positions: ``(b, L)`` their positions.
            valid: ``(b, L)`` False on padding.
            rows: ``(b,)`` the rows being prefilled (None: every row; :meth:`rows` makes a view that passes them).
        """
        rows = self.state.all_rows if rows is None else rows
        for buf in self.slot_buffers.values():
            buf[rows] = 0
        if self.ring_buffer is not None:
            self.ring_buffer.write_prefill(q_pre, valid, rows)
        if self.policy.observes_prefill:
            policy = self.policy
            self.state.executor.run(type(policy).observe_prefill, policy, self.state, self.layer_state, q_pre,
                                    positions, valid, rows)

    def chunk(self, q_pre: Tensor, positions: Tensor, valid: Tensor, rows: Tensor | None = None) -> None:
        """Sees one layer's chunk queries (after the cache wrote the chunk after each row's slots); see
        :meth:`~beaconkv.observation.ChunkedLayerObserver.chunk`.

        Zeroes the slot buffers at the slots the chunk wrote, writes the queries into the ring after the
        row's older ones (:meth:`QueryRing.write_chunk`), then runs the policy's
        :meth:`~beaconkv.policies.EvictionPolicy.observe_chunk` through the state's executor.

        Args:
            q_pre: ``(b, heads, L, head_dim)`` pre-RoPE queries.
            positions: ``(b, L)`` their positions.
            valid: ``(b, L)`` False on padding.
            rows: ``(b,)`` the rows (None: every row).
        """
        rows = self.state.all_rows if rows is None else rows
        if self.slot_buffers:
            written = self.cache.positions(rows) >= positions[:, :1, None]  # (b, kv_heads, capacity)
            for buf in self.slot_buffers.values():
                buf[rows] = torch.where(written, 0, buf[rows])
        if self.ring_buffer is not None:
            self.ring_buffer.write_chunk(q_pre, positions, valid, rows)
        if self.policy.observes_chunk:
            policy = self.policy
            self.state.executor.run(type(policy).observe_chunk, policy, self.state, self.layer_state, q_pre,
                                    positions, valid, rows)

    def decode(self, q_pre: Tensor, positions: Tensor, weights: Tensor | None) -> None:
        """Sees one decode step (after the cache's ``append`` and ``attend``); device ops only.

        Zeroes the slot each row wrote in the slot buffers, writes the query into the ring (a row that
        does not decode writes none) and hands ``weights`` to the policy's
        :meth:`~beaconkv.policies.EvictionPolicy.observe_attention`.
        """
        if self.slot_buffers:
            B = positions.shape[0]
            index = self.cache.last_slot().view(B, 1, 1).expand(B, self.n_kv_heads, 1)
            for buf in self.slot_buffers.values():
                scatter_(buf, 2, index, 0)
        if self.ring_buffer is not None:
            self.ring_buffer.append(q_pre, positions, self.state.active)
        if weights is not None:
            self.policy.observe_attention(self.state, self.layer_state, weights)

    def rows(self, rows: Tensor) -> ObserverRows:
        """A view whose :meth:`prefill` observes the prompts of ``rows`` (a slot pool admitting requests)."""
        return ObserverRows(self, rows)


class ObserverRows:
    """An :class:`ObservedLayer` seen through some rows: its prefill observes the prompts of those rows.

    Args:
        observer: The layer's observer.
        rows: ``(b,)`` the rows the prompts go to, in prompt order.
    """

    needs_weights = False

    def __init__(self, observer: ObservedLayer, rows: Tensor) -> None:
        self.observer, self.rows = observer, rows

    def prefill(self, q_pre: Tensor, positions: Tensor, valid: Tensor) -> None:
        """Observes ``b`` prompts of this view's rows (see :meth:`ObservedLayer.prefill`)."""
        self.observer.prefill(q_pre, positions, valid, self.rows)

    def chunk(self, q_pre: Tensor, positions: Tensor, valid: Tensor) -> None:
        """Observes ``b`` chunks of this view's rows (see :meth:`ObservedLayer.chunk`)."""
        self.observer.chunk(q_pre, positions, valid, self.rows)

    def decode(self, q_pre: Tensor, positions: Tensor, weights: Tensor | None) -> None:
        """Refused: a rows view only prefills; decode steps observe every row.

        Raises:
            CacheCapacityError: Always, naming the fix.
        """
        raise CacheCapacityError("an observer's rows view only prefills; decode with the state's observers "
                                 "(every row decodes, idle rows write nothing that counts).")
