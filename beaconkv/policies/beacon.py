"""BeaconKV: score the cache with a few geometrically diverse past queries ("beacons").

Recent-query policies assume the last queries predict future attention. In long reasoning, sparse
*global* queries suddenly look far back; in pre-RoPE space they resemble each other and differ
from the local queries around them. BeaconKV therefore keeps a small, diverse set of past
pre-RoPE queries, chosen by farthest-point sampling, and asks at each eviction: "if such a query
arrived *now*, where would it look?" (SPEC §4):

1. Prefill: FPS of the prompt's pre-RoPE queries down to ``B_min^Q`` -> the observation set.
2. Accumulate: each decode query joins the observation set; when it holds ``B_max^Q`` vectors it is
   FPS-compressed back to ``B_min^Q`` (Continual FPS; bounded memory).
3. Freeze: when the evictable count reaches ``budget - n_recent``, ``n_beacon`` beacons are FPS'd
   from the observation set; the next ``n_recent`` queries are the recent set.
4. Score (count = budget): beacons rotated to the *current* position ``t``, recent queries to
   their *own* positions (causal), softmax over the cache, aggregated (max) over queries and the
   GQA group.
5. Select: prefix + last ``n_recent`` + top-k, in position order (the shared mechanism).
6. Roll: the observation set becomes FPS(beacons ∪ recent, ``B_min^Q``); back to 2.

Queries are stored per query head, pre-RoPE (after Qwen3's ``q_norm``), and re-rotated with the
model's own rotary module. Pending decode queries live in the cache's query ring until the host
folds them into the observation set, so the decode step itself stays a plain in-place write.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..cache import LayerKVCache
from .base import EvictionPolicy, PolicyConfigError
from .samplers import ContinualFPS, QuerySampler
from .scoring import attention_probs, reduce_group, reduce_queries, ring_queries

_AGGREGATIONS = ("max", "mean", "logsumexp")


@dataclass
class QuerySet:
    """A per-head set of stored pre-RoPE queries.

    Its tensors share leading axes: ``(batch, heads)`` for one layer's set, ``(layers, batch, heads)``
    for the sets of every layer stacked (what BeaconKV's maintenance samples from in one call).

    Attributes:
        q: ``(..., S, head_dim)`` vectors.
        pos: ``(..., S)`` their absolute positions (``-1`` empty).
        valid: ``(..., S)`` which entries exist.
    """

    q: Tensor
    pos: Tensor
    valid: Tensor

    @classmethod
    def empty(cls, batch: int, heads: int, size: int, head_dim: int, dtype: torch.dtype, device,
              layers: int | None = None) -> "QuerySet":
        """An all-empty set of ``size`` slots (with ``layers``: one per layer, stacked)."""
        lead = (batch, heads) if layers is None else (layers, batch, heads)
        return cls(
            torch.zeros(*lead, size, head_dim, dtype=dtype, device=device),
            torch.full((*lead, size), -1, dtype=torch.long, device=device),
            torch.zeros(*lead, size, dtype=torch.bool, device=device),
        )

    def rows(self, rows: Tensor) -> "QuerySet":
        """The sub-set of some sequences (the batch axis is the one before ``heads``)."""
        return QuerySet(self.q.index_select(-4, rows), self.pos.index_select(-3, rows),
                        self.valid.index_select(-3, rows))

    def assign(self, rows: Tensor, other: "QuerySet") -> None:
        """Overwrites some sequences in place with ``other`` (same slot count)."""
        self.q.index_copy_(self.q.dim() - 4, rows, other.q.to(self.q.dtype))
        self.pos.index_copy_(self.pos.dim() - 3, rows, other.pos)
        self.valid.index_copy_(self.valid.dim() - 3, rows, other.valid)

    def clear(self, rows: Tensor) -> None:
        """Empties some sequences in place."""
        self.q.index_fill_(self.q.dim() - 4, rows, 0)
        self.pos.index_fill_(self.pos.dim() - 3, rows, -1)
        self.valid.index_fill_(self.valid.dim() - 3, rows, False)

    @staticmethod
    def cat(*sets: "QuerySet") -> "QuerySet":
        """Concatenates along the slot axis."""
        return QuerySet(torch.cat([s.q for s in sets], dim=-2), torch.cat([s.pos for s in sets], dim=-1),
                        torch.cat([s.valid for s in sets], dim=-1))

    @staticmethod
    def stack(sets: list["QuerySet"]) -> "QuerySet":
        """Stacks equally shaped sets along a new leading axis (e.g. one set per layer)."""
        return QuerySet(*(torch.stack([getattr(s, f) for s in sets]) for f in ("q", "pos", "valid")))

    def unbind(self) -> list["QuerySet"]:
        """Splits the leading axis (the inverse of :meth:`stack`)."""
        return [QuerySet(q, p, v) for q, p, v in zip(self.q.unbind(0), self.pos.unbind(0), self.valid.unbind(0))]

    def select(self, sampler: QuerySampler, k: int) -> "QuerySet":
        """Keeps ``k`` entries per head chosen by ``sampler`` over the valid ones (any leading axes)."""
        idx, ok = sampler.select(self.q, k, self.valid)  # (..., k)
        q = torch.gather(self.q, -2, idx.unsqueeze(-1).expand(*idx.shape, self.q.shape[-1]))
        pos = torch.where(ok, torch.gather(self.pos, -1, idx), -1)
        return QuerySet(q, pos, ok & torch.gather(self.valid, -1, idx))


def ring_set(cache: LayerKVCache, rows: Tensor, lo: Tensor, hi: Tensor) -> QuerySet:
    """The cache ring's queries with positions in ``(lo, hi]`` as a :class:`QuerySet`."""
    q, qpos, mask = ring_queries(cache, rows, lo, hi)
    H = q.shape[1]
    return QuerySet(q, qpos[:, None].expand(-1, H, -1), mask[:, None].expand(-1, H, -1))


class BeaconKV(EvictionPolicy):
    """BeaconKV eviction (paper algorithm 2, SPEC §4).

    Args:
        budget: ``B_max``: evictable tokens kept per sequence and KV head.
        n_beacon: Beacons frozen per query head (``B_min^Q``).
        n_recent: Recent queries scored at their own positions; also the recent tokens always kept.
            The query buffer bound is ``B_max^Q = n_beacon + n_recent``.
        aggregation: ``"max"`` (paper), ``"mean"`` or ``"logsumexp"`` (smooth max, beyond the paper)
            over queries and the GQA group.
        temperature: Temperature of ``logsumexp``.
        sampler: Chooses beacons; :class:`~beaconkv.policies.samplers.ContinualFPS` (bounded buffer)
            by default. Unbounded samplers (``NaiveFPS``, ``KMeans``) see the whole query history.
        n_prefix: Protected leading tokens (None: the whole prompt).
        ratio: ``B_min = floor(ratio * budget)``.
        telemetry: Record kept positions and the beacon/recent positions of each eviction.

    Attributes:
        all_obs: Every layer's observation set (bounded samplers), stacked:
            ``(layers, batch, query heads, n_beacon, head_dim)``; ``obs[layer]`` is a view of one layer.
        all_beacons: Every layer's frozen beacons, stacked likewise; ``beacons[layer]`` is a view.

    Example:
        >>> policy = BeaconKV(budget=2048, n_beacon=16, n_recent=16, aggregation="max")
        >>> # out = beaconkv.generate(model, tok, prompts, policy=policy)

    The paper's ablations are one argument away: ``(n_beacon, n_recent)`` = (16, 16) default,
    (1, 31), (28, 4), (0, 32) ≈ RPC-like.
    """

    name = "beacon"
    #: Freeze the observation set after prefill (Initial+Recent).
    static_beacons = False

    def __init__(
        self,
        budget: int,
        n_beacon: int = 16,
        n_recent: int = 16,
        aggregation: str = "max",
        temperature: float = 0.1,
        sampler: QuerySampler | None = None,
        *,
        n_prefix: int | None = None,
        ratio: float = 7 / 8,
        telemetry: bool = False,
    ) -> None:
        if budget is None:
            raise PolicyConfigError("BeaconKV needs an int budget; use FullKV to keep everything.")
        if n_beacon < 0:
            raise PolicyConfigError(f"n_beacon={n_beacon} must be >= 0.")
        if aggregation not in _AGGREGATIONS:
            raise PolicyConfigError(f"aggregation={aggregation!r} is unknown; use one of {', '.join(_AGGREGATIONS)}.")
        if temperature <= 0:
            raise PolicyConfigError(f"temperature={temperature} must be > 0.")
        if n_beacon + n_recent < 1:
            raise PolicyConfigError("n_beacon + n_recent must be >= 1: nothing would observe the cache.")
        super().__init__(budget, n_prefix=n_prefix, n_recent=n_recent, ratio=ratio, telemetry=telemetry)
        self.n_beacon, self.aggregation, self.temperature = n_beacon, aggregation, temperature
        self.sampler = sampler if sampler is not None else ContinualFPS()

    @property
    def q_min(self) -> int:
        """``B_min^Q``: observation vectors kept after a compression (= ``n_beacon``)."""
        return self.n_beacon

    @property
    def q_max(self) -> int:
        """``B_max^Q = n_beacon + n_recent``: observation vectors that trigger a compression."""
        return self.n_beacon + self.n_recent

    @property
    def query_window(self) -> int:
        return max(self.q_max, self.n_recent, 1)

    # ------------------------------------------------------------ per layer
    def init_layer(self, layer: int, cache: LayerKVCache) -> None:
        if layer == 0:
            shapes = {(c.n_heads, c.head_dim, c.k.dtype) for c in self.cache.layers}
            if len(shapes) > 1:
                raise PolicyConfigError(
                    f"BeaconKV samples the queries of all layers at once and needs every layer to have the same "
                    f"(query heads, head_dim, dtype); this cache has {sorted(shapes, key=str)}."
                )
            # every layer's observation and beacon sets, stacked: the maintenance samples them in one call
            args = (cache.batch, cache.n_heads)
            tail = (cache.head_dim, cache.k.dtype, cache.k.device)
            self.all_obs = QuerySet.empty(*args, self.q_min, *tail, layers=len(self.cache))
            self.all_beacons = QuerySet.empty(*args, self.n_beacon, *tail, layers=len(self.cache))
            self.obs: list[QuerySet] = self.all_obs.unbind()  # per-layer views
            self.beacons: list[QuerySet] = self.all_beacons.unbind()
            self.history: list[list[QuerySet | None]] = []
            B = cache.batch
            self.phase = ["accumulate"] * B
            self.obs_since = [0] * B
            self.obs_count = [0] * B
            self.recent_since = [0] * B
        self.history.append([None] * cache.batch)

    def observe_prefill(self, layer: int, q_pre: Tensor, positions: Tensor, valid: Tensor) -> None:
        B, H, L, _ = q_pre.shape
        prompt = QuerySet(q_pre, positions[:, None].expand(B, H, L), valid[:, None].expand(B, H, L))
        rows = torch.arange(B, device=q_pre.device)
        if self.sampler.bounded:
            self.obs[layer].assign(rows, prompt.select(self.sampler, self.q_min))
        else:
            for b in range(B):
                n = int(valid[b].sum())
                self.history[layer][b] = QuerySet(q_pre[b : b + 1, :, :n], prompt.pos[b : b + 1, :, :n],
                                                  prompt.valid[b : b + 1, :, :n])

    # ------------------------------------------------------------ schedule
    def on_prefill_done(self) -> None:
        B = len(self.count)
        self.obs_count = [min(L, self.q_min) for L in self.prompt_lengths] if self.sampler.bounded else [0] * B
        self.obs_since = list(self.t)
        self.phase = ["accumulate"] * B
        if self.static_beacons:
            self._freeze(list(range(B)))
            self.phase = ["static"] * B
        else:
            # a prompt may already be past the freeze point (int n_prefix): freeze before any eviction
            self.after_count_change(list(range(B)))

    def on_decode(self, rows: list[int]) -> None:
        due = [b for b in rows if self.phase[b] == "accumulate"
               and self.obs_count[b] + (self.t[b] - self.obs_since[b]) >= self.q_max]
        if due:
            self._compress(due)

    def after_count_change(self, rows: list[int]) -> None:
        due = [b for b in rows if self.phase[b] == "accumulate" and self.count[b] >= self.budget - self.n_recent]
        if due:
            self._freeze(due)

    def evict(self, rows: list[int]) -> None:
        unfrozen = [b for b in rows if self.phase[b] == "accumulate"]  # only when n_recent == 0
        if unfrozen:
            self._freeze(unfrozen)
        super().evict(rows)

    def after_evict(self, rows: list[int]) -> None:
        if self.static_beacons:
            return
        self._roll(rows)

    # ------------------------------------------------------------ set algebra
    def _host(self, values: list[int] | list[list[int]]) -> Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.cache[0].pos.device)

    def _pending(self, layer: int, rows_t: Tensor, rows: list[int]) -> QuerySet:
        return ring_set(self.cache[layer], rows_t, self._host([self.obs_since[b] for b in rows]),
                        self._host([self.t[b] for b in rows]))

    def _history(self, layer: int, rows: list[int]) -> QuerySet:
        """Pads the per-sequence histories of some rows to one set."""
        hs = [self.history[layer][b] for b in rows]
        n = max(h.q.shape[2] for h in hs)
        padded = []
        for h in hs:
            pad = n - h.q.shape[2]
            padded.append(QuerySet(
                torch.nn.functional.pad(h.q, (0, 0, 0, pad)),
                torch.nn.functional.pad(h.pos, (0, pad), value=-1),
                torch.nn.functional.pad(h.valid, (0, pad), value=False),
            ))
        return QuerySet(*(torch.cat([getattr(p, f) for p in padded]) for f in ("q", "pos", "valid")))

    def _append_history(self, layer: int, rows: list[int], extra: QuerySet) -> None:
        for i, b in enumerate(rows):
            keep = extra.valid[i, 0]
            add = QuerySet(extra.q[i : i + 1, :, keep], extra.pos[i : i + 1, :, keep], extra.valid[i : i + 1, :, keep])
            self.history[layer][b] = QuerySet.cat(self.history[layer][b], add)

    def select_queries(self, queries: QuerySet, k: int) -> QuerySet:
        """Samples ``k`` queries per head with the policy's sampler: the one call behind steps 2, 3 and 6.

        Args:
            queries: Candidate sets, every layer's stacked: ``(layers, b, heads, S, head_dim)``.
            k: Queries kept per head.

        Returns:
            The chosen sets, same leading axes, ``k`` slots. Compiled decoding routes this method
            through one compiled graph for all layers.
        """
        return queries.select(self.sampler, k)

    def _resample(self, sources: QuerySet, rows: list[int], since: list[int], k: int) -> QuerySet:
        """``k`` queries per layer and head sampled from ``sources`` (every layer's sets of ``rows``,
        stacked) together with the cache ring's queries at positions in ``(since, t]``, in one call."""
        return self._sample(QuerySet.cat(sources, self._ring_since(rows, since)), k)

    def _sample(self, candidates: QuerySet, k: int) -> QuerySet:
        """``k`` of the candidates (stacked over layers): all of them, padded, when they fit."""
        S = candidates.q.shape[-2]
        if S > k:
            return self.select_queries(candidates, k)
        lead = candidates.q.shape[:-2]
        pad = QuerySet(candidates.q.new_zeros(*lead, k - S, candidates.q.shape[-1]),
                       candidates.pos.new_full((*lead, k - S), -1), candidates.valid.new_zeros(*lead, k - S))
        return QuerySet.cat(candidates, pad)

    def _ring_since(self, rows: list[int], since: list[int]) -> QuerySet:
        """Every layer's ring queries of ``rows`` at positions in ``(since, t]``, stacked:
        ``(layers, b, heads, n, head_dim)`` with ``n`` the largest such count over the rows (masked
        for rows with fewer). Only the slots that can hold them are read (``n`` is known on the host)."""
        rows_t = self._host(rows)
        R = self.cache[0].query_window
        n = min(max(self.t[b] - since[b] for b in rows), R)
        n = max(n, 0)
        pos = self._host([[self.t[b] - n + 1 + j for j in range(n)] for b in rows]).reshape(len(rows), n)
        slots = pos.remainder(R)
        # positions the ring still holds (every layer writes the same positions: layer 0 tells)
        held = torch.gather(self.cache[0].query_pos[rows_t], 1, slots) == pos
        valid = held & (pos > self._host([since[b] for b in rows])[:, None])
        pos = torch.where(valid, pos, -1)
        full = rows == list(range(self.cache[0].batch))
        H, D = self.cache[0].n_heads, self.cache[0].head_dim
        idx = slots[:, None, :, None].expand(-1, H, -1, D)
        q = torch.stack([torch.gather(c.queries if full else c.queries[rows_t], 2, idx) for c in self.cache.layers])
        shape = (len(self.cache), len(rows), H, n)
        return QuerySet(q, pos[None, :, None].expand(shape), valid[None, :, None].expand(shape))

    def _compress(self, rows: list[int]) -> None:
        """Step 2: fold pending queries into the observation set (FPS back to ``B_min^Q``)."""
        rows_t = self._host(rows)
        if self.sampler.bounded:
            self.all_obs.assign(rows_t, self._resample(self.all_obs.rows(rows_t), rows, self.obs_since, self.q_min))
        else:
            for layer in range(len(self.cache)):
                self._append_history(layer, rows, self._pending(layer, rows_t, rows))
        for b in rows:
            total = self.obs_count[b] + self.t[b] - self.obs_since[b]
            self.obs_count[b] = min(total, self.q_min) if self.sampler.bounded else 0
            self.obs_since[b] = self.t[b]

    def _freeze(self, rows: list[int]) -> None:
        """Step 3: beacons <- sample(observation set, n_beacon); later queries are recent."""
        rows_t = self._host(rows)
        if self.sampler.bounded:
            sources = self.all_obs.rows(rows_t)
        else:  # the whole history, padded (the same length in every layer)
            sources = QuerySet.stack([self._history(layer, rows) for layer in range(len(self.cache))])
        self.all_beacons.assign(rows_t, self._resample(sources, rows, self.obs_since, self.n_beacon))
        for b in rows:
            # past the freeze point already (prefill): the newest prompt queries count as recent
            overshoot = self.count[b] - (self.budget - self.n_recent)
            self.recent_since[b] = self.t[b] - min(max(overshoot, 0), self.n_recent)
            if self.phase[b] != "static":
                self.phase[b] = "frozen"

    def _roll(self, rows: list[int]) -> None:
        """Step 6: observation set <- FPS(beacons ∪ recent, ``B_min^Q``); beacon and recent sets cleared."""
        rows_t = self._host(rows)
        if self.sampler.bounded:
            self.all_obs.assign(rows_t, self._resample(self.all_beacons.rows(rows_t), rows, self.recent_since,
                                                       self.q_min))
        else:
            hi = self._host([self.t[b] for b in rows])
            lo = self._host([self.recent_since[b] for b in rows])
            for layer in range(len(self.cache)):
                self._append_history(layer, rows, ring_set(self.cache[layer], rows_t, lo, hi))
        self.all_beacons.clear(rows_t)
        for b in rows:
            n_recent = self.t[b] - self.recent_since[b]
            self.obs_count[b] = min(self.n_beacon + n_recent, self.q_min) if self.sampler.bounded else 0
            self.obs_since[b] = self.t[b]
            self.phase[b] = "accumulate"

    # ------------------------------------------------------------ scoring
    def recent_bound(self, rows: Tensor, t: Tensor) -> Tensor:
        """``(b,)`` exclusive lower position bound of the recent queries (read from host state)."""
        if self.static_beacons:
            return t - self.n_recent
        return torch.tensor([self.recent_since[b] for b in rows.tolist()], device=t.device)

    def observation_queries(
        self, layer: int, rows: Tensor, t: Tensor, recent_lo: Tensor | None = None, beacons: QuerySet | None = None,
        cache: LayerKVCache | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The rotated queries BeaconKV scores with at an eviction.

        Args:
            layer: Layer index.
            rows: ``(b,)`` batch indices.
            t: ``(b,)`` position of the newest token.
            recent_lo: ``(b,)`` exclusive lower bound of the recent queries' positions; None reads it
                from the host state (pass it inside compiled code). Initial+Recent ignores it: its
                recent queries are always the last ``n_recent``.
            beacons: The layer's beacons for all rows; None uses the policy's.
            cache: The layer's cache; None looks it up by ``layer`` (a compiled per-layer step passes it,
                so that the layer index is not baked into the graph).

        Returns:
            ``(q_rot (b, heads, n, head_dim), q_mask (b, n), q_pos (b, n), source_pos (b, n))``: beacons
            rotated to ``t`` first, then recent queries at their own positions; ``source_pos`` is the
            position each query was originally produced at.
        """
        if recent_lo is None or self.static_beacons:
            recent_lo = self.recent_bound(rows, t)
        beacons = (self.beacons[layer] if beacons is None else beacons).rows(rows)
        recent = ring_set(self.cache[layer] if cache is None else cache, rows, recent_lo, t)
        nb = beacons.q.shape[2]
        b_pos = t[:, None].expand(-1, nb)  # beacons look from the current step
        q_rot = torch.cat([self.rope.rotate(beacons.q, b_pos), self.rope.rotate(recent.q, recent.pos[:, 0])], dim=2)
        q_mask = torch.cat([beacons.valid[:, 0], recent.valid[:, 0]], dim=1)
        q_pos = torch.cat([b_pos, recent.pos[:, 0]], dim=1)
        source = torch.cat([beacons.pos[:, 0], recent.pos[:, 0]], dim=1)
        return q_rot, q_mask, q_pos, source

    def score(
        self, layer: int, cache: LayerKVCache, rows: Tensor, t: Tensor,
        recent_lo: Tensor | None = None, beacons: QuerySet | None = None,
    ) -> Tensor:
        """Step 4: attention of beacons (at ``t``) and recent queries (at their positions) over the cache,
        aggregated over queries and the GQA group. ``recent_lo``/``beacons``: see :meth:`observation_queries`."""
        q_rot, q_mask, q_pos, _ = self.observation_queries(layer, rows, t, recent_lo, beacons, cache)
        pos = cache.pos[rows]
        w = attention_probs(q_rot, q_mask, cache.k[rows], pos >= 0, cache.head_dim**-0.5, q_pos, pos)
        per_head = reduce_queries(w, q_mask, self.aggregation, self.temperature)  # (b, kv_heads, group, C)
        return reduce_group(per_head, self.aggregation, self.temperature)

    def observed_positions(self, layer: int, rows: Tensor, t: Tensor) -> Tensor:
        _, q_mask, _, source = self.observation_queries(layer, rows, t)
        return torch.where(q_mask, source, -1).cpu()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(budget={self.budget}, n_beacon={self.n_beacon}, n_recent={self.n_recent}, "
            f"aggregation={self.aggregation!r}, sampler={self.sampler!r}, n_prefix={self.n_prefix})"
        )


class InitialRecent(BeaconKV):
    """Initial+Recent (paper Table 3): BeaconKV whose beacons are FPS'd from the prompt once and never
    updated, scored together with the last ``n_recent`` queries.

    Same arguments as :class:`BeaconKV`.
    """

    name = "initial_recent"
    static_beacons = True
