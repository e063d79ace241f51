"""The ``engine`` section of ``beaconkv bench``: continuous batching against static batches, and BeaconKV
against FullKV under one memory limit.

The workload: ``--engine-requests`` reasoning prompts (MATH-500 problems in the chat template) whose
output lengths follow the shared R1 traces' length distribution, scaled to the CPU (the traces run
2,939 to 32,768 tokens; scaled by ``max_new / 32768`` and clipped to ``[min_new, max_new]``), every
request decoding exactly its length (end-of-sequence ignored). One KV-memory limit for all: each
policy gets as many slots as its per-slot cache fits in it (FullKV needs ``prompt + max_new`` slots
per request, BeaconKV ``prompt + budget``).

Measured per row: generated tokens per second over the whole workload (wall time from the first
submission to the last token), mean and p90 time to first token (every request is submitted at
once), and slot utilisation (busy slot-steps / (steps x slots)):

* **engine** — :class:`~beaconkv.engine.Engine`, a finished request's slot taken at the next step;
* **static** — the same engine and kernels, but a batch is admitted only when the previous one has
  completely finished: a finished sequence's slot idles until the batch's longest one ends;
* **transformers** — ``transformers``' ``generate`` on padded static batches of the same size.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ...engine import Completion, Engine, Request
from ...execution import CompileConfig
from ...kernels.bf16w import bf16w_available
from ...kernels.choice import KERNEL_LABELS, KERNELS
from ...models.decoder import CausalLM
from ...models.loading import load_model
from ...models.random_weights import RANDOM_SHAPES, random_model
from ...paths import benchmark_file, traces_path
from ...policies.registry import make_policy
from ...tokenizer import Tokenizer, load_tokenizer
from ..fidelity.study import auto_n_recent
from .machine import DTYPES, BenchError, kv_bytes_per_token
from .throughput import load_hf_model

#: Output lengths (tokens) of the shared R1-Distill-Qwen-7B traces on AIME24 (data/traces/SOURCE.md).
TRACE_LENGTHS = (3792, 8970, 25105, 11682, 3826, 7030, 32768, 4745, 3803, 2939)


def trace_lengths() -> list[int]:
    """The traces' ``output_tokens`` read from the project's data (the documented values if absent)."""
    folder = traces_path()
    lengths = []
    for f in sorted(folder.glob("*.jsonl")) if folder.is_dir() else []:
        for line in f.read_text(encoding="utf-8").splitlines():
            if line.strip():
                n = json.loads(line).get("output_tokens")
                if isinstance(n, int) and n > 0:
                    lengths.append(n)
    return lengths or list(TRACE_LENGTHS)


def workload_lengths(n: int, min_new: int, max_new: int, seed: int = 0) -> list[int]:
    """``n`` output lengths drawn from the traces' distribution, scaled to ``max_new`` and clipped.

    Each draw picks a trace length, multiplies it by ``max_new / max(trace lengths)`` and a jitter
    in ``[0.8, 1.2]``, and clips to ``[min_new, max_new]``.
    """
    g = torch.Generator().manual_seed(seed)
    base = trace_lengths()
    scale = max_new / max(base)
    picks = torch.randint(len(base), (n,), generator=g).tolist()
    jitter = (0.8 + 0.4 * torch.rand(n, generator=g)).tolist()
    return [int(min(max(round(base[i] * scale * j), min_new), max_new)) for i, j in zip(picks, jitter)]


def workload_prompts(tokenizer: Tokenizer, n: int, max_tokens: int = 128) -> list[list[int]]:
    """The first ``n`` MATH-500 problems (project data) whose chat-template prompt fits ``max_tokens``.

    A slot holds the longest prompt it may get, so one long prompt would size every slot; the cap
    keeps the slots the size of a typical prompt (the median MATH-500 prompt is ~80 tokens here).
    """
    path = benchmark_file("math500")
    if not path.is_file():
        raise BenchError(f"{path} is missing: the engine section reads MATH-500 problems from the project's data/.")
    prompts = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip() and len(prompts) < n:
            ids = tokenizer.encode_prompt(tokenizer.chat_prompt(json.loads(line)["problem"]))
            if len(ids) <= max_tokens:
                prompts.append(ids)
    if len(prompts) < n:
        raise BenchError(f"only {len(prompts)} MATH-500 prompts fit {max_tokens} tokens; raise --engine-prompt-tokens.")
    return prompts


def random_workload_prompts(n: int, max_tokens: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of random token ids, of lengths spread over ``max_tokens // 2 .. max_tokens`` — for a
    random-weight model without a tokenizer (a GPU run: speed depends on the lengths, not on the ids)."""
    g = torch.Generator().manual_seed(seed)
    low = max(1, max_tokens // 2)
    lengths = torch.randint(low, max_tokens + 1, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for length in lengths]


@dataclass
class EngineRow:
    """One scheduling mode of one policy on the workload.

    Attributes:
        mode: ``engine``, ``static`` or ``transformers``.
        policy: Registry name.
        budget: The policy's budget (None for FullKV).
        slots: Sequences decoded together (what the memory limit fits).
        kv_bytes: KV-cache bytes of the pool.
        requests: Requests served.
        new_tokens: Tokens generated.
        wall_s: Seconds from the first submission to the last token.
        tokens_per_s: ``new_tokens / wall_s``.
        ttft_mean_s: Mean time to first token.
        ttft_p90_s: 90th percentile of the time to first token.
        utilisation: Busy slot-steps over all slot-steps (NaN for transformers).
        evictions: Evictions over all requests.
        kernels: The matmul kernels the engine chose for its pool (``"model"``/``"packed"``/``"bf16w"``).
        warmup_s: Seconds of the untimed warm-up (compiles included; see :func:`warmup_requests`).
        prefill_s: Seconds of the timed run spent admitting (prefilling) requests.
        policy_s: Seconds of the timed run spent in the policy between steps (evictions included).
    """

    mode: str
    policy: str
    budget: int | None
    slots: int
    kv_bytes: int
    requests: int
    new_tokens: int
    wall_s: float
    tokens_per_s: float
    ttft_mean_s: float
    ttft_p90_s: float
    utilisation: float
    evictions: int
    kernels: str = "model"
    warmup_s: float = 0.0
    prefill_s: float = 0.0
    policy_s: float = 0.0


def _p90(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]


def slots_for(memory_limit: float, capacity: int, per_token: int, most: int) -> int:
    """Slots of ``capacity`` tokens (``per_token`` bytes each) that fit ``memory_limit`` bytes (1 .. ``most``)."""
    return max(1, min(most, int(memory_limit // (capacity * per_token))))


def policy_settings(budget: int | None) -> dict[str, int]:
    """BeaconKV's settings at ``budget``: ``n_recent`` (and ``n_beacon``) scaled down below budget 128
    (:func:`~beaconkv.measure.fidelity.auto_n_recent`), as in the fidelity study. ``{}`` for FullKV."""
    if budget is None:
        return {}
    n = auto_n_recent(budget)
    return {"budget": budget, "n_recent": n, "n_beacon": n}


def warmup_requests(prompts: list[list[int]], slots: int, budget: int | None, most: int) -> list[Request]:
    """An untimed warm-up that meets every shape the timed run will: a full pool, then staggered
    finishes, so that admissions of several sizes and (for an evicting policy) evictions of different
    rows at different steps — each a new shape for the compiled eviction — happen before the clock.
    """
    first = budget + 8 if budget is not None else 8
    lengths = [first + 3 * i for i in range(slots)] + [2 * first] * 2  # staggered ends, then 2 admitted mid-flight
    return [Request(prompts[i % len(prompts)], min(n, most), eos_token_ids=[]) for i, n in enumerate(lengths)]


def raise_failed(completions: Sequence[Completion]) -> Sequence[Completion]:
    """Returns ``completions``, or re-raises the first failed request's error: a benchmark whose requests failed
    has no figures to report (the engine itself only marks them ``finish_reason="error"`` and goes on)."""
    for c in completions:
        if c.finish_reason == "error":
            raise RuntimeError(f"a benchmark request failed: {c.error}") from c.exception
    return completions


def run_engine_mode(model: CausalLM, tokenizer: Tokenizer | None, policy_name: str, budget: int | None,
                    prompts: list[list[int]], lengths: list[int], slots: int, static: bool,
                    compile_config: CompileConfig | None, kv_storage: str = "dense", kernels: str = "auto") -> EngineRow:
    """The workload through one engine; ``static`` admits a batch only when the previous one finished.

    ``kernels`` is the engine's matmul choice (see :func:`~beaconkv.kernels.choice.choose_kernels`).
    """
    policy = make_policy(policy_name, **policy_settings(budget))
    engine = Engine(model, tokenizer, policy=policy, max_batch=slots, prompt_capacity=max(map(len, prompts)),
                    max_new_tokens=max(lengths), compile=compile_config or False, kv_storage=kv_storage,
                    kernels=kernels)
    requests = [Request(p, n, eos_token_ids=[]) for p, n in zip(prompts, lengths)]
    warm0 = time.perf_counter()
    raise_failed(engine.run(warmup_requests(prompts, slots, budget, max(lengths))))
    warmup = time.perf_counter() - warm0
    engine.stats = type(engine.stats)()
    engine.session.policy_s = 0.0
    t0 = time.perf_counter()
    done: list[Completion] = []
    if static:
        for i in range(0, len(requests), slots):
            done += raise_failed(engine.run(requests[i : i + slots]))
    else:
        done = list(raise_failed(engine.run(requests)))
    wall = time.perf_counter() - t0
    ttft = [c.time_to_first_token_s for c in done]
    if static:  # a later batch's requests were submitted when their batch started: count the wait before it
        starts, offset = [], 0.0
        for i in range(0, len(done), slots):
            batch = done[i : i + slots]
            starts += [offset] * len(batch)
            offset += max(c.wall_s for c in batch)
        ttft = [s + c.time_to_first_token_s for s, c in zip(starts, done)]
    tokens = sum(len(c.token_ids) for c in done)
    s = engine.stats
    return EngineRow("static" if static else "engine", policy_name, budget, slots, engine.cache_bytes, len(done),
                     tokens, wall, tokens / wall, statistics.fmean(ttft), _p90(ttft),
                     s.busy_slot_steps / max(s.steps * slots, 1), sum(c.evictions for c in done),
                     engine.prepared.kernels, warmup, s.prefill_s, engine.session.policy_s)


def run_transformers_mode(hf_model: Any, prompts: list[list[int]], lengths: list[int], slots: int,
                          kv_bytes: int) -> EngineRow:
    """transformers' ``generate`` on left-padded static batches of ``slots`` requests (greedy, no early stop)."""
    import transformers  # the optional reference implementation, imported only for this mode

    device = hf_model.device
    t0 = time.perf_counter()
    ttft, tokens = [], 0
    offset = 0.0
    for i in range(0, len(prompts), slots):
        batch, want = prompts[i : i + slots], lengths[i : i + slots]
        width = max(map(len, batch))
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for b, p in enumerate(batch):  # left padding, as decoder-only generation needs
            ids[b, width - len(p):], mask[b, width - len(p):] = torch.tensor(p), 1
        first: list[float] = []

        def stamp(input_ids: torch.Tensor, scores: torch.Tensor, _first: list[float] = first) -> torch.Tensor:
            if not _first:
                _first.append(time.perf_counter())
            return scores

        start = time.perf_counter()
        with torch.inference_mode():
            hf_model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=max(want),
                              min_new_tokens=max(want), do_sample=False, pad_token_id=0,
                              logits_processor=transformers.LogitsProcessorList([stamp]))
        ttft += [offset + (first[0] - start)] * len(batch)
        offset += time.perf_counter() - start
        tokens += sum(want)  # what the requests asked for; the padding steps are waste
    wall = time.perf_counter() - t0
    return EngineRow("transformers", "full", None, slots, kv_bytes, len(prompts), tokens, wall, tokens / wall,
                     statistics.fmean(ttft), _p90(ttft), float("nan"), 0)


def measure_engine(
    model: CausalLM, tokenizer: Tokenizer | None, requests: int, min_new: int, max_new: int, memory_limit: float,
    budget: int, max_slots: int, compile_config: CompileConfig | None, hf_model: Any = None,
    log: Callable[[str], None] = print, prompt_tokens: int = 128, kernels: str = "auto",
) -> tuple[list[EngineRow], dict[str, Any]]:
    """The engine section: FullKV and BeaconKV, engine and static, and transformers, under one memory limit.

    Args:
        model: The model (its dtype sizes the caches).
        tokenizer: Its tokenizer: the prompts are MATH-500 problems in its chat template (None: random token ids,
            :func:`random_workload_prompts`, for a random-weight model).
        requests: Requests in the workload.
        min_new: Fewest new tokens a request asks for.
        max_new: Most new tokens a request asks for.
        memory_limit: KV-cache bytes every configuration gets.
        budget: BeaconKV's budget.
        max_slots: Most slots any pool gets.
        compile_config: Compile the engines' steps (None: eager).
        hf_model: The transformers model for the ``transformers`` row (None: skipped).
        log: Progress lines.
        prompt_tokens: Longest prompt taken (see :func:`workload_prompts`).
        kernels: The engines' matmul kernels (``"auto"``, ``"model"``, ``"packed"``, ``"bf16w"``).

    Returns:
        The rows and the workload's description (lengths, prompt lengths, slots per policy).
    """
    lengths = workload_lengths(requests, min_new, max_new)
    prompts = (workload_prompts(tokenizer, requests, prompt_tokens) if tokenizer is not None
               else random_workload_prompts(requests, prompt_tokens, model.config.vocab_size))
    per_token = kv_bytes_per_token(model.config, model.dtype)
    prompt_cap = max(map(len, prompts))
    slots = {"full": slots_for(memory_limit, prompt_cap + max_new, per_token, max_slots),
             "beacon": slots_for(memory_limit, prompt_cap + budget, per_token, max_slots)}
    log(f"  workload: {requests} requests, new tokens {min(lengths)}..{max(lengths)} (mean "
        f"{statistics.fmean(lengths):.0f}), prompts {min(map(len, prompts))}..{prompt_cap} tokens; "
        f"{memory_limit / 2**20:.0f} MiB of KV fits FullKV x{slots['full']}, BeaconKV({budget}) x{slots['beacon']}")
    rows = []
    for name, b in (("full", None), ("beacon", budget)):
        for static in (False, True):
            row = run_engine_mode(model, tokenizer, name, b, prompts, lengths, slots[name], static, compile_config,
                                  kernels=kernels)
            log(f"  {row.mode:7s} {name:6s} x{row.slots}: {row.tokens_per_s:.1f} tok/s, ttft {row.ttft_mean_s:.1f} s, "
                f"utilisation {row.utilisation:.0%}, {row.wall_s:.0f} s")
            rows.append(row)
    if hf_model is not None:
        row = run_transformers_mode(hf_model, prompts, lengths, slots["full"], rows[0].kv_bytes)
        log(f"  transformers full x{row.slots}: {row.tokens_per_s:.1f} tok/s, ttft {row.ttft_mean_s:.1f} s")
        rows.append(row)
    workload = {"requests": requests, "lengths": lengths, "prompt_tokens": [len(p) for p in prompts],
                "memory_limit_bytes": memory_limit, "slots": slots, "budget": budget}
    return rows, workload


def engine_targets(rows: Sequence[EngineRow]) -> dict[str, float]:
    """The section's ratios: engine / static (FullKV and BeaconKV) and BeaconKV / FullKV (engine)."""
    get = {(r.mode, r.policy): r.tokens_per_s for r in rows}
    out = {}
    for name in ("full", "beacon"):
        if ("engine", name) in get and ("static", name) in get:
            out[f"engine / static ({name})"] = get[("engine", name)] / get[("static", name)]
    if ("engine", "beacon") in get and ("engine", "full") in get:
        out["BeaconKV / FullKV (engine, equal memory)"] = get[("engine", "beacon")] / get[("engine", "full")]
    return out


def markdown_engine(rows: Sequence[EngineRow], workload: dict[str, Any]) -> str:
    """The section's markdown table."""
    lines = [
        f"**Engine** ({workload['requests']} requests, {sum(workload['lengths'])} new tokens, KV limit "
        f"{workload['memory_limit_bytes'] / 2**20:.0f} MiB):", "",
        "| mode | policy | slots | kernels | KV MiB | tokens/s | TTFT mean s | TTFT p90 s | slot utilisation | evictions |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        util = "—" if r.utilisation != r.utilisation else f"{100 * r.utilisation:.0f}%"
        label = r.policy if r.budget is None else f"{r.policy} ({r.budget})"
        kernels = KERNEL_LABELS.get(r.kernels, r.kernels)
        lines.append(f"| {r.mode} | {label} | {r.slots} | {kernels} | {r.kv_bytes / 2**20:.1f} | {r.tokens_per_s:.1f} | "
                     f"{r.ttft_mean_s:.1f} | {r.ttft_p90_s:.1f} | {util} | {r.evictions} |")
    return "\n".join(lines)



def add_engine_arguments(group: argparse._ArgumentGroup) -> None:
    """The ``--engine-*`` options of ``beaconkv bench``."""
    group.add_argument("--engine-requests", type=int, default=64, help="requests in the workload (default 64)")
    group.add_argument("--engine-min-new", type=int, default=32, help="fewest new tokens of a request (default 32)")
    group.add_argument("--engine-max-new", type=int, default=512,
                       help="most new tokens of a request; the traces' lengths are scaled to it (default 512)")
    group.add_argument("--engine-prompt-tokens", type=int, default=128,
                       help="longest MATH-500 prompt taken, which sizes every slot (default 128)")
    group.add_argument("--engine-budget", type=int, default=64, help="BeaconKV's budget (default 64)")
    group.add_argument("--engine-full-slots", type=int, default=4,
                       help="the KV-memory limit, as the FullKV slots it fits (default 4)")
    group.add_argument("--engine-max-slots", type=int, default=16, help="most slots of any pool (default 16)")
    group.add_argument("--engine-model", default="checkpoint", choices=("checkpoint", *RANDOM_SHAPES),
                       help="checkpoint: --model (default); qwen3-4b: a random-weight Qwen3-4B-shaped model (a GPU "
                            "run: speed does not depend on the weights; prompts tokenised with --model's tokenizer, "
                            "no transformers row); qwen3-tiny: a tiny random Qwen3 shape (checks the section on a "
                            "CPU in seconds)")
    group.add_argument("--engine-dtype", default=None,
                       help="model dtype of the section (default: bf16 on CUDA, and on a CPU where the bf16-weight "
                            "kernel builds — the pools then run bf16w; fp32 on other CPUs, where a bf16 prefill "
                            "without native bf16 takes seconds per prompt). transformers' row runs fp32 on a CPU")
    group.add_argument("--engine-kernels", default="auto", choices=KERNELS,
                       help="matmul kernels of every pool (default auto: see choose_kernels); bf16w runs a bf16 "
                            "model's weights with fp32 arithmetic, as auto does on a CPU without native bf16")


def run_engine_section(args: argparse.Namespace, path: Path, device: torch.device,
                       compile_config: CompileConfig | None, log: Callable[[str], None]) -> dict[str, Any]:
    """The section as ``beaconkv bench --sections engine`` runs it: rows, workload and ratios (JSON-ready)."""
    dtype = args.engine_dtype or ("bf16" if device.type == "cuda" or bf16w_available() else "fp32")
    tokenizer = load_tokenizer(path)
    if args.engine_model in RANDOM_SHAPES:
        model = random_model(RANDOM_SHAPES[args.engine_model](), DTYPES[dtype], device)
    else:
        model = load_model(path, dtype=DTYPES[dtype], device=device)
    per_token = kv_bytes_per_token(model.config, model.dtype)
    limit = args.engine_full_slots * (args.engine_prompt_tokens + args.engine_max_new) * per_token
    hf_model = None
    if not args.no_transformers and args.engine_model == "checkpoint":
        # transformers' own bf16 kernels are emulated on a CPU without native bf16: give it fp32 there
        hf_dtype = model.dtype if device.type == "cuda" else torch.float32
        hf_model = load_hf_model(path, hf_dtype, device)
    rows, workload = measure_engine(model, tokenizer, args.engine_requests, args.engine_min_new, args.engine_max_new,
                                    limit, args.engine_budget, args.engine_max_slots, compile_config, hf_model, log,
                                    prompt_tokens=args.engine_prompt_tokens, kernels=args.engine_kernels)
    return {"rows": [asdict(r) for r in rows], "workload": workload, "ratios": engine_targets(rows)}


def check_engine_arguments(args: argparse.Namespace) -> None:
    """Fails on impossible ``--engine-*`` settings before anything loads.

    Raises:
        BenchError: A count below 1, ``--engine-min-new`` above ``--engine-max-new``, or an unknown dtype.
    """
    for name in ("requests", "min_new", "max_new", "prompt_tokens", "budget", "full_slots", "max_slots"):
        if getattr(args, f"engine_{name}") < 1:
            raise BenchError(f"--engine-{name.replace('_', '-')}={getattr(args, f'engine_{name}')} must be >= 1.")
    if args.engine_min_new > args.engine_max_new:
        raise BenchError(f"--engine-min-new={args.engine_min_new} exceeds --engine-max-new={args.engine_max_new}.")
    make_policy("beacon", **policy_settings(args.engine_budget))  # a bad budget fails before anything loads
    if args.engine_dtype is not None and args.engine_dtype not in DTYPES:
        raise BenchError(f"--engine-dtype {args.engine_dtype} unknown; choose from {','.join(DTYPES)}.")
