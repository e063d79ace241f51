"""Event-driven beacon refresh: a query that looks far back joins the beacons at once.

BeaconKV refreshes its beacons at a fixed cadence (the freeze before each eviction), from an
observation set compressed by FPS — a rare global query can be diluted away before it is ever used.
Here each query is checked as it is decoded, from a cheap signal the attention already computes: the
share of its attention on *generated* tokens outside the recent window (neither the protected prompt
nor the last ``event_window`` tokens). A query whose share reaches ``event_mass`` is a likely
thought-revisiting query; its pre-RoPE vector is written at once into a small per-head ring of
``n_events`` **event beacons**, which score the cache at every eviction next to the regular beacons
(rotated to the current position) until newer events replace them.

The check runs inside the decode step (static shapes, device ops only), so it compiles with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from einops import rearrange
from torch import Tensor

from ..inplace import scatter_
from .observer import ObservedLayer
from .beacon import BeaconKV, BeaconLayer, BeaconState
from .config import check_int, check_number
from .query_set import QuerySet
from .state import PolicyState


@dataclass(eq=False)
class EventLayer(BeaconLayer):
    """One layer's views, with its event beacons.

    Attributes:
        events: ``(batch, heads, n_events, head_dim)`` the latest far-looking queries.
        next_slot: ``(batch, heads)`` the event slot each head writes next (a ring).
    """

    events: QuerySet | None = None
    next_slot: Tensor | None = None


@dataclass(eq=False)
class EventState(BeaconState):
    """BeaconKV's state plus every layer's event beacons, stacked.

    Attributes:
        events: ``(layers, batch, heads, n_events, head_dim)``.
        next_slot: ``(layers, batch, heads)`` int64.
        flagged: ``(batch,)`` far-looking queries taken in so far, over layers and heads (device).
    """

    events: QuerySet | None = None
    next_slot: Tensor | None = None
    flagged: Tensor | None = field(default=None)


@dataclass
class EventBeaconKV(BeaconKV):
    """BeaconKV whose beacons also take in far-looking queries as they happen (see the module docstring).

    The other arguments are :class:`~beaconkv.policies.beacon.BeaconKV`'s.

    Args:
        n_events: Event beacons per query head (a ring of the latest far-looking queries).
        event_mass: Share of a query's attention on far generated tokens that makes it an event.
        event_window: The recent window excluded from "far", in tokens.

    Raises:
        PolicyConfigError: ``n_events < 1``, ``event_mass`` outside (0, 1], ``event_window < 0``.
    """

    n_events: int = 4
    event_mass: float = 0.5
    event_window: int = 64

    name: ClassVar[str] = "beacon_event"
    track_attention: ClassVar[bool] = True
    state_class: ClassVar[type[PolicyState]] = EventState

    def validate(self) -> None:
        super().validate()
        check_int("n_events", self.n_events, 1, hint="(default 4)")
        check_number("event_mass", self.event_mass, 0, 1, open_low=True, hint="(default 0.5)")
        check_int("event_window", self.event_window, 0, hint="(default 64)")

    def init_state(self, state: PolicyState) -> None:
        super().init_state(state)
        assert isinstance(state, EventState)
        first = state.observers[0]
        L = len(state.cache)
        state.events = QuerySet.empty(first.batch, first.n_heads, self.n_events, first.head_dim, first.dtype,
                                      state.device, layers=L)
        state.next_slot = torch.zeros(L, first.batch, first.n_heads, dtype=torch.long, device=state.device)
        state.flagged = torch.zeros(first.batch, dtype=torch.long, device=state.device)
        state.layers = [EventLayer(lay.beacons, lay.obs, lay.cache, ev, nxt)
                        for lay, ev, nxt in zip(state.layers, state.events.unbind(), state.next_slot.unbind(0))]

    def on_admit(self, state: PolicyState, rows: list[int]) -> None:
        super().on_admit(state, rows)
        rows_t = state.index(rows)
        state.events.clear(rows_t)
        state.next_slot[:, rows_t] = 0
        state.flagged[rows_t] = 0

    def observe_attention(self, state: PolicyState, layer_state: Any, weights: Tensor) -> None:
        """Takes this step's far-looking queries of one layer into its event ring (device ops only)."""
        cache: ObservedLayer = layer_state.cache
        t = state.positions  # the position this decode step writes (the state advances after the step)
        pos = cache.positions()  # (batch, kv, capacity)
        far = (pos >= state.prefix_dev[:, None, None]) & (pos >= 0) & (pos <= (t - self.event_window)[:, None, None])
        share = (weights * far.to(weights.dtype).unsqueeze(2)).sum(-1)  # (batch, kv, group)
        flag = rearrange(share >= self.event_mass, "b kv g -> b (kv g)") & state.active[:, None]  # (batch, heads)
        q, _ = cache.ring_at(None, t[:, None])  # (batch, heads, 1, head_dim) pre-RoPE, just written
        events: QuerySet = layer_state.events
        nxt = layer_state.next_slot  # (batch, heads)
        write = nxt.unsqueeze(-1)  # (batch, heads, 1)
        old_q = torch.gather(events.q, 2, write.unsqueeze(-1).expand_as(q))
        scatter_(events.q, 2, write.unsqueeze(-1).expand_as(q),
                 torch.where(flag[..., None, None], q.to(events.q.dtype), old_q))
        old_pos = torch.gather(events.pos, 2, write)
        scatter_(events.pos, 2, write, torch.where(flag[..., None], t[:, None, None].expand_as(old_pos), old_pos))
        old_valid = torch.gather(events.valid, 2, write)
        scatter_(events.valid, 2, write, old_valid | flag[..., None])
        nxt.copy_(torch.remainder(nxt + flag.long(), self.n_events))
        if layer_state.events is state.layers[0].events:  # count once per step, on layer 0
            state.flagged.add_(flag.long().sum(-1))

    def scoring_beacons(self, state: PolicyState, layer_state: Any, cache: ObservedLayer, rows: Tensor) -> QuerySet:
        """The regular beacons and the event beacons, all rotated to the current position at scoring."""
        return QuerySet.cat(super().scoring_beacons(state, layer_state, cache, rows), layer_state.events.rows(rows))

    def held_queries(self, state: PolicyState) -> list[float]:
        """BeaconKV's query memory plus the event ring."""
        return [n + (self.n_events if state.live[b] else 0) for b, n in enumerate(super().held_queries(state))]
