"""The eviction-policy base class and the shared keep/compact mechanism.

A policy decides *what* to keep; the cache (:meth:`beaconkv.cache.LayerKVCache.compact`) does the
moving. A new scoring policy is a small subclass that implements :meth:`EvictionPolicy.score`,
returning one score per cached slot, shape ``(b, kv_heads, capacity)``; the base class protects the
prefix and the recent tokens, takes the top-k, and compacts in position order.

Budget semantics (SPEC §2), per sequence and KV head:

* ``n_prefix`` protected tokens at the start (default: the whole prompt) are never evicted;
* ``budget`` (``B_max``) is the most *evictable* tokens the cache may hold; when the evictable count
  reaches it, the policy evicts down to ``B_min = floor(ratio * budget)`` (ratio 7/8);
* the last ``n_recent`` tokens always survive;
* so the cache never holds more than ``n_prefix + budget`` tokens, and its memory is allocated once.

Lifecycle, driven by :func:`beaconkv.generate`:

1. :meth:`EvictionPolicy.capacity` sizes the cache from the prompt lengths;
2. :meth:`EvictionPolicy.start` binds the policy to the freshly allocated cache (per-layer state,
   prefill hooks);
3. the prefill writes every prompt token (and calls :meth:`observe_prefill` per layer), then
   :meth:`after_prefill` runs — it evicts at once if a prompt already exceeds the budget;
4. each decode step writes one key and one pre-RoPE query per sequence in place (static shapes),
   then :meth:`after_decode_step` runs on the host: it updates the evictable counts (plain Python
   integers, so no device read is needed to know when to evict) and evicts the sequences whose
   count reached ``budget``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..cache import KVCache, LayerKVCache


class PolicyConfigError(ValueError):
    """Inconsistent policy settings (budget, ratio, n_recent, n_prefix...)."""


@dataclass
class EvictionRecord:
    """Telemetry of one eviction of one layer.

    Attributes:
        step: Decode step (0 = right after prefill).
        layer: Layer index.
        rows: Batch indices that were evicted.
        kept_positions: ``(len(rows), kv_heads, K)`` kept positions (``-1`` = padding), on CPU.
        observed_positions: Positions of the queries the policy scored with, ``(len(rows), n)`` (``-1`` = unused).
    """

    step: int
    layer: int
    rows: list[int]
    kept_positions: Tensor
    observed_positions: Tensor | None = None


@dataclass
class PolicyStats:
    """Counters a policy keeps during one generation.

    Attributes:
        evictions: Evictions per sequence.
        eviction_seconds: Host wall time spent inside eviction (scoring + compaction).
        telemetry: Per-eviction records when telemetry is on.
    """

    evictions: list[int] = field(default_factory=list)
    eviction_seconds: float = 0.0
    telemetry: list[EvictionRecord] = field(default_factory=list)


def select_keep(
    scores: Tensor,
    pos: Tensor,
    n_prefix: Tensor,
    t: Tensor,
    n_recent: int,
    keep_total: Tensor,
    keep_max: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Chooses the slots to keep: prefix and recent tokens, then the best-scored, in position order.

    Args:
        scores: ``(b, kv_heads, C)`` higher = keep; may be ``+inf`` to force a keep.
        pos: ``(b, kv_heads, C)`` slot positions (``-1`` empty).
        n_prefix: ``(b,)`` protected prefix length per sequence.
        t: ``(b,)`` position of the newest token.
        n_recent: The last ``n_recent`` positions are always kept.
        keep_total: ``(b,)`` slots to keep per sequence.
        keep_max: ``max(keep_total)`` when the caller knows it on the host; None reads it from the
            device (a sync and a data-dependent shape — pass it inside compiled code).

    Returns:
        ``(keep, keep_valid)``, both ``(b, kv_heads, K)`` with ``K = max(keep_total)``: slot indices
        sorted by position, and whether each entry is real (False entries come last).

    Ties in score break toward the more recent position, so the choice does not depend on the
    capacity or on the other sequences of the batch.
    """
    filled = pos >= 0
    protected = filled & ((pos < n_prefix[:, None, None]) | (pos > (t - n_recent)[:, None, None]))
    key = torch.where(protected, math.inf, scores.float())
    key = torch.where(filled, key, -math.inf)
    key = torch.nan_to_num(key, nan=-1e30, posinf=math.inf)
    # stable sort: first newest-first by position, then by score descending
    by_pos = torch.argsort(pos, dim=-1, descending=True, stable=True)
    order = torch.gather(
        by_pos, -1, torch.argsort(torch.gather(key, -1, by_pos), dim=-1, descending=True, stable=True)
    )
    K = int(keep_total.max()) if keep_max is None else keep_max
    top = order[..., :K]
    ranks = torch.arange(K, device=pos.device)
    valid = (ranks[None, None, :] < keep_total[:, None, None]) & torch.gather(filled, -1, top)
    top_pos = torch.where(valid, torch.gather(pos, -1, top), torch.iinfo(torch.long).max)
    resort = torch.argsort(top_pos, dim=-1, stable=True)
    return torch.gather(top, -1, resort), torch.gather(valid, -1, resort)


class EvictionPolicy:
    """Base class of every KV-cache eviction policy.

    Subclasses implement :meth:`score` (and optionally the hooks :meth:`init_layer`,
    :meth:`observe_prefill`, :meth:`on_decode`, :meth:`after_evict`). Everything about budgets,
    protection, scheduling and compaction is shared.

    Args:
        budget: ``B_max``, evictable tokens per sequence and KV head; None = never evict.
        n_prefix: Protected leading tokens; None = the whole prompt of each sequence.
        n_recent: The last ``n_recent`` tokens are never evicted.
        ratio: ``B_min = floor(ratio * budget)``, in (0, 1).
        telemetry: Record kept positions and observation sets of every eviction.

    Invariants (property-tested):
        * the cache holds at most ``n_prefix + budget`` tokens per (sequence, KV head);
        * each eviction leaves exactly ``n_prefix + B_min``;
        * prefix and the last ``n_recent`` positions survive every eviction;
        * kept K/V are bit-identical to what was written, positions strictly increasing.

    Raises:
        PolicyConfigError: ``budget < 1``, ratio outside (0, 1), or ``budget - B_min < n_recent``.
    """

    #: Short registry name.
    name: str = "base"
    #: Whether attention layers must report decode attention weights.
    track_attention: bool = False

    def __init__(
        self,
        budget: int | None,
        *,
        n_prefix: int | None = None,
        n_recent: int = 16,
        ratio: float = 7 / 8,
        telemetry: bool = False,
    ) -> None:
        if not 0 < ratio < 1:
            raise PolicyConfigError(f"ratio={ratio} must lie strictly between 0 and 1 (default 7/8).")
        if n_recent < 0:
            raise PolicyConfigError(f"n_recent={n_recent} must be >= 0.")
        if n_prefix is not None and n_prefix < 0:
            raise PolicyConfigError(f"n_prefix={n_prefix} must be >= 0 (or None for the whole prompt).")
        if budget is not None:
            if budget < 1:
                raise PolicyConfigError(f"budget={budget} must be >= 1.")
            b_min = math.floor(ratio * budget)
            if budget - b_min < n_recent or b_min < n_recent:
                need = max(math.ceil(n_recent / (1 - ratio)), math.ceil(n_recent / ratio))
                raise PolicyConfigError(
                    f"budget={budget} with ratio={ratio:.4g} evicts down to B_min={b_min}, which leaves "
                    f"{budget - b_min} < n_recent={n_recent} slots per eviction; use budget >= {need} "
                    f"or a smaller n_recent."
                )
        self.budget, self.n_prefix, self.n_recent, self.ratio = budget, n_prefix, n_recent, ratio
        self.telemetry = telemetry
        self.cache: KVCache | None = None
        self.rope: Any = None
        self.stats = PolicyStats()

    # ---------------------------------------------------------------- sizing
    @property
    def b_min(self) -> int | None:
        """``floor(ratio * budget)``: evictable tokens left after an eviction."""
        return None if self.budget is None else math.floor(self.ratio * self.budget)

    @property
    def query_window(self) -> int:
        """How many recent pre-RoPE queries per head the cache must keep in its ring (0: none)."""
        return 0

    def prefix_lengths(self, prompt_lengths: list[int]) -> list[int]:
        """Protected prefix length of each sequence.

        Raises:
            PolicyConfigError: An int ``n_prefix`` exceeds a prompt.
        """
        if self.n_prefix is None:
            return list(prompt_lengths)
        too_long = [L for L in prompt_lengths if self.n_prefix > L]
        if too_long:
            raise PolicyConfigError(
                f"n_prefix={self.n_prefix} is longer than a prompt of {min(too_long)} tokens; "
                "use n_prefix=None (the whole prompt) or a smaller int."
            )
        return [self.n_prefix] * len(prompt_lengths)

    def capacity(self, prompt_lengths: list[int], max_new_tokens: int) -> int:
        """Cache slots needed per (sequence, KV head) for this batch.

        FullKV-like policies (``budget=None``) need every token; others ``max(n_prefix) + budget``.
        """
        longest = max(L + max_new_tokens for L in prompt_lengths)
        if self.budget is None:
            return longest
        bound = max(p + self.budget for p in self.prefix_lengths(prompt_lengths))
        return max(min(bound, longest), max(prompt_lengths))

    # ------------------------------------------------------------- lifecycle
    def start(self, cache: KVCache, rope: Any, prompt_lengths: list[int]) -> None:
        """Binds the policy to a freshly allocated cache for one generation.

        Args:
            cache: The generation's cache.
            rope: The model's rotary module (re-rotates stored queries).
            prompt_lengths: Real prompt length of each sequence.
        """
        self.cache, self.rope = cache, rope
        self.prompt_lengths = list(prompt_lengths)
        self.prefix = self.prefix_lengths(prompt_lengths)
        self.count = [L - p for L, p in zip(prompt_lengths, self.prefix)]
        self.t = [L - 1 for L in prompt_lengths]
        self.step = 0
        self.stats = PolicyStats(evictions=[0] * len(prompt_lengths))
        self.peak_tokens = max(prompt_lengths)
        for i, layer in enumerate(cache.layers):
            layer.prefill_hook = (lambda q, p, v, i=i: self.observe_prefill(i, q, p, v))
            self.init_layer(i, layer)

    def after_prefill(self) -> None:
        """Host-side bookkeeping after the prompt was written; evicts over-budget sequences."""
        self.on_prefill_done()
        self.evict_due()
        self.after_count_change(list(range(len(self.count))))

    def after_decode_step(self) -> None:
        """Host-side bookkeeping after one decode step wrote a token for every sequence."""
        self.step += 1
        self.count = [c + 1 for c in self.count]
        self.t = [t + 1 for t in self.t]
        self.peak_tokens = max(self.peak_tokens, max(p + c for p, c in zip(self.prefix, self.count)))
        rows = list(range(len(self.count)))
        self.on_decode(rows)
        self.evict_due()
        self.after_count_change(rows)

    def evict_due(self) -> None:
        """Evicts every sequence whose evictable count reached ``budget`` (override for another cadence)."""
        if self.budget is None:
            return
        due = [b for b, c in enumerate(self.count) if c >= self.budget]
        if due:
            self.evict(due)

    def evict(self, rows: list[int]) -> None:
        """Scores and compacts the given sequences in every layer, down to ``n_prefix + keep_count`` (``B_min``)."""
        assert self.cache is not None
        t0 = time.perf_counter()
        device = self.cache[0].pos.device
        kept_counts = self.keep_count(rows)
        totals = [self.prefix[b] + k for b, k in zip(rows, kept_counts)]

        def host(values: list[int]) -> Tensor:
            return torch.tensor(values, device=device)

        self.evict_layers(rows, host(rows), host([self.t[b] for b in rows]), host([self.prefix[b] for b in rows]),
                          host(totals), max(totals))
        for b, kept_count in zip(rows, kept_counts):
            self.count[b] = kept_count
            self.stats.evictions[b] += 1
        self.after_evict(rows)
        self.stats.eviction_seconds += time.perf_counter() - t0

    def evict_layers(
        self, rows: list[int], rows_t: Tensor, t: Tensor, n_prefix: Tensor, keep_total: Tensor, keep_max: int
    ) -> None:
        """The part of :meth:`evict` that touches the cache: scores, selects and compacts ``rows`` in every layer.

        Compiled decoding runs it as compiled graphs for full-batch evictions; the bookkeeping around
        it stays :meth:`evict`'s.

        Args:
            rows: The batch indices (host).
            rows_t: The same, ``(b,)`` on the cache's device.
            t: ``(b,)`` newest positions.
            n_prefix: ``(b,)`` protected prefix lengths.
            keep_total: ``(b,)`` slots each row keeps.
            keep_max: ``max(keep_total)``, known on the host.
        """
        for i, layer in enumerate(self.cache.layers):
            scores = self.score(i, layer, rows_t, t)
            keep, keep_valid = select_keep(scores, layer.pos[rows_t], n_prefix, t, self.n_recent, keep_total, keep_max)
            if self.telemetry:
                kept = torch.where(keep_valid, torch.gather(layer.pos[rows_t], -1, keep), -1)
                self.stats.telemetry.append(
                    EvictionRecord(self.step, i, list(rows), kept.cpu(), self.observed_positions(i, rows_t, t))
                )
            layer.compact(rows_t, keep, keep_valid)

    def keep_count(self, rows: list[int]) -> list[int]:
        """Evictable tokens each of the given sequences keeps at this eviction. Default: ``B_min``.

        Policies with another cadence (RPC's and R-KV's original schedules) override this together
        with :meth:`evict_due` and :meth:`capacity`.
        """
        assert self.b_min is not None
        return [self.b_min] * len(rows)

    # ------------------------------------------------------------------ hooks
    def init_layer(self, layer: int, cache: LayerKVCache) -> None:
        """Allocates per-layer state (called once per generation). Default: nothing."""

    def observe_prefill(self, layer: int, q_pre: Tensor, positions: Tensor, valid: Tensor) -> None:
        """Sees the prompt's pre-RoPE queries ``(batch, heads, L, head_dim)`` of one layer. Default: nothing."""

    def on_prefill_done(self) -> None:
        """Host hook after the prefill, before any eviction. Default: nothing."""

    def on_decode(self, rows: list[int]) -> None:
        """Host hook after each decode step's write, before the eviction check. Default: nothing."""

    def after_evict(self, rows: list[int]) -> None:
        """Host hook after the given sequences were evicted. Default: nothing."""

    def after_count_change(self, rows: list[int]) -> None:
        """Host hook after every change of the evictable counts (decode step or eviction). Default: nothing."""

    def observed_positions(self, layer: int, rows: Tensor, t: Tensor) -> Tensor | None:
        """Positions of the queries used for scoring (telemetry). Default: None."""
        return None

    def score(self, layer: int, cache: LayerKVCache, rows: Tensor, t: Tensor) -> Tensor:
        """Scores every cached slot of the given sequences; higher = keep.

        Args:
            layer: Layer index.
            cache: The layer's cache (read ``cache.k``, ``cache.pos``, ``cache.queries`` ... at ``rows``).
            rows: ``(b,)`` batch indices being evicted.
            t: ``(b,)`` position of the newest token of each.

        Returns:
            ``(b, kv_heads, capacity)`` scores. Empty, prefix and recent slots are handled by the
            base class whatever their score.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement score()")

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(budget={self.budget}, n_prefix={self.n_prefix}, "
            f"n_recent={self.n_recent}, ratio={self.ratio:.4g})"
        )


class FullKV(EvictionPolicy):
    """Keeps every token (the reference). The cache is sized to prompt + ``max_new_tokens``."""

    name = "full"

    def __init__(self, telemetry: bool = False) -> None:
        super().__init__(None, telemetry=telemetry)

    def score(self, layer: int, cache: LayerKVCache, rows: Tensor, t: Tensor) -> Tensor:  # pragma: no cover
        raise RuntimeError("FullKV never evicts")
