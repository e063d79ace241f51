"""R-KV: importance from the last few queries minus redundancy among the cached keys.

Follows the reference code (Zefan-Cai/R-KV, ``rkv/utils.py`` and ``rkv/compression/r1_kv.py``) on
the project's cache layout: per sequence and KV head, slots in position order, some empty.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from einops import reduce
from torch import Tensor

from .observer import ObservedLayer
from .config import check_number
from .scoring import group_queries, pool_slots
from .state import PolicyState
from .window import RecentWindowPolicy

def key_redundancy(keys: Tensor, mask: Tensor, threshold: float) -> Tensor:
    """R-KV's redundancy of every key among the keys of ``mask``, per (sequence, KV head).

    ``S = cos(k_i, k_j)`` with a zero diagonal; for every key ``i``, the entry of its most recent
    (highest slot) neighbour with ``S > threshold`` is zeroed, so the newest copy of a repeated key is
    spared; ``redundancy[j] = softmax_j(mean_i S[i, j])`` over the masked keys. Like the reference,
    similarities below the threshold are kept in the mean: the threshold only picks the spared
    neighbour. Memory: one float32 and one int32 ``C x C`` matrix per (sequence, KV head).

    Args:
        keys: ``(b, kv_heads, C, head_dim)`` keys in position order.
        mask: ``(b, kv_heads, C)`` keys taking part.
        threshold: Cosine similarity above which two keys count as similar.

    Returns:
        ``(b, kv_heads, C)`` float32, a distribution over the masked keys (0 elsewhere).
    """
    k = keys.float()
    unit = k / (k.norm(dim=-1, keepdim=True) + 1e-8)
    sim = unit @ unit.transpose(-1, -2)  # (b, kv_heads, C, C), rows i, columns j
    sim.masked_fill_(~mask[..., None, :], 0.0).masked_fill_(~mask[..., :, None], 0.0)
    sim.diagonal(dim1=-2, dim2=-1).zero_()
    slots = torch.arange(sim.shape[-1], dtype=torch.int32, device=sim.device)
    newest = torch.where(sim > threshold, slots, -1).amax(-1, keepdim=True)  # (b, kv_heads, C, 1); -1: none
    spare = newest.clamp(min=0).long()
    sim.scatter_(-1, spare, sim.gather(-1, spare) * (newest < 0))  # zero S[i, newest[i]] where it exists
    n = mask.sum(-1, keepdim=True).clamp(min=1)  # (b, kv_heads, 1)
    mean = sim.sum(-2) / n  # mean over the rows i: (b, kv_heads, C)
    return torch.softmax(mean.masked_fill(~mask, -math.inf), dim=-1).nan_to_num(0.0)


@dataclass
class RKV(RecentWindowPolicy):
    """Redundancy-aware KV compression (Cai et al., 2025), SPEC §5.

    Recipe, per sequence and KV head, at each eviction at step ``t``:

    * **importance**: the last ``window`` pre-RoPE queries, each rotated to its *own* position;
      logits ``q·k / sqrt(d)`` reduced by the **max over the GQA group before the softmax**; softmax
      over every filled slot except the last ``window`` positions (``pos > t - window`` masked; the
      prefix takes part); mean over the queries; max pooling along the cache, kernel ``kernel``.
    * **redundancy**: :func:`key_redundancy` over the filled evictable keys (``pos >= n_prefix``),
      ``threshold`` on the cosine similarity.
    * score ``lam * importance - (1 - lam) * redundancy``; the last ``window`` positions score the
      largest float32 (the reference always keeps its observation window; the base's ``+inf``
      protection of the prefix and ``n_recent`` still comes first).

    Differences from the reference code (**choice**): the redundancy runs over the evictable keys only
    (the reference also counts the prompt and the window); a key without any similar neighbour spares
    nothing (the reference then zeroes its similarity to slot 0 by accident); the default ``lam`` is
    the paper's 0.1 (the code's default is 0.07).

    Schedule: the shared SPEC §2 semantics by default. R-KV's reference schedule is
    ``RKV(budget, schedule=Buffered(buffer=128))``: the cache evicts back to ``budget`` evictable tokens
    each time it holds ``budget + buffer`` (see :class:`~beaconkv.policies.schedules.Buffered`; the
    budget is then the size *after* an eviction, as in the R-KV paper).

    Observes: the query ring, ``query_window = window``.

    Args:
        budget: ``B_max`` (or, under :class:`~beaconkv.policies.schedules.Buffered`, the size after an eviction).
        window: Observed recent queries w (default 8).
        kernel: Odd max-pooling kernel (default 7).
        lam: Weight of the importance, in ``[0, 1]`` (default 0.1).
        threshold: Cosine similarity above which keys count as similar, in ``[0, 1]`` (default 0.5).

    Raises:
        PolicyConfigError: Bad ``window``/``kernel``/``lam``/``threshold``, or a missing budget.
    """

    window: int = 8
    kernel: int = 7
    lam: float = 0.1
    threshold: float = 0.5

    name: ClassVar[str] = "rkv"

    def validate(self) -> None:
        super().validate()
        check_number("lam", self.lam, 0.0, 1.0, hint="(default 0.1)")
        check_number("threshold", self.threshold, 0.0, 1.0, hint="(a cosine similarity; default 0.5)")

    # ---------------------------------------------------------------- scoring
    def importance(self, state: PolicyState, cache: ObservedLayer, rows: Tensor, t: Tensor) -> Tensor:
        """``(b, kv_heads, capacity)`` max-pooled attention of the last ``window`` queries (see the class)."""
        q_rot, qpos, q_mask = self.window_queries(state, cache, rows, t)  # each query at its own position
        qg = group_queries(q_rot.float(), cache.n_kv_heads)
        logits = torch.einsum("bkgnd,bkcd->bkgnc", qg, cache.keys(rows).float()) / math.sqrt(cache.head_dim)
        logits = reduce(logits, "b kv g n c -> b kv n c", "max")  # over the GQA group, before the softmax
        pos = cache.positions(rows)
        seen = (pos >= 0) & (pos <= (t - self.window)[:, None, None])  # all but the last window
        w = torch.softmax(logits.masked_fill(~seen[:, :, None], -math.inf), dim=-1).nan_to_num(0.0)
        w = w * q_mask[:, None, :, None]
        mean = w.sum(2) / q_mask.sum(-1).clamp(min=1)[:, None, None]
        return pool_slots(mean, self.kernel, "max")

    def score(self, layer: ObservedLayer, rows: Tensor, t: Tensor) -> Tensor:
        state = layer.state
        pos = layer.positions(rows)
        n_prefix = state.prefix_dev[rows][:, None, None]
        redundancy = key_redundancy(layer.keys(rows), (pos >= 0) & (pos >= n_prefix), self.threshold)
        scores = self.lam * self.importance(state, layer, rows, t) - (1 - self.lam) * redundancy
        # the observation window outranks every score but not the base's +inf (prefix, n_recent): when
        # window > B_min the window must not push the prefix out
        window_keep = torch.finfo(torch.float32).max
        return torch.where(pos > (t - self.window)[:, None, None], window_keep, scores)
