"""TriAttention: score each key by the attention the *centre* of its head's pre-RoPE queries would give it at
the positions still to come, plus a key-norm term where the queries are spread.

Pre-RoPE queries of a head cluster around a fixed, non-zero centre. Per RoPE frequency pair ``f`` the logit
of a centred query at position ``m`` on a key stored at position ``p`` is a trigonometric series in the
distance ``m - p``: ``sum_f |q_f| |k_f| cos(w_f (m - p) + phi_f)``. Evaluated at a few future distances it
says which keys the coming queries will look at; where the queries scatter around the centre, the key's
norm in that pair stands in for the part the centre does not explain. The reference code takes the centres
from an offline calibration run; here they are running statistics of the queries this sequence has
produced (SPEC §5, "TriAttention"). No attention weights are observed, so decoding keeps the fused path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from einops import rearrange
from torch import Tensor

from .base import EvictionPolicy
from .config import PolicyConfigError, check_choice, check_int
from .observer import ObservedLayer
from .scoring import group_queries, last_queries, reduce_group
from .state import PolicyState

#: Where the query centres come from.
CENTRES = ("running", "window")
#: How each key's norm enters the score.
NORM_TERMS = ("dispersion", "magnitude", "none")
#: How the scores at the future distances are combined.
OFFSET_REDUCES = ("mean", "max")
#: How the query heads of a GQA group are combined (after the per-head normalisation).
GROUP_REDUCES = ("max", "mean")


def pair_norms(x: Tensor) -> Tensor:
    """The magnitude of every RoPE frequency pair ``(x_f, x_{f + d/2})`` (rotate-half convention).

    Args:
        x: ``(..., d)``, ``d`` even.

    Returns:
        ``(..., d // 2)`` float32.
    """
    a, b = x.float().chunk(2, dim=-1)
    return torch.sqrt(a * a + b * b)


def geometric_offsets(max_offset: int, device: torch.device | str) -> Tensor:
    """The future distances TriAttention scores at: ``1, 2, 4, ...`` up to ``max_offset`` (int64)."""
    return 2 ** torch.arange(max_offset.bit_length(), device=device)


def rotary_gain(rope: Any, t: Tensor, head_dim: int) -> Tensor:
    """How much the rotary module scales each frequency pair (1 for plain RoPE, YaRN's attention factor).

    Read off the rope itself by rotating the probe ``(1, ..., 1, 0, ..., 0)`` to ``t``, so any module with
    ``rotate(x, positions)`` of the rotate-half convention serves.

    Args:
        rope: The rotary module.
        t: ``(b,)`` a position per row (the gain does not depend on it).
        head_dim: Width of a head (even).

    Returns:
        ``(b, head_dim // 2)`` float32.
    """
    probe = (torch.arange(head_dim, device=t.device) < head_dim // 2).float()
    return pair_norms(rope.rotate(probe.expand(t.shape[0], 1, 1, head_dim), t[:, None]))[:, 0, 0]


@dataclass(eq=False)
class QueryCentres:
    """Running sums of one layer's pre-RoPE queries, per row and query head (TriAttention's calibration).

    Attributes:
        total: ``(batch, heads, head_dim)`` float32 sum of the queries.
        magnitude: ``(batch, heads, head_dim // 2)`` float32 sum of their frequency-pair magnitudes.
        count: ``(batch,)`` float32 queries summed.
        folded: ``(batch,)`` int64 the newest position summed (``-1``: none).
    """

    total: Tensor
    magnitude: Tensor
    count: Tensor
    folded: Tensor

    @classmethod
    def zeros(cls, batch: int, heads: int, head_dim: int, device: torch.device | str) -> QueryCentres:
        """Empty sums for ``batch`` rows of ``heads`` query heads of width ``head_dim``."""
        return cls(torch.zeros(batch, heads, head_dim, device=device),
                   torch.zeros(batch, heads, head_dim // 2, device=device),
                   torch.zeros(batch, device=device), torch.full((batch,), -1, dtype=torch.long, device=device))

    def clear(self, rows: Tensor) -> None:
        """Forgets the queries of ``rows`` (a row starting a new sequence)."""
        self.total[rows] = 0.0
        self.magnitude[rows] = 0.0
        self.count[rows] = 0.0
        self.folded[rows] = -1

    def add(self, rows: Tensor, q: Tensor, mask: Tensor, newest: Tensor) -> None:
        """Adds queries to the sums of ``rows``, in place (device ops only).

        Args:
            rows: ``(b,)`` row indices.
            q: ``(b, heads, n, head_dim)`` pre-RoPE queries.
            mask: ``(b, n)`` the queries that count.
            newest: ``(b,)`` the newest position now summed.
        """
        q = torch.where(mask[:, None, :, None], q.float(), 0.0)  # padding and stale slots may hold anything
        self.total[rows] = self.total[rows] + q.sum(2)
        self.magnitude[rows] = self.magnitude[rows] + pair_norms(q).sum(2)
        self.count[rows] = self.count[rows] + mask.sum(-1)
        self.folded[rows] = torch.maximum(self.folded[rows], newest)

    def means(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        """``(centre (b, heads, head_dim), mean pair magnitude (b, heads, head_dim // 2))`` of ``rows`` (zeros
        for a row with no query yet)."""
        n = self.count[rows].clamp(min=1)[:, None, None]
        return self.total[rows] / n, self.magnitude[rows] / n


@dataclass
class TriAttention(EvictionPolicy):
    """TriAttention (Mao, Lin, Huang et al., 2026; github.com/WeianMao/triattention), SPEC §5.

    Recipe, per sequence, layer and query head ``h``, at each eviction at step ``t``:

    1. the query centre ``c`` (mean of the pre-RoPE queries) and, per frequency pair ``f``, the mean pair
       magnitude ``E|q_f|`` (:class:`QueryCentres`; ``centres="window"``: over the last ``window`` queries);
    2. the trigonometric term: ``c`` rotated to each future position ``t + 1 + D``,
       ``D = 1, 2, 4, ..., <= max_offset``, dotted with the post-RoPE key — which is
       ``sum_f |c_f| |k_f| cos(w_f (t + 1 + D - p) + phi_f)`` for a key at position ``p``, ``phi_f`` the phase
       between ``c_f`` and the pre-RoPE ``k_f`` — averaged (``offset_reduce="mean"``) or maxed over ``D``;
    3. the norm term: ``sum_f (E|q_f| - |c_f|) ||k_f||`` — the key's pair norms, weighted by how far the
       queries spread around their centre in that pair (``E|q_f| (1 - R_f)``, ``R_f`` the mean resultant
       length); ``norm_term="magnitude"`` weights by ``E|q_f|`` (the reference's ``disable_mlr``),
       ``"none"`` drops it;
    4. score = trigonometric + norm term (no ``1/sqrt(d)``, as in the reference);
    5. ``normalize``: z-score per query head over the filled evictable slots (positions ``>= n_prefix``);
    6. max over the query heads of the GQA group (``group_reduce="mean"``: their mean).

    With the mean over offsets the trigonometric term costs one dot product per key: it is linear in the
    query, so the centre's rotations to the future positions are averaged first. The rotary module's gain (YaRN's attention factor) enters both terms as it
    enters the model's logits.

    Statistics **(choice)**: the reference estimates ``c`` and ``E|q_f|`` once, offline, from ~32K tokens
    of calibration text. Here (``centres="running"``) they are the running means over every query of the
    sequence so far: the prompt's (at prefill, chunk by chunk for a chunked prefill) and every decode query,
    which the query ring hands over every ``window`` decode steps and at each eviction. The paper finds
    the centres stable across positions and inputs, which is what lets the sequence calibrate itself.
    ``centres="window"`` takes them from the last ``window`` queries at each eviction instead.

    Observes: the prompt's pre-RoPE queries (:meth:`observe_prefill`) and the query ring,
    ``query_window = window``; no attention weights.

    State: one :class:`QueryCentres` per layer (``state.layers[i]``).

    Args:
        budget: ``B_max`` (see :class:`~beaconkv.policies.base.EvictionPolicy`). The reference's cadence
            (back to the budget every 128 new tokens) is ``schedule=Buffered(buffer=128)``.
        window: Pre-RoPE queries the ring holds per head (default 128).
        centres: ``"running"`` (default) or ``"window"``.
        max_offset: Largest future distance scored at, ``>= 1`` (default 65536, the reference's).
        offset_reduce: ``"mean"`` (default) or ``"max"`` over the future distances.
        norm_term: ``"dispersion"`` (default), ``"magnitude"`` or ``"none"``.
        trig: Include the trigonometric term (default True; False is the reference's ``disable_trig``).
        normalize: z-score each query head's scores before the GQA reduction (default True).
        group_reduce: ``"max"`` (default) or ``"mean"``.

    Raises:
        PolicyConfigError: A bad ``window``/``max_offset``, an unknown choice, a flag that is not a bool,
            no term left (``trig=False`` with ``norm_term="none"``), or inconsistent base settings.
    """

    window: int = 128
    centres: str = "running"
    max_offset: int = 65536
    offset_reduce: str = "mean"
    norm_term: str = "dispersion"
    trig: bool = True
    normalize: bool = True
    group_reduce: str = "max"

    name: ClassVar[str] = "triattention"

    def validate(self) -> None:
        super().validate()
        check_int("window", self.window, 1, hint="(the pre-RoPE queries the ring holds per head; default 128)")
        check_int("max_offset", self.max_offset, 1, hint="(the largest future distance scored at; default 65536)")
        check_choice("centres", self.centres, CENTRES)
        check_choice("offset_reduce", self.offset_reduce, OFFSET_REDUCES)
        check_choice("norm_term", self.norm_term, NORM_TERMS)
        check_choice("group_reduce", self.group_reduce, GROUP_REDUCES)
        for flag in ("trig", "normalize"):
            if not isinstance(getattr(self, flag), bool):
                raise PolicyConfigError(f"{flag}={getattr(self, flag)!r} must be True or False.")
        if not self.trig and self.norm_term == "none":
            raise PolicyConfigError("trig=False with norm_term='none' leaves nothing to score; keep trig=True or "
                                    "choose norm_term='dispersion' or 'magnitude'.")

    def query_window(self, max_tokens: int) -> int:
        return self.window

    # ------------------------------------------------------------------------------- state
    def init_state(self, state: PolicyState) -> None:
        state.layers = [QueryCentres.zeros(obs.batch, obs.n_heads, obs.head_dim, state.device)
                        for obs in state.observers]

    def observe_prefill(self, state: PolicyState, layer_state: Any, q_pre: Tensor, positions: Tensor, valid: Tensor,
                        rows: Tensor) -> None:
        """A prefill starts the rows' sequences: their sums restart from the prompt's queries."""
        layer_state.clear(rows)
        self.observe_chunk(state, layer_state, q_pre, positions, valid, rows)

    def observe_chunk(self, state: PolicyState, layer_state: Any, q_pre: Tensor, positions: Tensor, valid: Tensor,
                      rows: Tensor) -> None:
        """Adds the queries of a chunk that continues the rows' tokens to their sums."""
        if self.centres == "running":
            layer_state.add(rows, q_pre, valid, torch.where(valid, positions, -1).amax(-1))

    def on_decode_step(self, state: PolicyState, rows: list[int]) -> None:
        """Every ``window`` decode steps, the ring's new queries join the running sums (before the ring
        overwrites them), whatever the eviction schedule."""
        if self.centres == "running" and rows and state.step % self.window == 0:
            rows_t = state.index(rows)
            state.executor.run(type(self).fold_ring, self, state, rows_t, state.t_dev[rows_t])

    def fold_ring(self, state: PolicyState, rows: Tensor, t: Tensor) -> None:
        """Adds every layer's ring queries at positions in ``(folded, t]`` to the running sums of ``rows``
        (a device function)."""
        for centres, layer in zip(state.layers, state.observers):
            q, _, mask = layer.ring(rows, centres.folded[rows], t)
            centres.add(rows, q, mask, t)

    # ------------------------------------------------------------------------------- scoring
    def query_statistics(self, layer_state: QueryCentres, cache: ObservedLayer, rows: Tensor,
                         t: Tensor) -> tuple[Tensor, Tensor]:
        """Step 1: ``(centre (b, heads, d), E|q_f| (b, heads, d // 2))`` at step ``t``.

        With ``centres="running"`` the ring's queries not yet summed (positions in ``(folded, t]``) are
        added to the running sums first, in place.
        """
        if self.centres == "window":
            q, _, mask = last_queries(cache, rows, t, self.window)  # (b, heads, R, d), (b, R)
            m = mask[:, None, :, None].float()
            n = m.sum(2).clamp(min=1)
            q = q.float() * m
            return q.sum(2) / n, pair_norms(q).sum(2) / n
        q, _, mask = cache.ring(rows, layer_state.folded[rows], t)  # the queries since the last fold
        layer_state.add(rows, q, mask, t)
        return layer_state.means(rows)

    def head_scores(self, state: PolicyState, centre: Tensor, magnitude: Tensor, keys: Tensor,
                    t: Tensor) -> Tensor:
        """Steps 2-4: ``(b, kv_heads, group, C)`` float32 scores of every slot, per query head.

        Args:
            state: The policy's state (its rotary module).
            centre: ``(b, heads, d)`` query centres.
            magnitude: ``(b, heads, d // 2)`` mean pair magnitudes.
            keys: ``(b, kv_heads, C, d)`` post-RoPE keys.
            t: ``(b,)`` newest positions.
        """
        n_kv, d = keys.shape[1], keys.shape[-1]
        keys = keys.float()
        scores = keys.new_zeros(keys.shape[0], n_kv, centre.shape[1] // n_kv, keys.shape[2])
        if self.trig:
            future = t[:, None] + 1 + geometric_offsets(self.max_offset, t.device)  # (b, n_off)
            rotated = state.rope.rotate(centre[:, :, None, :].expand(-1, -1, future.shape[1], -1), future).float()
            if self.offset_reduce == "mean":  # linear in the query: one rotated mean, one dot product per key
                rotated = rotated.mean(2, keepdim=True)
            logits = torch.einsum("bkgnd,bkcd->bkgnc", group_queries(rotated, n_kv), keys)  # (b, kv, g, n, C)
            scores = scores + (logits.mean(3) if self.offset_reduce == "mean" else logits.amax(3))
        if self.norm_term != "none":
            weight = magnitude - pair_norms(centre) if self.norm_term == "dispersion" else magnitude
            weight = weight * rotary_gain(state.rope, t, d)[:, None, :]  # (b, heads, d // 2)
            weight = rearrange(weight, "b (kv g) f -> b kv g f", kv=n_kv)
            scores = scores + torch.einsum("bkgf,bkcf->bkgc", weight, pair_norms(keys))
        return scores

    def score(self, layer: ObservedLayer, rows: Tensor, t: Tensor) -> Tensor:
        state = layer.state
        layer_state = layer.layer_state
        centre, magnitude = self.query_statistics(layer_state, layer, rows, t)
        per_head = self.head_scores(state, centre, magnitude, layer.keys(rows), t)
        if self.normalize:
            pos = layer.positions(rows)
            evictable = ((pos >= 0) & (pos >= state.prefix_dev[rows][:, None, None]))[:, :, None]  # (b, kv, 1, C)
            m = evictable.float()
            n = m.sum(-1, keepdim=True).clamp(min=1)
            mean = (per_head * m).sum(-1, keepdim=True) / n
            std = (((per_head - mean) * m).square().sum(-1, keepdim=True) / n).sqrt()
            per_head = torch.where(evictable, (per_head - mean) / std.clamp(min=1e-6), 0.0)
        return reduce_group(per_head, self.group_reduce)
