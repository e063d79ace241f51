"""Group-shared beacons: one beacon set per KV head, chosen over its whole GQA group's queries.

BeaconKV keeps a set of past queries per *query* head, but the heads of a GQA group read the same
keys: a far-looking query of any of them marks the same tokens as worth keeping. Sharing one set per
KV head, sampled by FPS over the queries of every head of the group, divides the query memory by the
group size and lets a rare global query of one head protect tokens for its whole group.

At scoring, each shared beacon is rotated to the current position and scored against its KV head's
keys (it stands for every head of the group); the recent queries stay per query head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from einops import rearrange, repeat
from torch import Tensor

from .observer import ObservedLayer
from .beacon import BeaconKV, BeaconLayer
from .query_set import QuerySet
from .state import PolicyState


@dataclass
class GroupBeaconKV(BeaconKV):
    """BeaconKV with one query set per KV head, sampled over its GQA group (see the module docstring).

    Same arguments as :class:`~beaconkv.policies.beacon.BeaconKV`; ``n_beacon`` is now per KV head.
    """

    name: ClassVar[str] = "beacon_group"

    def set_heads(self, cache: ObservedLayer) -> int:
        return cache.n_kv_heads

    def candidates(self, queries: QuerySet, cache: ObservedLayer) -> QuerySet:
        """``(..., heads, n, d)`` -> ``(..., kv_heads, group * n, d)``: a group's queries, pooled."""
        if queries.pos.shape[-2] == cache.n_kv_heads:  # already grouped (the sets themselves)
            return queries
        kv = cache.n_kv_heads
        return QuerySet(
            rearrange(queries.q, "... (kv g) n d -> ... kv (g n) d", kv=kv),
            rearrange(queries.pos, "... (kv g) n -> ... kv (g n)", kv=kv),
            rearrange(queries.valid, "... (kv g) n -> ... kv (g n)", kv=kv),
        )

    def scoring_beacons(self, state: PolicyState, layer_state: BeaconLayer, cache: ObservedLayer,
                        rows: Tensor) -> QuerySet:
        """Each KV head's shared set, seen by every query head of its group ``(b, heads, n, d)``."""
        shared = layer_state.beacons.rows(rows)
        g = cache.group
        return QuerySet(repeat(shared.q, "b kv n d -> b (kv g) n d", g=g),
                        repeat(shared.pos, "b kv n -> b (kv g) n", g=g),
                        repeat(shared.valid, "b kv n -> b (kv g) n", g=g))
