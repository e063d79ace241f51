"""Next-token selection without host synchronisation: greedy, temperature, top-k, top-p, logit bias,
presence and frequency penalties, and the log-probabilities of the chosen and the most likely tokens.

Sampling uses the exponential-race trick (``argmax(p / E)`` with ``E ~ Exp(1)`` is a draw from
``p``), which needs no ``multinomial`` call and no data-dependent shapes, so it runs inside a
compiled decode step. Everything per row lives in :class:`RowSampling`, tensors of fixed shapes
written in place (like a cache): the parameters, a dense ``(batch, vocab)`` logit bias, the counts of
each row's generated tokens (the penalties read them; :func:`sample_rows` adds each chosen token
on the device) and the log-probabilities of the last step.

The order of the adjustments is OpenAI's and vLLM's: the model's logits, plus the logit bias, minus
the penalties (``presence_penalty * (count > 0) + frequency_penalty * count`` over the tokens
generated so far), then the temperature, top-k and top-p. The log-probabilities reported are those
of the *model* (a log-softmax of the raw logits, before bias, penalties, temperature, top-k and
top-p), as vLLM reports them by default (``logprobs_mode="raw_logprobs"``).

Every parameter is range-checked by :class:`SamplingParams` for what the tensors hold (float32,
int64), so a value the sampler cannot represent is refused where it is made, never inside a step.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .errors import BeaconKVError

FLOAT32_MAX = float(torch.finfo(torch.float32).max)
"""The largest float32 (about 3.4e38): the largest temperature a row can hold."""
INT64_MAX = 2**63 - 1
"""The largest int64: the largest ``top_k`` a row can hold (any ``top_k`` >= the vocabulary keeps every token)."""
GREEDY_BELOW = 1e-5
"""Temperatures below this decode greedily (vLLM's ``_SAMPLING_EPS``): dividing logits by a smaller
number overflows float32 into ``inf - inf = nan``."""
PENALTY_RANGE = (-2.0, 2.0)
"""The range of ``presence_penalty`` and ``frequency_penalty`` (OpenAI's)."""
LOGIT_BIAS_RANGE = (-100.0, 100.0)
"""The range of each ``logit_bias`` value (OpenAI's)."""
MAX_LOGPROBS = 20
"""Most alternative tokens whose log-probabilities one row reports (OpenAI's ``top_logprobs`` limit)."""
_TOP_P_FLOOR = 1e-38  # a top_p that rounds to 0 in float32 would drop even the most likely token


class SamplingError(BeaconKVError, ValueError):
    """A sampling parameter outside what the sampler takes.

    Args:
        field: The parameter (``"temperature"``, ``"logit_bias"``...).
        message: What is wrong, the allowed range, and the fix.

    Attributes:
        field: The parameter at fault.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _real(name: str, value: object, lo: float, hi: float, meaning: str) -> float:
    """``value`` as a finite float in ``[lo, hi]``, else :class:`SamplingError`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise SamplingError(name, f"{name}={value!r} must be a finite number ({meaning}).")
    if not lo <= value <= hi:
        raise SamplingError(name, f"{name}={value!r} is outside [{lo:g}, {hi:g}] ({meaning}).")
    return float(value)


def _logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """A ``{token id: bias}`` mapping (or pairs) as sorted ``(id, bias)`` pairs, range-checked."""
    items = value.items() if isinstance(value, Mapping) else value
    try:
        pairs = [(k, v) for k, v in items]  # noqa: C416 - each item must be a pair
    except (TypeError, ValueError):
        raise SamplingError("logit_bias", f"logit_bias={value!r} must map token ids to biases.") from None
    out: dict[int, float] = {}
    lo, hi = LOGIT_BIAS_RANGE
    for k, v in pairs:
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or not 0 <= k <= INT64_MAX:
            raise SamplingError("logit_bias", f"logit_bias key {k!r} must be a token id (an int >= 0).")
        if int(k) in out:
            raise SamplingError("logit_bias", f"logit_bias names token {int(k)} twice; give each token once.")
        out[int(k)] = _real(f"logit_bias[{int(k)}]", v, lo, hi, "added to the token's logit; -100 bans it, "
                            "100 forces it")
    return tuple(sorted(out.items()))


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen, and which log-probabilities are reported.

    Attributes:
        temperature: 0 means greedy (argmax); below :data:`GREEDY_BELOW` decodes greedily too. At
            most :data:`FLOAT32_MAX`.
        top_p: Nucleus mass kept, in ``(0, 1]`` (1.0 = off).
        top_k: Most likely tokens kept (0 = off), at most :data:`INT64_MAX`.
        presence_penalty: Subtracted from the logit of every token generated at least once so far, in
            :data:`PENALTY_RANGE`.
        frequency_penalty: Times the number of times a token was generated so far, subtracted from
            its logit, in :data:`PENALTY_RANGE`.
        logit_bias: ``{token id: bias}`` added to the logits (bias in :data:`LOGIT_BIAS_RANGE`); a
            mapping is stored as sorted ``(id, bias)`` pairs. The ids are checked against a
            vocabulary by the :class:`~beaconkv.engine.Engine`.
        logprobs: None: none; k in ``0 .. MAX_LOGPROBS``: the model's log-probability of each chosen
            token and of the k most likely tokens at each step.

    Raises:
        SamplingError: A value that is not a finite number (or an int where one is needed), or outside
            its range; the message names the field and the range.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None

    def __post_init__(self) -> None:
        for name, value in (("temperature", self.temperature), ("top_p", self.top_p)):
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise SamplingError(name, f"{name}={value!r} must be a finite number "
                                    f"({'>= 0; 0 = greedy' if name == 'temperature' else 'in (0, 1]; 1 = off'}).")
        if self.temperature < 0:
            raise SamplingError("temperature", f"temperature={self.temperature} must be >= 0 (0 = greedy).")
        if self.temperature > FLOAT32_MAX:
            raise SamplingError("temperature", f"temperature={self.temperature} is outside [0, {FLOAT32_MAX:.7g}] "
                                "(the float32 range the sampler divides by); 0 = greedy, 1 = the model's own "
                                "distribution.")
        if not 0 < self.top_p <= 1:
            raise SamplingError("top_p", f"top_p={self.top_p} must lie in (0, 1] (1 = off).")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral):
            raise SamplingError("top_k", f"top_k={self.top_k!r} must be an int >= 0 (0 = off).")
        if self.top_k < 0:
            raise SamplingError("top_k", f"top_k={self.top_k} must be >= 0 (0 = off).")
        if self.top_k > INT64_MAX:
            raise SamplingError("top_k", f"top_k={self.top_k} is outside [0, {INT64_MAX}] (int64); any top_k >= "
                                "the vocabulary size keeps every token, as 0 does.")
        lo, hi = PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            object.__setattr__(self, name, _real(name, getattr(self, name), lo, hi, "0 = off"))
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        k = self.logprobs
        if k is not None and (isinstance(k, bool) or not isinstance(k, numbers.Integral)
                              or not 0 <= k <= MAX_LOGPROBS):
            raise SamplingError("logprobs", f"logprobs={k!r} must be None or an int in [0, {MAX_LOGPROBS}] "
                                "(the most likely tokens reported beside the chosen one).")

    @property
    def greedy(self) -> bool:
        """True when the choice is a plain argmax (of the adjusted logits)."""
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    @property
    def adjusts(self) -> bool:
        """True when the logits are changed before the choice (a logit bias or a penalty)."""
        return bool(self.logit_bias) or self.presence_penalty != 0 or self.frequency_penalty != 0


def sample_next(
    logits: Tensor, params: SamplingParams, generator: torch.Generator | None = None, noise: Tensor | None = None
) -> Tensor:
    """Picks one token per row of ``logits`` ``(batch, vocab)``; returns ``(batch,)`` int64.

    The reference of :func:`sample_rows` for temperature, top-k and top-p (the logit bias and the
    penalties need the state of :class:`RowSampling`).

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

    A batch whose rows all decode greedily, without bias, penalties or log-probabilities, compiles to
    a plain argmax; top-k and top-p cost a sort of the vocabulary, the adjustments and the
    log-probabilities a few ``(batch, vocab)`` operations, so each is in the graph only when some row
    asks for it.

    Attributes:
        sample: Some row samples (temperature >= :data:`GREEDY_BELOW` and top_k != 1).
        top_k: Some sampled row keeps only its top-k tokens.
        top_p: Some sampled row uses nucleus sampling.
        adjust: Some row has a logit bias or a penalty (the token counts are kept up to date).
        logprobs: Some row reports log-probabilities.
    """

    sample: bool = False
    top_k: bool = False
    top_p: bool = False
    adjust: bool = False
    logprobs: bool = False

    @classmethod
    def of(cls, params: Sequence[SamplingParams]) -> SamplingMode:
        """The mode covering every row's parameters."""
        sampled = [p for p in params if not p.greedy]
        return cls(bool(sampled), any(p.top_k > 0 for p in sampled), any(p.top_p < 1 for p in sampled),
                   any(p.adjusts for p in params), any(p.logprobs is not None for p in params))


@dataclass
class RowSampling:
    """Per-row sampling state as device tensors of fixed shapes (each request of a batch has its own).

    The parameters are written by :meth:`set_row`; :func:`sample_rows` adds each chosen token to
    ``counts`` (when ``mode.adjust``) and writes the log-probabilities (when ``mode.logprobs``), in
    place. The tensors are never rebound, so a compiled step (a CUDA graph) keeps their addresses
    (:meth:`tensors` lists them for :meth:`~beaconkv.execution.Executor.prepare`).

    Attributes:
        temperature: ``(batch,)`` float32; rows that decode greedily hold 0.
        top_p: ``(batch,)`` float32 nucleus mass (1 = off).
        top_k: ``(batch,)`` int64 (0 = off).
        mode: What the rows need (see :class:`SamplingMode`).
        bias: ``(batch, vocab)`` float32 logit bias (None without a vocabulary size).
        presence: ``(batch,)`` float32 presence penalties.
        frequency: ``(batch,)`` float32 frequency penalties.
        counts: ``(batch, vocab)`` float32: how many times each row generated each token since it was
            set (None without a vocabulary size).
        logprob: ``(batch,)`` float32: the model's log-probability of the last chosen token.
        top_logprobs: ``(batch, k)`` float32: the ``k = min(MAX_LOGPROBS, vocab)`` largest
            log-probabilities of the last step, descending.
        top_ids: ``(batch, k)`` int64: their token ids.
    """

    temperature: Tensor
    top_p: Tensor
    top_k: Tensor
    mode: SamplingMode
    bias: Tensor | None = None
    presence: Tensor | None = None
    frequency: Tensor | None = None
    counts: Tensor | None = None
    logprob: Tensor | None = None
    top_logprobs: Tensor | None = None
    top_ids: Tensor | None = None

    @classmethod
    def of(cls, params: Sequence[SamplingParams], device: torch.device | str,
           vocab_size: int | None = None) -> RowSampling:
        """The tensors of one :class:`SamplingParams` per row (greedy rows get temperature 0).

        Args:
            params: Each row's parameters.
            device: Where the tensors live.
            vocab_size: The logits' width; needed for a logit bias, penalties and log-probabilities
                (None: rows may use none of them).

        Raises:
            ValueError: A row uses a logit bias, a penalty or log-probabilities without ``vocab_size``.
        """
        params = list(params)
        batch = len(params)
        out = cls(
            torch.tensor([0.0 if p.greedy else p.temperature for p in params], dtype=torch.float32, device=device),
            torch.tensor([max(p.top_p, _TOP_P_FLOOR) for p in params], dtype=torch.float32, device=device),
            torch.tensor([p.top_k for p in params], dtype=torch.long, device=device),
            SamplingMode.of(params),
        )
        if vocab_size is not None:
            k = min(MAX_LOGPROBS, vocab_size)
            out.bias = torch.zeros(batch, vocab_size, dtype=torch.float32, device=device)
            out.counts = torch.zeros(batch, vocab_size, dtype=torch.float32, device=device)
            out.presence = torch.zeros(batch, dtype=torch.float32, device=device)
            out.frequency = torch.zeros(batch, dtype=torch.float32, device=device)
            out.logprob = torch.zeros(batch, dtype=torch.float32, device=device)
            out.top_logprobs = torch.zeros(batch, k, dtype=torch.float32, device=device)
            out.top_ids = torch.zeros(batch, k, dtype=torch.long, device=device)
            for row, p in enumerate(params):
                out._write_adjustments(row, p)
        elif out.mode.adjust or out.mode.logprobs:
            raise ValueError("a logit bias, penalties and logprobs need RowSampling.of(..., vocab_size=...).")
        return out

    @property
    def vocab_size(self) -> int | None:
        """The logits' width the bias and counts are sized for (None: not sized)."""
        return None if self.bias is None else self.bias.shape[-1]

    def tensors(self) -> Iterator[Tensor]:
        """Every tensor of the state (for :meth:`~beaconkv.execution.Executor.prepare`)."""
        for t in (self.temperature, self.top_p, self.top_k, self.bias, self.presence, self.frequency, self.counts,
                  self.logprob, self.top_logprobs, self.top_ids):
            if t is not None:
                yield t

    def set_row(self, row: int, params: SamplingParams, rows: Sequence[SamplingParams]) -> None:
        """Writes one row's parameters in place and clears its token counts.

        Args:
            row: The row.
            params: Its parameters.
            rows: Every row's parameters, this one included: they give the :attr:`mode`.

        Raises:
            ValueError: The row uses a logit bias, a penalty or log-probabilities and the state has no
                vocabulary size, or a logit-bias id outside the vocabulary.
        """
        if self.bias is None and (params.adjusts or params.logprobs is not None):
            raise ValueError("a logit bias, penalties and logprobs need RowSampling.of(..., vocab_size=...).")
        if params.logit_bias and params.logit_bias[-1][0] >= self.bias.shape[-1]:
            raise ValueError(f"logit_bias names token {params.logit_bias[-1][0]}, outside the vocabulary "
                             f"0 .. {self.bias.shape[-1] - 1}.")
        self.temperature[row] = 0.0 if params.greedy else params.temperature
        self.top_p[row] = max(params.top_p, _TOP_P_FLOOR)
        self.top_k[row] = params.top_k
        if self.bias is not None:
            self._write_adjustments(row, params)
        self.mode = SamplingMode.of(rows)

    def _write_adjustments(self, row: int, params: SamplingParams) -> None:
        self.presence[row] = params.presence_penalty
        self.frequency[row] = params.frequency_penalty
        self.counts[row].zero_()
        self.bias[row].zero_()
        if params.logit_bias:
            ids, values = zip(*params.logit_bias)
            self.bias[row, torch.tensor(ids, device=self.bias.device)] = torch.tensor(
                values, dtype=torch.float32, device=self.bias.device)

    def take(self, rows: Sequence[int]) -> RowSampling:
        """A copy of some rows (their parameters and counts; the same mode), e.g. for sampling first tokens."""
        index = torch.tensor(list(rows), device=self.temperature.device)

        def pick(t: Tensor | None) -> Tensor | None:
            return None if t is None else t[index]

        return RowSampling(self.temperature[index], self.top_p[index], self.top_k[index], self.mode, pick(self.bias),
                           pick(self.presence), pick(self.frequency), pick(self.counts), pick(self.logprob),
                           pick(self.top_logprobs), pick(self.top_ids))

    def put_counts(self, rows: Sequence[int], part: RowSampling) -> None:
        """Writes the token counts of ``part`` (a :meth:`take` of ``rows``) back into these rows."""
        if self.counts is not None and part.counts is not None:
            self.counts[torch.tensor(list(rows), device=self.counts.device)] = part.counts


def sample_rows(logits: Tensor, sampling: RowSampling, noise: Tensor | None = None) -> Tensor:
    """Picks one token per row with that row's own parameters; returns ``(batch,)`` int64.

    Each row's logits get its bias and penalties (``mode.adjust``); greedy rows (temperature 0) take
    the argmax; the others divide by their temperature, keep their top-k and their nucleus, and race
    ``probs / noise`` — exactly what :func:`sample_next` gives a row alone with its parameters and the
    same noise row, when it has no bias or penalty (a row without them is computed bit for bit the
    same whether or not another row has them). Then, in place: the chosen tokens are counted
    (``mode.adjust``) and their log-probabilities written (``mode.logprobs``).

    Args:
        logits: ``(batch, vocab)`` scores.
        sampling: Per-row state; its ``mode`` decides what is computed at all.
        noise: ``(batch, vocab)`` float32 ``Exp(1)`` race noise (rows that do not sample: anything
            positive); needed when ``sampling.mode.sample``.
    """
    mode = sampling.mode
    x = logits
    if mode.adjust:
        counts = sampling.counts
        x = (logits.float() + sampling.bias - sampling.presence[:, None] * (counts > 0)
             - sampling.frequency[:, None] * counts)
    greedy = x.argmax(-1)
    tokens = greedy
    if mode.sample:
        assert noise is not None, "sampled rows need race noise"
        temperature = sampling.temperature
        sampled_row = temperature > 0
        x = x.float() / torch.where(sampled_row, temperature, 1.0)[:, None]
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
        tokens = torch.where(sampled_row, raced, greedy)
    if mode.adjust:
        sampling.counts.scatter_add_(1, tokens[:, None], torch.ones_like(tokens[:, None], dtype=torch.float32))
    if mode.logprobs:
        logprobs = logits.float().log_softmax(-1)
        sampling.logprob.copy_(logprobs.gather(-1, tokens[:, None])[:, 0])
        top = logprobs.topk(sampling.top_logprobs.shape[-1], dim=-1)
        sampling.top_logprobs.copy_(top.values)
        sampling.top_ids.copy_(top.indices)
    return tokens
