"""Section 4 of ``beaconkv bench``: KV bytes, peak memory, steady-state step time and eviction share per policy."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ...execution import CompileConfig
from ...models.decoder import CausalLM
from ...policies.registry import make_policy
from .machine import PeakMemory, random_prompts
from .timing import StepRecorder, generate_ids

#: The policies the section compares by default (FullKV always runs).
DEFAULT_POLICIES = ("beacon", "initial_recent", "snapkv", "rpc", "rkv", "h2o", "streaming")


@dataclass
class PolicyRow:
    """Memory and steady-state step time of one policy at the bench budget.

    Attributes:
        policy: Registry name (``full`` for FullKV).
        budget: The budget (None for FullKV).
        batch: Sequences decoded together.
        cache_capacity: Slots per (sequence, KV head).
        kv_cache_bytes: Bytes of keys and values allocated.
        peak_bytes: Peak process RSS (CPU) or peak allocated (CUDA) during the generation.
        ms_per_step: Steady-state ms/step (steps after the first eviction; all steps for FullKV).
        tokens_per_s: ``batch * 1000 / ms_per_step``.
        eviction_share: Share of steady-state decode time spent in the eviction step.
        policy_share: Share spent in the policy's between-step work (evictions included).
        evictions: Evictions per sequence.
        compiled_evictions: Evictions that ran as the compiled graph.
        policy_ms: Policy time per step (eviction step + maintenance), ms.
        decode_ms: ``ms_per_step - policy_ms``: the decode step and the loop's own bookkeeping.
    """

    policy: str
    budget: int | None
    batch: int
    cache_capacity: int
    kv_cache_bytes: int
    peak_bytes: int
    ms_per_step: float
    tokens_per_s: float
    eviction_share: float
    policy_share: float
    evictions: int
    compiled_evictions: int
    policy_ms: float = 0.0
    decode_ms: float = 0.0


def measure_policies(
    model: CausalLM, names: Sequence[str], budget: int, batch: int, prompt_tokens: int, cycles: int,
    compile_config: CompileConfig | None, repeats: int, log: Callable[[str], None] = print,
    settings: dict[str, dict[str, Any]] | None = None,
) -> list[PolicyRow]:
    """Section 4: KV bytes, peak memory, steady-state ms/step and eviction share per policy.

    Each policy decodes from a fully protected prompt: the budget fills, the first eviction happens
    (and compiles), and then ``cycles`` whole eviction cycles (``budget - B_min`` steps each) are
    timed — FullKV times the same steps. Peak memory: CUDA peak allocated over the whole run; on CPU
    the peak resident memory over the timed steps (the in-process compiler's memory would swamp the
    rest). The best of ``repeats`` runs counts. ``settings`` maps a policy to its arguments beyond
    the budget (``n_recent``, ``--policy-arg``; None or absent: its defaults). Each policy is
    announced through ``log`` before it runs.
    """
    device = model.device
    prompts = random_prompts(batch, prompt_tokens, model.config.vocab_size)
    gap = budget - math.floor(7 / 8 * budget)
    first = budget - 1 + gap  # the step of the second eviction: timing starts after the first one
    new_tokens = first + cycles * gap + 1
    cpu_window = device.type != "cuda"
    rows = []
    for name in ["full", *[n for n in names if n != "full"]]:
        log(f"  {name}: {repeats} run(s) of {new_tokens} steps"
            + (" (the first run compiles)" if compile_config is not None else "") + "…")
        best: PolicyRow | None = None
        for _ in range(repeats):
            kwargs = (settings or {}).get(name, {})
            policy = make_policy(name) if name == "full" else make_policy(name, budget=budget, **kwargs)
            mem = PeakMemory(device)
            rec = StepRecorder(device, (lambda j, m=mem: m.__enter__() if cpu_window and j == first - 1 else None))
            with contextlib.ExitStack() as stack:
                if not cpu_window:
                    stack.enter_context(mem)
                out = generate_ids(model, prompts, new_tokens, policy, compile_config, on_step=rec)
            if cpu_window:
                mem.__exit__()
            durations, evict_s, policy_s = rec.window(first)
            total = sum(durations)
            s = out.stats
            ms, pol_ms = 1e3 * total / len(durations), 1e3 * sum(policy_s) / len(durations)
            row = PolicyRow(
                name, None if name == "full" else budget, batch, s.cache_capacity, s.cache_bytes, mem.peak, ms,
                batch * len(durations) / total, sum(evict_s) / total, sum(policy_s) / total, s.evictions[0],
                s.compiled_evictions, pol_ms, ms - pol_ms,
            )
            if best is None or row.ms_per_step < best.ms_per_step:
                best = row
        assert best is not None
        log(f"  {name:15s} capacity {best.cache_capacity}, KV {best.kv_cache_bytes / 2**20:.1f} MiB, peak "
            f"{best.peak_bytes / 2**20:.0f} MiB, {best.ms_per_step:.1f} ms/step, eviction {100 * best.eviction_share:.2f}%"
            f", policy {100 * best.policy_share:.2f}% ({best.evictions} evictions, {best.compiled_evictions} compiled)")
        rows.append(best)
    return rows
