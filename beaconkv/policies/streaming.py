"""StreamingLLM: keep a few attention-sink tokens at the start and a sliding window of the most recent.

Observes nothing: the score of a slot is its position (newer = higher) and the sinks score ``+inf``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from .observer import ObservedLayer
from .base import EvictionPolicy
from .config import PolicyConfigError, check_int
from .state import PolicyState


@dataclass
class StreamingLLM(EvictionPolicy):
    """Attention sinks + sliding window (Xiao et al., 2023).

    Recipe: at every eviction keep the first ``n_sink`` *evictable* tokens (positions
    ``n_prefix .. n_prefix + n_sink - 1`` of each sequence) and fill the rest of ``B_min`` with the
    most recent tokens. With the default ``n_prefix`` (the whole prompt) the prompt is already
    protected, so the sinks are the first ``n_sink`` generated tokens; with ``n_prefix=0`` they are the
    classic first tokens of the sequence.

    Score: the slot's position, ``+inf`` for the sinks. No query window, no attention tracking.

    Args:
        budget: ``B_max`` (see :class:`~beaconkv.policies.base.EvictionPolicy`).
        n_sink: Sink tokens kept after the prefix (default 4).

    Raises:
        PolicyConfigError: ``n_sink < 0``, or ``n_sink + n_recent > B_min`` (the sinks would crowd out
            the recent window).
    """

    n_sink: int = 4

    name: ClassVar[str] = "streaming"

    def validate(self) -> None:
        super().validate()
        check_int("n_sink", self.n_sink, 0, hint="(default 4)")
        if self.b_min is not None and self.n_sink + self.n_recent > self.b_min:
            raise PolicyConfigError(
                f"n_sink={self.n_sink} + n_recent={self.n_recent} exceeds B_min={self.b_min} (budget={self.budget}); "
                f"use n_sink <= {max(self.b_min - self.n_recent, 0)} or a larger budget."
            )

    def score(self, layer: ObservedLayer, rows: Tensor, t: Tensor) -> Tensor:
        state = layer.state
        pos = layer.positions(rows)  # (b, kv_heads, capacity)
        n_prefix = state.prefix_dev[rows][:, None, None]
        sink = (pos >= n_prefix) & (pos < n_prefix + self.n_sink)
        return torch.where(sink, math.inf, pos.float())
