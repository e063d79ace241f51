"""KNorm: keys with a small L2 norm draw the most attention, so keep the lowest-norm keys.

Observes nothing: the score of a slot is read off its key alone. RoPE rotates a key without changing
its length, so the cached (post-RoPE) keys give the same norms as the pre-RoPE ones -- in exact
arithmetic: the rounding of the rotated keys differs by position, so two copies of one key (the same
token at layer 0) get norms a rounding step apart, in an order that depends on the CPU. Norms that close
count as a tie (``tie_rtol``) and fall to the stated tie rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from torch import Tensor

from .base import EvictionPolicy
from .config import check_number
from .observer import ObservedLayer
from .query_selection import TIE_RTOL
from .scoring import merge_near_ties
from .state import PolicyState


@dataclass
class KNorm(EvictionPolicy):
    """L2-norm-based eviction (Devoto et al., 2024), SPEC §5.

    The paper finds that the keys with the *lowest* L2 norm are the ones later queries attend to most,
    so it keeps those and drops the high-norm ones.

    Recipe, per sequence and KV head, at each eviction: score ``-||k_j||_2`` for every cached key
    (float32); the base keeps the prefix, the ``n_recent`` newest and the best ``B_min`` of the rest
    (ties: the newer key; norms within ``tie_rtol`` of each other are ties, see
    :func:`~beaconkv.policies.scoring.merge_near_ties`). Every KV head chooses its own set; queries play
    no part.

    Observes: nothing (no query ring, no attention weights).

    Args:
        budget: ``B_max`` (see :class:`~beaconkv.policies.base.EvictionPolicy`).
        tie_rtol: Norms this close (relative, at least absolute below 1) tie (default
            :data:`~beaconkv.policies.query_selection.TIE_RTOL`, a few float32 rounding steps; 0 ranks on the
            exact float32 norms, whose order between copies of one key depends on the CPU).

    Raises:
        PolicyConfigError: ``tie_rtol`` is not in ``[0, 1)``, or the base settings are inconsistent
            (see :class:`~beaconkv.policies.base.EvictionPolicy`).
    """

    tie_rtol: float = TIE_RTOL

    name: ClassVar[str] = "knorm"

    def validate(self) -> None:
        super().validate()
        check_number("tie_rtol", self.tie_rtol, 0, 1, open_high=True, hint=f"(default {TIE_RTOL})")

    def score(self, layer: ObservedLayer, rows: Tensor, t: Tensor) -> Tensor:
        norms = layer.keys(rows).float().norm(dim=-1)  # (b, kv_heads, capacity)
        return merge_near_ties(-norms, self.tie_rtol)
