"""Timing decode steps through the generation's public per-step hook.

:func:`beaconkv.generate` calls ``on_step(step, session)`` after every decode step, once the policy's
between-step work (evictions included) is done. :class:`StepRecorder` is such a hook: it stamps the
end of every step (synchronising CUDA first, so the stamps are device time) and reads how much of it
the policy took from the session's own counters — no method of the policy is replaced.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ...execution import CompileConfig
from ...generation import GenerationOutput, generate
from ...models.decoder import CausalLM
from ...policies.base import EvictionPolicy
from ...session import Session
from .machine import sync


class StepRecorder:
    """Per-step durations of one generation: pass it as ``generate(..., on_step=recorder)``.

    Step ``i`` spans from the end of step ``i - 1`` to the end of step ``i``: the decode step, the
    host's bookkeeping and the policy's work (evictions included).

    Args:
        device: The model's device (CUDA is synchronised at every stamp).
        on_step: Called with the step index at each stamp, before the clock stops (its own time
            counts in that step), e.g. to start measuring memory at some step.

    Attributes:
        ends: Host time at the end of each step.
        policy_s: Seconds of each step spent in the policy.
        eviction_s: Seconds of each step spent evicting.
    """

    def __init__(self, device: torch.device | str, on_step: Callable[[int], None] | None = None) -> None:
        self.device, self.on_step = torch.device(device), on_step
        self.ends: list[float] = []
        self.policy_s: list[float] = []
        self.eviction_s: list[float] = []
        self._policy = self._evict = 0.0

    def __call__(self, step: int, session: Session) -> None:
        sync(self.device)
        if self.on_step is not None:
            self.on_step(len(self.ends))
        self.ends.append(time.perf_counter())
        policy, evict = session.policy_s, session.state.stats.eviction_seconds
        self.policy_s.append(policy - self._policy)
        self.eviction_s.append(evict - self._evict)
        self._policy, self._evict = policy, evict

    def step_seconds(self) -> list[float]:
        """Duration of steps ``1 ..`` (step 0 has no predecessor)."""
        return [b - a for a, b in zip(self.ends, self.ends[1:])]

    def window(self, first: int, last: int | None = None) -> tuple[list[float], list[float], list[float]]:
        """Step durations, eviction seconds and policy seconds of steps ``first .. last`` (``first >= 1``)."""
        end = len(self.ends) if last is None else last + 1
        first = max(first, 1)
        return (self.step_seconds()[first - 1 : end - 1], self.eviction_s[first:end], self.policy_s[first:end])


def generate_ids(model: CausalLM, prompts: list[list[int]], new_tokens: int, policy: EvictionPolicy | None = None,
                 compile_config: CompileConfig | None = None, **kwargs) -> GenerationOutput:
    """Exactly ``new_tokens`` tokens per prompt (end-of-sequence ignored), from token ids."""
    return generate(model, None, prompts, max_new_tokens=new_tokens, eos_token_ids=[], policy=policy,
                    compile=compile_config or False, **kwargs)


def decode_ms_per_step(out: GenerationOutput) -> float:
    """Mean decode ms/step of a generation, from its stats (prefill excluded)."""
    s = out.stats
    return 1e3 * (s.wall_time_s - s.prefill_s) / max(s.decode_steps, 1)
