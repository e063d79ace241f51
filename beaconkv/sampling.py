"""Next-token selection without host synchronisation: greedy, temperature, top-k and top-p.

Sampling uses the exponential-race trick (``argmax(p / E)`` with ``E ~ Exp(1)`` is a draw from
``p``), which needs no ``multinomial`` call and no data-dependent shapes, so it runs inside a
compiled decode step.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
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

    Raises:
        ValueError: A temperature that is negative, NaN or infinite; a ``top_p`` outside ``(0, 1]``
            (NaN included); a ``top_k`` that is negative or not an int.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        for name, value in (("temperature", self.temperature), ("top_p", self.top_p)):
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise ValueError(f"{name}={value!r} must be a finite number "
                                 f"({'>= 0; 0 = greedy' if name == 'temperature' else 'in (0, 1]; 1 = off'}).")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 = greedy).")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must lie in (0, 1] (1 = off).")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral):
            raise ValueError(f"top_k={self.top_k!r} must be an int >= 0 (0 = off).")
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


@dataclass(frozen=True)
class SamplingMode:
    """Which sampling features any row of a batch uses: the constants of a compiled decode step.

    A batch whose rows all decode greedily compiles to a plain argmax; top-k and top-p cost a sort of
    the vocabulary, so they are only in the graph when some row asks for them.

    Attributes:
        sample: Some row samples (temperature > 0 and top_k != 1).
        top_k: Some sampled row keeps only its top-k tokens.
        top_p: Some sampled row uses nucleus sampling.
    """

    sample: bool = False
    top_k: bool = False
    top_p: bool = False

    @classmethod
    def of(cls, params: Sequence[SamplingParams]) -> SamplingMode:
        """The mode covering every row's parameters."""
        sampled = [p for p in params if not p.greedy]
        return cls(bool(sampled), any(p.top_k > 0 for p in sampled), any(p.top_p < 1 for p in sampled))


@dataclass
class RowSampling:
    """Per-row sampling parameters as device tensors (each request of a batch has its own).

    Attributes:
        temperature: ``(batch,)`` float32; rows that decode greedily hold 0.
        top_p: ``(batch,)`` float32 nucleus mass (1 = off).
        top_k: ``(batch,)`` int64 (0 = off).
        mode: What the rows need (see :class:`SamplingMode`).
    """

    temperature: Tensor
    top_p: Tensor
    top_k: Tensor
    mode: SamplingMode

    @classmethod
    def of(cls, params: Sequence[SamplingParams], device: torch.device | str) -> RowSampling:
        """The tensors of one :class:`SamplingParams` per row (greedy rows get temperature 0)."""
        temperature = [0.0 if p.greedy else p.temperature for p in params]
        return cls(
            torch.tensor(temperature, dtype=torch.float32, device=device),
            torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            torch.tensor([p.top_k for p in params], dtype=torch.long, device=device),
            SamplingMode.of(params),
        )

    def set_row(self, row: int, params: SamplingParams, rows: Sequence[SamplingParams]) -> None:
        """Writes one row's parameters in place; ``rows`` (every row's, this one included) gives the mode."""
        self.temperature[row] = 0.0 if params.greedy else params.temperature
        self.top_p[row] = params.top_p
        self.top_k[row] = params.top_k
        self.mode = SamplingMode.of(rows)


def sample_rows(logits: Tensor, sampling: RowSampling, noise: Tensor | None = None) -> Tensor:
    """Picks one token per row with that row's own parameters; returns ``(batch,)`` int64.

    Row ``b`` gets exactly what :func:`sample_next` would give it alone with its parameters and the
    same noise row: greedy rows (temperature 0) take the argmax; the others divide by their
    temperature, keep their top-k and their nucleus, and race ``probs / noise``.

    Args:
        logits: ``(batch, vocab)`` scores.
        sampling: Per-row parameters; its ``mode`` decides what is computed at all.
        noise: ``(batch, vocab)`` float32 ``Exp(1)`` race noise (rows that do not sample: anything
            positive); needed when ``sampling.mode.sample``.
    """
    greedy = logits.argmax(-1)
    mode = sampling.mode
    if not mode.sample:
        return greedy
    assert noise is not None, "sampled rows need race noise"
    temperature = sampling.temperature
    sampled_row = temperature > 0
    x = logits.float() / torch.where(sampled_row, temperature, 1.0)[:, None]
    if mode.top_k:
        k = sampling.top_k
        sorted_x = torch.sort(x, dim=-1, descending=True).values
        kth = torch.gather(sorted_x, -1, (k - 1).clamp(0, x.shape[-1] - 1)[:, None])  # the k-th largest value
        x = x.masked_fill((k > 0)[:, None] & (x < kth), float("-inf"))
    if mode.top_p:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        p_sorted = sorted_x.softmax(-1)
        # drop a token when the mass before it already reaches top_p (the top token always stays)
        drop_sorted = ((p_sorted.cumsum(-1) - p_sorted) >= sampling.top_p[:, None]) & (sampling.top_p < 1)[:, None]
        x = x.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), float("-inf"))
    raced = (x.softmax(-1) / noise).argmax(-1)
    return torch.where(sampled_row, raced, greedy)
