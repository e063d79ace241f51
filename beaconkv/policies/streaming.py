"""StreamingLLM: keep a few attention-sink tokens at the start and a sliding window of the most recent.

Observes nothing: the score of a slot is its position (newer = higher) and the sinks score ``+inf``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..cache import LayerKVCache
from .base import EvictionPolicy, PolicyConfigError


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
        **kwargs: ``n_prefix``, ``n_recent``, ``ratio``, ``telemetry`` of the base class.

    Raises:
        PolicyConfigError: ``n_sink < 0``, or ``n_sink + n_recent > B_min`` (the sinks would crowd out
            the recent window).
    """

    name = "streaming"

    def __init__(self, budget: int | None, n_sink: int = 4, **kwargs) -> None:
        super().__init__(budget, **kwargs)
        if n_sink < 0:
            raise PolicyConfigError(f"n_sink={n_sink} must be >= 0 (default 4).")
        if self.b_min is not None and n_sink + self.n_recent > self.b_min:
            raise PolicyConfigError(
                f"n_sink={n_sink} + n_recent={self.n_recent} exceeds B_min={self.b_min} (budget={budget}); "
                f"use n_sink <= {max(self.b_min - self.n_recent, 0)} or a larger budget."
            )
        self.n_sink = n_sink

    def score(self, layer: int, cache: LayerKVCache, rows: Tensor, t: Tensor) -> Tensor:
        pos = cache.pos[rows]  # (b, kv_heads, capacity)
        n_prefix = torch.tensor(self.prefix, device=pos.device)[rows][:, None, None]
        sink = (pos >= n_prefix) & (pos < n_prefix + self.n_sink)
        return torch.where(sink, math.inf, pos.float())

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, n_sink={self.n_sink})"
