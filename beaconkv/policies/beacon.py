"""BeaconKV: score the cache with a few geometrically diverse past queries ("beacons").

Recent-query policies assume the last queries predict future attention. In long reasoning, sparse
*global* queries suddenly look far back; in pre-RoPE space they resemble each other and differ
from the local queries around them. BeaconKV therefore keeps a small, diverse set of past
pre-RoPE queries, chosen by farthest-point sampling, and asks at each eviction: "if such a query
arrived *now*, where would it look?" (SPEC §4):

1. Prefill: FPS of the prompt's pre-RoPE queries down to ``B_min^Q`` -> the observation set.
2. Accumulate: each decode query joins the observation set; when it holds ``B_max^Q`` vectors it is
   FPS-compressed back to ``B_min^Q`` (Continual FPS; bounded memory).
3. Freeze: ``n_recent`` tokens before the next eviction (the evictable count reaches ``budget - n_recent``
   under the default schedule), ``n_beacon`` beacons are FPS'd from the observation set; the next
   ``n_recent`` queries are the recent set.
4. Score (count = budget): beacons rotated to the *current* position ``t``, recent queries to
   their *own* positions (causal), softmax over the cache, aggregated (max) over queries and the
   GQA group.
5. Select: prefix + last ``n_recent`` + top-k, in position order (the shared mechanism).
6. Roll: the observation set becomes FPS(beacons ∪ recent, ``B_min^Q``); back to 2.

Where the queries the beacons are drawn from live is a :class:`~beaconkv.policies.lifecycles.QueryLifecycle`,
chosen by the ``query_memory`` setting: a bounded observation set (Continual FPS, steps 1, 2 and 6) or the whole
query history (Naive FPS, K-Means). Queries are stored per query head, pre-RoPE (after Qwen3's
``q_norm``), and re-rotated with the model's own rotary module. Pending decode queries live in each
layer's query ring (the policy's observer of the layer) until the host folds them in, so the decode step itself stays a plain in-place write.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from .observer import ObservedLayer
from .base import EvictionPolicy
from .config import PolicyConfigError, check_choice, check_int, check_number
from .lifecycles import BoundedObservation, Phase, QueryHistory, QueryLifecycle, ring_set
from .query_set import QuerySet
from .query_selection import FPS, QuerySelector, parse_selector
from .scoring import attention_probs, pool_slots, reduce_group, reduce_queries
from .state import PolicyState

AGGREGATIONS = ("max", "mean", "logsumexp")
NORMALIZATIONS = ("cache", "evictable")


@dataclass(eq=False)
class BeaconLayer:
    """One layer's views into BeaconKV's stacked query sets (``state.layers[i]``).

    Attributes:
        beacons: ``(batch, heads, n_beacon, head_dim)`` frozen beacons.
        obs: ``(batch, heads, B_min^Q, head_dim)`` observation set (bounded lifecycle; None otherwise).
        cache: The layer (its cache and the policy's observations of it).
    """

    beacons: QuerySet
    obs: QuerySet | None = None
    cache: ObservedLayer | None = None


@dataclass(eq=False)
class BeaconState(PolicyState):
    """BeaconKV's state: the shared schedule plus the query sets and the beacon schedule of every row.

    Attributes:
        beacons: Every layer's beacons, stacked ``(layers, batch, heads, n_beacon, head_dim)``.
        obs: Every layer's observation set, stacked (bounded lifecycle; None otherwise).
        phase: Host, per row: where it is in its cycle (:class:`~beaconkv.policies.lifecycles.Phase`).
        obs_since: Host, per row: newest position already folded into the observation set.
        obs_count: Host, per row: vectors in the observation set.
        recent_since: Host, per row: exclusive lower position bound of the recent queries.
        obs_since_dev: Device mirror of ``obs_since``.
        recent_since_dev: Device mirror of ``recent_since``.
    """

    beacons: QuerySet | None = None
    obs: QuerySet | None = None
    phase: list[Phase] = field(default_factory=list)
    obs_since: list[int] = field(default_factory=list)
    obs_count: list[int] = field(default_factory=list)
    recent_since: list[int] = field(default_factory=list)
    obs_since_dev: Tensor | None = None
    recent_since_dev: Tensor | None = None


def _select_queries(policy: BeaconKV, q: Tensor, pos: Tensor, valid: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """Device function: :meth:`BeaconKV.select_queries` over tensors (what the executor runs)."""
    chosen = policy.select_queries(QuerySet(q, pos, valid), k)
    return chosen.q, chosen.pos, chosen.valid


@dataclass
class BeaconKV(EvictionPolicy):
    """BeaconKV eviction (paper algorithm 2, SPEC §4).

    Args:
        budget: ``B_max``: evictable tokens kept per sequence and KV head.
        n_beacon: Beacons frozen per query head (``B_min^Q``).
        aggregation: ``"max"`` (paper), ``"mean"`` or ``"logsumexp"`` (smooth max, beyond the paper)
            over queries and the GQA group.
        temperature: Temperature of ``logsumexp``.
        sampler: Selects the beacons (and compresses the observation set):
            :class:`~beaconkv.policies.query_selection.FPS` by default, ``KMeans``, a selector of one's own,
            or a spec string (``"kmeans:n_iter=2"``, :func:`~beaconkv.policies.query_selection.parse_selector`).
        query_memory: Where the candidates come from: ``"bounded"`` (the paper's Continual FPS: an
            observation set of at most ``B_max^Q`` queries per head, compressed as it fills) or
            ``"history"`` (every query of the sequence, selected from at each freeze: Naive FPS, and
            K-Means as the paper runs it; unbounded memory, for analysis).
        normalize: What each scoring query's softmax runs over: ``"cache"`` (every cached key, the
            paper's) or ``"evictable"`` (beyond the paper: the keys that may be evicted, as RPC does —
            the protected prefix, kept whatever happens, no longer absorbs the attention mass).
        kernel: Pooling of the scores along the cache (odd; 1 = none, the paper's). Beyond the paper: a
            fact a query looks up is a span of tokens (a number is one token per digit in many
            tokenizers), and a query attends to its start more than to the rest, which copying needs as
            much; pooling keeps neighbours of a high-scoring token together, as SnapKV's clustering does
            (see docs/benchmarks.md, the accuracy suite).
        pool: ``"max"`` or ``"avg"`` pooling (with ``kernel > 1``).
        n_recent: Keyword-only. Recent queries scored at their own positions; also the recent tokens
            always kept. The query buffer bound is ``B_max^Q = n_beacon + n_recent``.

    The paper's ablations are one argument away: ``(n_beacon, n_recent)`` = (16, 16) default,
    (1, 31), (28, 4), (0, 32) ≈ RPC-like.

    A prompt prefilled in chunks (``prefill_chunk``): each chunk's queries are folded into the
    observation set (the FPS of every chunk so far, :meth:`observe_chunk`), and an eviction after a chunk
    scores with beacons drawn from that set, rotated to the chunk's last position, plus the chunk's newest
    queries as the recent set (SPEC §5, "Prefill in chunks").

    Example:
        ```python
        policy = BeaconKV(budget=2048, n_beacon=16, n_recent=16, aggregation="max")
        out = beaconkv.generate(model, tok, prompts, policy=policy)
        ```

    Raises:
        PolicyConfigError: A bad budget (see the base class), ``n_beacon < 0``, an unknown aggregation,
            ``temperature <= 0``, ``n_beacon + n_recent < 1``, or a sampler without ``select``.
    """

    n_beacon: int = 16
    aggregation: str = "max"
    temperature: float = 0.1
    sampler: QuerySelector | str | None = None
    query_memory: str = "bounded"
    normalize: str = "cache"
    kernel: int = 1
    pool: str = "max"

    name: ClassVar[str] = "beacon"
    state_class: ClassVar[type[PolicyState]] = BeaconState
    #: Freeze the observation set after prefill (Initial+Recent).
    static_beacons: ClassVar[bool] = False

    def validate(self) -> None:
        super().validate()
        check_int("n_beacon", self.n_beacon, 0, hint="(default 16)")
        check_choice("aggregation", self.aggregation, AGGREGATIONS)
        check_choice("normalize", self.normalize, NORMALIZATIONS)
        check_number("temperature", self.temperature, 0, open_low=True, hint="(default 0.1)")
        check_int("kernel", self.kernel, 1, hint="(odd; 1 = no pooling, the default)")
        if self.kernel % 2 == 0:
            raise PolicyConfigError(f"kernel={self.kernel} must be odd (the window is centred on each slot).")
        check_choice("pool", self.pool, ("max", "avg"))
        if self.n_beacon + self.n_recent < 1:
            raise PolicyConfigError("n_beacon + n_recent must be >= 1: nothing would observe the cache.")
        if self.sampler is None:
            self.sampler = FPS()
        elif isinstance(self.sampler, str):
            self.sampler = parse_selector(self.sampler)
        if not callable(getattr(self.sampler, "select", None)):
            raise PolicyConfigError(f"sampler={self.sampler!r} has no select(points, k, valid); pass a QuerySelector.")
        check_choice("query_memory", self.query_memory, ("bounded", "history"))

    @property
    def q_min(self) -> int:
        """``B_min^Q``: observation vectors kept after a compression (= ``n_beacon``)."""
        return self.n_beacon

    @property
    def q_max(self) -> int:
        """``B_max^Q = n_beacon + n_recent``: observation vectors that trigger a compression."""
        return self.n_beacon + self.n_recent

    @property
    def lifecycle(self) -> QueryLifecycle:
        """Where the beacons' candidates live: bounded (Continual FPS) or the whole history."""
        return BoundedObservation() if self.query_memory == "bounded" else QueryHistory()

    def query_window(self, max_tokens: int) -> int:
        return self.lifecycle.query_window(self, max_tokens)

    # ------------------------------------------------------------------------------- state
    def init_state(self, state: PolicyState) -> None:
        assert isinstance(state, BeaconState)
        cache, layers = state.cache, state.observers
        shapes = {(c.n_heads, c.head_dim, c.dtype) for c in layers}
        if len(shapes) > 1:
            raise PolicyConfigError(
                f"BeaconKV samples the queries of all layers at once and needs every layer to have the same "
                f"(query heads, head_dim, dtype); this cache has {sorted(shapes, key=str)}."
            )
        first = layers[0]
        state.beacons = QuerySet.empty(first.batch, self.set_heads(first), self.n_beacon, first.head_dim, first.dtype,
                                       cache.device, layers=len(cache))
        B = state.batch
        state.phase = [Phase.ACCUMULATE] * B
        state.obs_since, state.obs_count, state.recent_since = [0] * B, [0] * B, [0] * B
        state.obs_since_dev = torch.zeros(B, dtype=torch.long, device=cache.device)
        state.recent_since_dev = torch.zeros(B, dtype=torch.long, device=cache.device)
        self.lifecycle.init(self, state)
        obs = state.obs.unbind() if state.obs is not None else [None] * len(cache)
        state.layers = [BeaconLayer(b, o, c) for b, o, c in zip(state.beacons.unbind(), obs, layers)]

    def on_admit(self, state: PolicyState, rows: list[int]) -> None:
        rows_t = state.index(rows)
        state.beacons.clear(rows_t)
        if state.obs is not None:
            state.obs.clear(rows_t)
        for b in rows:
            state.phase[b], state.obs_count[b] = Phase.ACCUMULATE, 0
            state.obs_since[b] = state.recent_since[b] = state.t[b]
        state.obs_since_dev[rows_t] = state.t_dev[rows_t]
        state.recent_since_dev[rows_t] = state.t_dev[rows_t]

    def observe_prefill(self, state: PolicyState, layer_state: Any, q_pre: Tensor, positions: Tensor, valid: Tensor,
                        rows: Tensor) -> None:
        self.lifecycle.observe_prefill(self, layer_state, q_pre, positions, valid, rows)

    def observe_chunk(self, state: PolicyState, layer_state: Any, q_pre: Tensor, positions: Tensor, valid: Tensor,
                      rows: Tensor) -> None:
        """A chunk of a prompt prefilled in chunks (or a question on a compressed context): its queries
        are folded into the observation set, which becomes the FPS of every chunk seen so far (SPEC §4
        step 1 over chunks; the query history keeps them in the ring)."""
        self.lifecycle.observe_chunk(self, layer_state, q_pre, positions, valid, rows)

    def held_queries(self, state: PolicyState) -> list[float]:
        """Query vectors held per query head for each row (the paper's Fig. 7 memory): at most
        ``B_max^Q`` with ``query_memory="bounded"``, the whole history (``t + 1``) otherwise. A set shared by a
        GQA group counts ``1 / group`` per query head."""
        share = state.observers[0].n_heads // self.set_heads(state.observers[0])
        out = []
        for b in range(state.batch):
            stored, pending = self.lifecycle.held(self, state, b) if state.live[b] else (0, 0)
            out.append(stored / share + pending)
        return out

    # ------------------------------------------------------------------------------- schedule
    def on_prefill(self, state: PolicyState, rows: list[int]) -> None:
        if not self._accumulate_from_now(state, rows, [self.lifecycle.prefill_count(self, state.t[b] + 1)
                                                       for b in rows]):
            # a prompt may already be past the freeze point (int n_prefix): freeze before any eviction
            self.on_count_change(state, rows)

    def on_chunk(self, state: PolicyState, rows: list[int], n_new: list[int]) -> None:
        """After a chunk: its queries are in the observation set (:meth:`observe_chunk`), nothing is pending.
        A row frozen before the chunk folds its beacons back in and accumulates again, so the freeze that
        follows (if the count is past the freeze point) samples beacons from every chunk, and its recent
        queries are the chunk's newest. Static beacons (Initial+Recent) are sampled again from every chunk
        seen so far: the prompt is not whole until its last chunk."""
        frozen = [b for b in rows if state.phase[b] is Phase.FROZEN]
        if frozen:
            self.lifecycle.unfreeze(self, state, frozen, state.index(frozen))
            state.beacons.clear(state.index(frozen))
        self._accumulate_from_now(state, rows, [self.lifecycle.chunk_count(self, state.obs_count[b], n)
                                                for b, n in zip(rows, n_new)])

    def _accumulate_from_now(self, state: PolicyState, rows: list[int], counts: list[int]) -> bool:
        """Rows whose observation set now holds ``counts`` queries, none pending, accumulate again; static
        beacons (Initial+Recent) are sampled again from it instead. Returns whether they were (static)."""
        for b, count in zip(rows, counts):
            state.obs_count[b], state.obs_since[b], state.phase[b] = count, state.t[b], Phase.ACCUMULATE
        rows_t = state.index(rows)
        state.obs_since_dev[rows_t] = state.t_dev[rows_t]
        if not self.static_beacons:
            return False
        self.freeze(state, rows)
        for b in rows:
            state.phase[b] = Phase.STATIC
        return True

    def on_decode_step(self, state: PolicyState, rows: list[int]) -> None:
        due = self.lifecycle.compress_due(self, state, rows)
        if due:
            self.lifecycle.compress(self, state, due)

    def on_count_change(self, state: PolicyState, rows: list[int]) -> None:
        due = [b for b in rows if state.phase[b] is Phase.ACCUMULATE and state.count[b] >= self.freeze_point(state, b)]
        if due:
            self.freeze(state, due)

    def before_evict(self, state: PolicyState, rows: list[int]) -> None:
        unfrozen = [b for b in rows if state.phase[b] is Phase.ACCUMULATE]  # only when n_recent == 0
        if unfrozen:
            self.freeze(state, unfrozen)

    def on_evict(self, state: PolicyState, rows: list[int]) -> None:
        if self.static_beacons:
            return
        self.roll(state, rows)

    # ------------------------------------------------------------------------------- steps 3 and 6
    def freeze(self, state: PolicyState, rows: list[int]) -> None:
        """Step 3: beacons <- sample(candidates, ``n_beacon``); the queries after this point are recent."""
        rows_t = state.index(rows)
        state.beacons.assign(rows_t, self.sample(state, self.lifecycle.freeze_candidates(self, state, rows, rows_t),
                                                 self.n_beacon))
        lag = []
        for b in rows:
            # past the freeze point already (prefill): the newest prompt queries count as recent
            overshoot = state.count[b] - self.freeze_point(state, b)
            lag.append(min(max(overshoot, 0), self.n_recent))
            state.recent_since[b] = state.t[b] - lag[-1]
            if state.phase[b] is not Phase.STATIC:
                state.phase[b] = Phase.FROZEN
        state.recent_since_dev[rows_t] = state.t_dev[rows_t] - state.to_device(lag)

    def freeze_point(self, state: PolicyState, b: int) -> int:
        """Step 3's trigger: the evictable count ``n_recent`` tokens before row ``b``'s next eviction (its
        schedule's :meth:`~beaconkv.policies.EvictionPolicy.evict_point`; ``budget - n_recent`` by default)."""
        return self.evict_point(state, b) - self.n_recent

    def roll(self, state: PolicyState, rows: list[int]) -> None:
        """Step 6: the lifecycle folds beacons and recent queries back in; beacon and recent sets cleared."""
        rows_t = state.index(rows)
        self.lifecycle.roll(self, state, rows, rows_t)
        state.beacons.clear(rows_t)
        for b in rows:
            state.obs_since[b] = state.t[b]
            state.phase[b] = Phase.ACCUMULATE
        state.obs_since_dev[rows_t] = state.t_dev[rows_t]

    # ------------------------------------------------------------------------------- variants' hooks
    def set_heads(self, cache: ObservedLayer) -> int:
        """Heads of the stored query sets: one set per query head (a variant may share one per KV head)."""
        return cache.n_heads

    def candidates(self, queries: QuerySet, cache: ObservedLayer) -> QuerySet:
        """Queries as the sets sample them, from per-query-head queries ``(..., heads, n, head_dim)``.

        Identity here; a variant that shares one set per KV head regroups them.
        """
        return queries

    def scoring_beacons(self, state: PolicyState, layer_state: BeaconLayer, cache: ObservedLayer,
                        rows: Tensor) -> QuerySet:
        """The stored queries scored at ``t`` for some rows, one set per query head ``(b, heads, n, head_dim)``."""
        return layer_state.beacons.rows(rows)

    # ------------------------------------------------------------------------------- sampling
    def select_queries(self, queries: QuerySet, k: int) -> QuerySet:
        """Samples ``k`` queries per head with the policy's sampler: the one call behind steps 1, 2, 3 and 6.

        A device function (the executor compiles it, with a subclass's override).

        Args:
            queries: Candidate sets, every layer's stacked: ``(layers, b, heads, S, head_dim)``.
            k: Queries kept per head.

        Returns:
            The chosen sets, same leading axes, ``k`` slots.
        """
        return queries.select(self.sampler, k)

    def sample(self, state: PolicyState, candidates: QuerySet, k: int) -> QuerySet:
        """``k`` of the candidates (stacked over layers) through the executor; all of them, padded, when they fit."""
        if candidates.size <= k:
            return candidates.pad_to(k)
        return QuerySet(*state.executor.run(_select_queries, self, candidates.q, candidates.pos, candidates.valid, k))

    # ------------------------------------------------------------------------------- scoring
    def observation_queries(
        self, state: PolicyState, layer_state: BeaconLayer, cache: ObservedLayer, rows: Tensor, t: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The rotated queries BeaconKV scores with at an eviction.

        Args:
            state: The state.
            layer_state: This layer's :class:`BeaconLayer`.
            cache: The layer's cache.
            rows: ``(b,)`` row indices.
            t: ``(b,)`` position of the newest token.

        Returns:
            ``(q_rot (b, heads, n, head_dim), q_mask (b, n), q_pos (b, n), source_pos (b, n))``: beacons
            rotated to ``t`` first, then recent queries at their own positions; ``source_pos`` is the
            position each query was originally produced at.
        """
        recent_lo = t - self.n_recent if self.static_beacons else state.recent_since_dev[rows]
        beacons = self.scoring_beacons(state, layer_state, cache, rows)
        recent = ring_set(cache, rows, recent_lo, t)
        b_pos = t[:, None].expand(-1, beacons.size)  # beacons look from the current step
        rope = state.rope
        q_rot = torch.cat([rope.rotate(beacons.q, b_pos), rope.rotate(recent.q, recent.pos[:, 0])], dim=2)
        q_mask = torch.cat([beacons.valid[:, 0], recent.valid[:, 0]], dim=1)
        q_pos = torch.cat([b_pos, recent.pos[:, 0]], dim=1)
        source = torch.cat([beacons.pos[:, 0], recent.pos[:, 0]], dim=1)
        return q_rot, q_mask, q_pos, source

    def score(self, layer: ObservedLayer, rows: Tensor, t: Tensor) -> Tensor:
        """Step 4: attention of beacons (at ``t``) and recent queries (at their positions) over the cache,
        aggregated over queries and the GQA group."""
        state = layer.state
        layer_state = layer.layer_state
        q_rot, q_mask, q_pos, _ = self.observation_queries(state, layer_state, layer, rows, t)
        pos = layer.positions(rows)
        keys = pos >= 0
        if self.normalize == "evictable":  # the softmax over what may go: the protected prefix is kept anyway
            keys = keys & (pos >= state.prefix_dev[rows][:, None, None])
        w = attention_probs(q_rot, q_mask, layer.keys(rows), keys, layer.head_dim**-0.5, q_pos, pos)
        per_head = reduce_queries(w, q_mask, self.aggregation, self.temperature)  # (b, kv_heads, group, C)
        return pool_slots(reduce_group(per_head, self.aggregation, self.temperature), self.kernel, self.pool)

    def observed_positions(self, layer: ObservedLayer, rows: Tensor, t: Tensor) -> Tensor:
        state = layer.state
        layer_state = layer.layer_state
        _, q_mask, _, source = self.observation_queries(state, layer_state, layer, rows, t)
        return torch.where(q_mask, source, -1).cpu()


@dataclass
class InitialRecent(BeaconKV):
    """Initial+Recent (paper Table 3): BeaconKV whose beacons are FPS'd from the prompt once and never
    updated, scored together with the last ``n_recent`` queries.

    Same arguments as :class:`BeaconKV`.
    """

    name: ClassVar[str] = "initial_recent"
    static_beacons: ClassVar[bool] = True
