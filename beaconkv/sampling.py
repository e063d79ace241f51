"""Next-token selection without host synchronisation: greedy, temperature, top-k and top-p.

Sampling uses the exponential-race trick (``argmax(p / E)`` with ``E ~ Exp(1)`` is a draw from
``p``), which needs no ``multinomial`` call and no data-dependent shapes, so it runs inside a
compiled decode step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen.

    Attributes:
        temperature: 0 means greedy (argmax).
        top_p: Nucleus mass kept (1.0 = off).
        top_k: Most likely tokens kept (0 = off).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 = greedy).")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must lie in (0, 1].")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 = off).")

    @property
    def greedy(self) -> bool:
        """True when the choice is a plain argmax."""
        return self.temperature == 0 or self.top_k == 1


def sample_next(
    logits: Tensor, params: SamplingParams, generator: torch.Generator | None = None, noise: Tensor | None = None
) -> Tensor:
    """Picks one token per row of ``logits`` ``(batch, vocab)``; returns ``(batch,)`` int64.

    Args:
        logits: ``(batch, vocab)`` scores.
        params: How to choose.
        generator: Draws the race noise (None: the default generator).
        noise: Pre-drawn ``Exp(1)`` race noise ``(batch, vocab)`` float32 (see :func:`race_noise`),
            used instead of drawing from ``generator``: a compiled step cannot take a
            ``torch.Generator``, so it is handed the very draws the eager path would make.
    """
    if params.greedy:
        return logits.argmax(-1)
    logits = logits.float() / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the mass before it already reaches top_p (the top token always stays)
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(-1)
    race = noise if noise is not None else race_noise(*probs.shape, probs.device, generator)
    return (probs / race).argmax(-1)


def race_noise(
    batch: int, vocab: int, device: torch.device | str, generator: torch.Generator | None = None
) -> Tensor:
    """Draws the ``(batch, vocab)`` float32 ``Exp(1)`` noise :func:`sample_next` would draw itself."""
    return torch.empty(batch, vocab, dtype=torch.float32, device=device).exponential_(1.0, generator=generator)
