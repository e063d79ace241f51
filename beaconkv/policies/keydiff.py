"""KeyDiff: keep the keys that differ most from the cache's average key direction.

Observes nothing: the score compares every cached key with the mean direction of the keys of its KV
head, so it needs neither queries nor attention weights (and works with fused attention kernels).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch.nn.functional as F
from torch import Tensor

from .base import EvictionPolicy
from .observer import ObservedLayer
from .state import PolicyState


def key_anchor_similarity(keys: Tensor, mask: Tensor) -> Tensor:
    """Cosine similarity of every key to the anchor of its (sequence, KV head): the mean unit key of ``mask``.

    Args:
        keys: ``(b, kv_heads, C, head_dim)`` keys.
        mask: ``(b, kv_heads, C)`` keys that make up the anchor (the others are scored but not averaged).

    Returns:
        ``(b, kv_heads, C)`` float32 cosine similarities in ``[-1, 1]`` (0 for a zero key or anchor).
    """
    unit = F.normalize(keys.float(), dim=-1)  # every key counts alike in the anchor, whatever its norm
    m = mask[..., None].float()
    anchor = (unit * m).sum(2, keepdim=True) / m.sum(2, keepdim=True).clamp(min=1)  # (b, kv, 1, d)
    return (unit * F.normalize(anchor, dim=-1)).sum(-1)


@dataclass
class KeyDiff(EvictionPolicy):
    """Key-similarity-based eviction (Park et al., 2025), SPEC §5.

    Recipe, per sequence and KV head, at each eviction:

    1. the *anchor*: the mean of the unit-normalised keys of every filled slot of that head (prefix
       included: it is what the cache holds), as in kvpress's ``KeyDiffPress``;
    2. score ``-cos(k_j, anchor)``: the keys least aligned with the anchor score highest, so the
       cache keeps its most distinct keys and drops the ones most like the average.

    The paper compresses block by block as the prompt streams in; here the score runs at each
    eviction of the shared schedule (SPEC §2), over every cached key.

    Observes: nothing (no query ring, no attention weights).

    Args:
        budget: ``B_max`` (see :class:`~beaconkv.policies.base.EvictionPolicy`).

    Raises:
        PolicyConfigError: The base settings are inconsistent (see
            :class:`~beaconkv.policies.base.EvictionPolicy`).
    """

    name: ClassVar[str] = "keydiff"

    def score(self, layer: ObservedLayer, rows: Tensor, t: Tensor) -> Tensor:
        return -key_anchor_similarity(layer.keys(rows), layer.positions(rows) >= 0)
