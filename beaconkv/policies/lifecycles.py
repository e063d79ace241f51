"""Where BeaconKV keeps the past queries it draws beacons from: two lifecycles, one interface.

* :class:`BoundedObservation` — the paper's Continual FPS (SPEC §3-4): a per-head observation set
  of ``B_min^Q`` vectors, the prompt's FPS at prefill; decode queries wait in the observer's query ring
  and are folded in (FPS back to ``B_min^Q``) whenever set + pending reach ``B_max^Q``; beacons are
  sampled from set + pending; after an eviction the set becomes FPS(beacons ∪ recent). Memory: at
  most ``B_max^Q`` vectors per head.
* :class:`QueryHistory` — Naive FPS and K-Means (analysis, Fig. 7): every query of the sequence,
  prompt and decode, is kept (the observer's ring is sized to the whole sequence), and the beacons are
  sampled from all of them at each freeze. Memory: the whole history.

:class:`~beaconkv.policies.beacon.BeaconKV` picks one by its ``query_memory`` setting (``"bounded"`` or
``"history"``); its schedule (when to compress, freeze, roll) is the same for both, and :class:`Phase`
names where a row is in it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from enum import Enum
from typing import Any, Protocol

import torch
from torch import Tensor

from .observer import ObservedLayer
from .query_set import QuerySet
from .query_selection import QuerySelector
from .state import PolicyState


class Phase(str, Enum):
    """Where a row of BeaconKV is in its cycle (a string too, so ``phase == "frozen"`` reads as before)."""

    ACCUMULATE = "accumulate"
    """Queries gather in the observation set (steps 1-2)."""
    FROZEN = "frozen"
    """Beacons chosen; the recent queries gather until the eviction (step 3)."""
    STATIC = "static"
    """Initial+Recent: beacons fixed after the prompt."""


class BeaconSettings(Protocol):
    """What a lifecycle reads of its policy (a :class:`beaconkv.policies.beacon.BeaconKV`)."""

    n_beacon: int
    n_recent: int
    sampler: QuerySelector

    @property
    def q_min(self) -> int: ...  # noqa: D102 - BeaconKV's B_min^Q

    @property
    def q_max(self) -> int: ...  # noqa: D102 - BeaconKV's B_max^Q

    def sample(self, state: Any, candidates: QuerySet, k: int) -> QuerySet: ...  # noqa: D102

    def set_heads(self, cache: ObservedLayer) -> int: ...  # noqa: D102

    def candidates(self, queries: QuerySet, cache: ObservedLayer) -> QuerySet: ...  # noqa: D102


def ring_set(cache: ObservedLayer, rows: Tensor, lo: Tensor, hi: Tensor) -> QuerySet:
    """The ring's queries with positions in ``(lo, hi]`` as a :class:`QuerySet` (per head)."""
    q, qpos, mask = cache.ring(rows, lo, hi)
    H = q.shape[1]
    return QuerySet(q, qpos[:, None].expand(-1, H, -1), mask[:, None].expand(-1, H, -1))


def ring_since(state: PolicyState, rows: list[int], rows_t: Tensor, since: list[int], since_dev: Tensor) -> QuerySet:
    """Every layer's ring queries of ``rows`` at positions in ``(since, t]``, stacked over layers.

    Shape ``(layers, b, heads, n, head_dim)`` with ``n`` the largest such count over the rows (known
    on the host; rows with fewer are masked). Only the ring slots that can hold them are read, and
    the positions are computed on the device (no host-to-device copy).

    Args:
        state: The policy's state.
        rows: Row indices (host).
        rows_t: The same on the device.
        since: Host, per row of ``rows``: exclusive lower bound.
        since_dev: Device ``(batch,)`` mirror of the bound for every row.
    """
    layers = state.observers
    n = max(min(max(state.t[b] - s for b, s in zip(rows, since)), layers[0].query_window), 0)
    pos = state.t_dev[rows_t][:, None] - n + 1 + torch.arange(n, device=rows_t.device)  # (b, n)
    read = [c.ring_at(rows_t, pos) for c in layers]
    held = read[0][1]  # every layer's ring holds the same positions: layer 0 tells
    valid = held & (pos > since_dev[rows_t][:, None])
    pos = torch.where(valid, pos, -1)
    q = torch.stack([queries for queries, _ in read])
    shape = (len(layers), len(rows), layers[0].n_heads, n)
    return QuerySet(q, pos[None, :, None].expand(shape), valid[None, :, None].expand(shape))


class QueryLifecycle(ABC):
    """How BeaconKV keeps its candidate queries (see the module docstring)."""

    #: Whether the memory is bounded by ``B_max^Q`` vectors per head.
    bounded: bool

    @abstractmethod
    def query_window(self, policy: BeaconSettings, max_tokens: int) -> int:
        """Length of the cache's query ring this lifecycle needs."""

    def init(self, policy: BeaconSettings, state: Any) -> None:
        """Allocates the lifecycle's own tensors in the state. Default: nothing."""

    def observe_prefill(self, policy: BeaconSettings, layer_state: Any, q_pre: Tensor, positions: Tensor, valid: Tensor,
                        rows: Tensor) -> None:
        """Sees one layer's prompt queries. Default: nothing (the ring keeps them)."""

    def prefill_count(self, policy: BeaconSettings, prompt_length: int) -> int:
        """Vectors in the observation set right after the prefill. Default: 0."""
        return 0

    def observe_chunk(self, policy: BeaconSettings, layer_state: Any, q_pre: Tensor, positions: Tensor, valid: Tensor,
                      rows: Tensor) -> None:
        """Sees one layer's chunk queries (a prompt prefilled in chunks). Default: nothing (the ring keeps them)."""

    def chunk_count(self, policy: BeaconSettings, count: int, n_new: int) -> int:
        """Vectors in the observation set after a chunk of ``n_new`` queries joined ``count``. Default: 0."""
        return 0

    def unfreeze(self, policy: BeaconSettings, state: Any, rows: list[int], rows_t: Tensor) -> None:
        """A frozen row goes back to accumulating (a chunk arrived before its eviction): its beacons return to
        the candidates. Default: nothing (the ring still holds every candidate)."""

    def compress_due(self, policy: BeaconSettings, state: Any, rows: list[int]) -> list[int]:
        """Rows whose pending queries must be folded in now. Default: none."""
        return []

    def compress(self, policy: BeaconSettings, state: Any, rows: list[int]) -> None:
        """Step 2 for ``rows``. Default: nothing."""

    @abstractmethod
    def freeze_candidates(self, policy: BeaconSettings, state: Any, rows: list[int], rows_t: Tensor) -> QuerySet:
        """The queries step 3 samples the beacons from, every layer's stacked."""

    def roll(self, policy: BeaconSettings, state: Any, rows: list[int], rows_t: Tensor) -> None:
        """Step 6 for ``rows`` (before the beacons are cleared). Default: nothing."""

    @abstractmethod
    def held(self, policy: BeaconSettings, state: Any, row: int) -> tuple[int, int]:
        """Query vectors held for one live row: ``(stored per set, pending in the ring per query head)``."""


class BoundedObservation(QueryLifecycle):
    """Continual FPS: a bounded observation set, compressed as it fills (memory <= ``B_max^Q`` per head)."""

    bounded = True

    def query_window(self, policy: BeaconSettings, max_tokens: int) -> int:
        return max(policy.q_max, policy.n_recent, 1)

    def init(self, policy: BeaconSettings, state: Any) -> None:
        first = state.observers[0]
        state.obs = QuerySet.empty(first.batch, policy.set_heads(first), policy.q_min, first.head_dim, first.dtype,
                                   state.device, layers=len(state.cache))

    def observe_prefill(self, policy: BeaconSettings, layer_state: Any, q_pre: Tensor, positions: Tensor, valid: Tensor,
                        rows: Tensor) -> None:
        B, H, L, _ = q_pre.shape
        prompt = QuerySet(q_pre, positions[:, None].expand(B, H, L), valid[:, None].expand(B, H, L))
        prompt = policy.candidates(prompt, layer_state.cache)
        layer_state.obs.assign(rows, prompt.select(policy.sampler, policy.q_min))

    def prefill_count(self, policy: BeaconSettings, prompt_length: int) -> int:
        return min(prompt_length, policy.q_min)

    def observe_chunk(self, policy: BeaconSettings, layer_state: Any, q_pre: Tensor, positions: Tensor, valid: Tensor,
                      rows: Tensor) -> None:
        B, H, L, _ = q_pre.shape
        chunk = policy.candidates(QuerySet(q_pre, positions[:, None].expand(B, H, L), valid[:, None].expand(B, H, L)),
                                  layer_state.cache)
        layer_state.obs.assign(rows, QuerySet.cat(layer_state.obs.rows(rows), chunk).select(policy.sampler,
                                                                                             policy.q_min))

    def chunk_count(self, policy: BeaconSettings, count: int, n_new: int) -> int:
        return min(count + n_new, policy.q_min)

    def unfreeze(self, policy: BeaconSettings, state: Any, rows: list[int], rows_t: Tensor) -> None:
        folded = QuerySet.cat(state.obs.rows(rows_t), state.beacons.rows(rows_t))
        state.obs.assign(rows_t, policy.sample(state, folded, policy.q_min))

    def compress_due(self, policy: BeaconSettings, state: Any, rows: list[int]) -> list[int]:
        return [b for b in rows if state.phase[b] is Phase.ACCUMULATE
                and state.obs_count[b] + (state.t[b] - state.obs_since[b]) >= policy.q_max]

    def compress(self, policy: BeaconSettings, state: Any, rows: list[int]) -> None:
        rows_t = state.index(rows)
        pending = policy.candidates(ring_since(state, rows, rows_t, [state.obs_since[b] for b in rows],
                                               state.obs_since_dev), state.observers[0])
        state.obs.assign(rows_t, policy.sample(state, QuerySet.cat(state.obs.rows(rows_t), pending), policy.q_min))
        for b in rows:
            state.obs_count[b] = min(state.obs_count[b] + state.t[b] - state.obs_since[b], policy.q_min)
            state.obs_since[b] = state.t[b]
        state.obs_since_dev[rows_t] = state.t_dev[rows_t]

    def freeze_candidates(self, policy: BeaconSettings, state: Any, rows: list[int], rows_t: Tensor) -> QuerySet:
        pending = policy.candidates(ring_since(state, rows, rows_t, [state.obs_since[b] for b in rows],
                                               state.obs_since_dev), state.observers[0])
        return QuerySet.cat(state.obs.rows(rows_t), pending)

    def roll(self, policy: BeaconSettings, state: Any, rows: list[int], rows_t: Tensor) -> None:
        recent = policy.candidates(ring_since(state, rows, rows_t, [state.recent_since[b] for b in rows],
                                              state.recent_since_dev), state.observers[0])
        state.obs.assign(rows_t, policy.sample(state, QuerySet.cat(state.beacons.rows(rows_t), recent), policy.q_min))
        for b in rows:
            state.obs_count[b] = min(policy.n_beacon + state.t[b] - state.recent_since[b], policy.q_min)

    def held(self, policy: BeaconSettings, state: Any, row: int) -> tuple[int, int]:
        if state.phase[row] is Phase.ACCUMULATE:
            return state.obs_count[row], state.t[row] - state.obs_since[row]
        return policy.n_beacon, min(state.t[row] - state.recent_since[row], policy.n_recent)


class QueryHistory(QueryLifecycle):
    """Naive FPS / K-Means: every query of the sequence is kept; beacons sampled from all of them."""

    bounded = False

    def query_window(self, policy: BeaconSettings, max_tokens: int) -> int:
        return max(max_tokens, policy.n_recent, 1)  # the ring holds the whole sequence

    def freeze_candidates(self, policy: BeaconSettings, state: Any, rows: list[int], rows_t: Tensor) -> QuerySet:
        history = ring_since(state, rows, rows_t, [-1] * len(rows), torch.full_like(state.t_dev, -1))
        return policy.candidates(history, state.observers[0])

    def held(self, policy: BeaconSettings, state: Any, row: int) -> tuple[int, int]:
        return 0, state.t[row] + 1  # the whole history lives in the ring
