"""A hindsight ceiling for eviction: keep the tokens the reference's *future* queries attend most.

No real policy can see the future; this one exists to measure how much attention recall any
eviction policy could reach at a given budget, cadence and protection — the room left above
BeaconKV and its variants. A first FullKV pass over the same forced tokens records, per layer,
sequence and KV head, the attention every decode query gives every position (summed over the GQA
group); :class:`FutureAttentionOracle` then scores each cached slot by the attention all *later*
queries give its position, and the shared machinery (same ``B_max``/``B_min`` cadence, protected
prefix and recent window as every other run) keeps the highest. Greedy, so a ceiling for policies
of this shape rather than the exact optimum, and an upper reference for what a predictor of future
attention can gain.

Memory: ``layers x (steps + 1) x traces x kv_heads x positions`` float32 (the standard 768-token run:
about 0.8 GB), so ``beaconkv fidelity --oracle`` is meant for the standard run's lengths.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from ...policies.observer import ObservedLayer
from ...models.decoder import CausalLM
from ...policies.base import EvictionPolicy
from ...policies.state import PolicyState
from .errors import FidelityError
from .lockstep import LockStep
from .study import Run, auto_n_recent


@dataclass(frozen=True)
class FutureAttention:
    """Attention of every later decode query to every position, from a FullKV pass.

    Attributes:
        suffix: ``(layers, steps + 1, batch, kv_heads, positions)``: ``suffix[l, s, b, h, p]`` is the
            attention (summed over the GQA group) that the decode queries of steps ``s, s+1, ...`` of
            sequence ``b`` give position ``p`` in layer ``l``, KV head ``h``; ``suffix[:, steps] == 0``.
        prompt_lengths: ``(batch,)`` prompt tokens of each sequence (step ``s`` decodes position
            ``prompt_length + s``).
    """

    suffix: Tensor
    prompt_lengths: Tensor

    @property
    def steps(self) -> int:
        """Decode steps recorded."""
        return self.suffix.shape[1] - 1


@torch.inference_mode()
def record_future_attention(model: CausalLM, prompts: Sequence[Sequence[int]], tokens: Tensor) -> FutureAttention:
    """Teacher-forces ``tokens`` through FullKV and accumulates each position's future attention.

    Args:
        model: The model.
        prompts: Prompt token ids per sequence.
        tokens: ``(batch, steps)`` the forced decode tokens.

    Returns:
        The suffix sums (see :class:`FutureAttention`).
    """
    steps = tokens.shape[1]
    lock = LockStep(model, [], prompts, steps)
    cfg = model.config
    n_positions = max(len(p) for p in prompts) + steps
    suffix = torch.zeros(cfg.num_hidden_layers, steps + 1, len(prompts), cfg.num_key_value_heads, n_positions)
    lock.prefill()
    for s in range(steps):
        out = lock.step(tokens[:, s])
        w = out.weights.sum(3).float().masked_fill(out.key_pos < 0, 0.0)  # (L, B, kv, C)
        suffix[:, s].scatter_add_(-1, out.key_pos.clamp(min=0).cpu(), w.cpu())
    for s in range(steps - 1, -1, -1):  # in place: suffix[s] += suffix[s + 1]
        suffix[:, s] += suffix[:, s + 1]
    return FutureAttention(suffix, torch.tensor([len(p) for p in prompts]))


@dataclass(eq=False)
class FutureAttentionOracle(EvictionPolicy):
    """Keeps the slots whose positions the reference's later queries attend most (hindsight; measurement only).

    Scores a slot of layer ``l``, sequence ``b``, KV head ``h`` at an eviction after position ``t`` by
    ``future.suffix[l, t - prompt_length[b] + 1, b, h, position]``: the attention all later decode
    queries give it under FullKV. Everything else — budget, ``B_min`` cadence, protected prefix,
    recent window — is the base class's, exactly as for the real policies.

    Args:
        budget: ``B_max``.
        future: The recorded future attention of the same prompts and forced tokens (required).

    Raises:
        PolicyConfigError: Bad base settings.
        FidelityError: No ``future`` given.
    """

    future: FutureAttention | None = field(default=None, repr=False)

    name: ClassVar[str] = "oracle"

    def validate(self) -> None:
        super().validate()
        if self.future is None:
            raise FidelityError("FutureAttentionOracle needs future=record_future_attention(model, prompts, tokens).")

    def init_state(self, state: PolicyState) -> None:
        suffix = self.future.suffix.to(state.cache.layers[0].positions().device)  # type: ignore[union-attr]
        state.layers = list(suffix.unbind(0))  # per layer: (steps + 1, batch, kv, positions)

    def score(self, layer: ObservedLayer, rows: Tensor, t: Tensor) -> Tensor:
        future: Tensor = layer.layer_state
        plen = self.future.prompt_lengths.to(t.device)[rows]  # type: ignore[union-attr]
        step = (t - plen + 1).clamp(0, future.shape[0] - 1)
        ahead = future[step, rows]  # (b, kv, positions)
        pos = layer.positions(rows)
        return torch.gather(ahead, -1, pos.clamp(0, ahead.shape[-1] - 1))


def oracle_runs(
    future: FutureAttention, budgets: Sequence[int], n_recent: int | None = None, n_prefix: int | None = None
) -> list[Run]:
    """One :class:`FutureAttentionOracle` run per budget, with the settings :func:`~.study.study_runs` gives the others.

    Args:
        future: The recorded future attention.
        budgets: Budgets.
        n_recent: Recent tokens kept; None = :func:`~.study.auto_n_recent` per budget.
        n_prefix: Protected prefix; None = the whole prompt.

    Returns:
        Runs labelled ``oracle``.
    """
    return [
        Run("oracle", FutureAttentionOracle(b, future, n_recent=auto_n_recent(b) if n_recent is None else n_recent,
                                            n_prefix=n_prefix))
        for b in budgets
    ]
