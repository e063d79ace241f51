"""``beaconkv bench --sections tp``: tensor parallelism against one process on the same cores.

The same decode (BeaconKV at the bench's budget, greedy, eager) runs four ways on this machine's cores:
one process with ``tp_ranks`` threads, one process with one thread (how much the threads bring), and
``tp_ranks`` ranks of one thread each (:class:`~beaconkv.distributed.launch.TensorParallelRun`, gloo)
with the embedding and LM head split by vocabulary rows, then replicated. Each row reports decode tokens
per second (compilation and prefill excluded, :attr:`~beaconkv.generation.GenerationStats.tokens_per_s`),
milliseconds per step, and what one rank holds: its KV cache (the fullest rank's, when the KV heads split
unevenly) and its weights. The tokens are checked equal to the single process's, so a row never times a
wrong run.

On a CPU the ranks share the memory bandwidth one process already uses, and each layer adds two
all-reduces, so tensor parallelism is expected to lose there; the section measures by how much, and what
it buys: the per-rank memory, which is what lets a model past one GPU run at all.
"""

from __future__ import annotations

import argparse
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...distributed.launch import TensorParallelRun
from ...distributed.plan import ShardPlan
from ...generation import generate
from ...models.config import ModelConfig
from ...models.loading import load_model
from ...policies.beacon import BeaconKV
from .machine import BenchError

__all__ = ["TPRow", "add_tp_arguments", "markdown_tp", "run_tp_section"]


@dataclass
class TPRow:
    """One way of running the decode.

    Attributes:
        setup: ``"1 rank x 2 threads"``, ``"1 rank x 1 thread"``, ``"2 ranks x 1 thread, vocab-parallel"``, ...
        ranks: Processes.
        threads: Threads per process.
        vocab_parallel: Whether the embedding and LM head were split (None for one process).
        batch: Sequences decoded together.
        new_tokens: Tokens generated per sequence.
        tokens_per_s: Decode tokens per second over the batch.
        ms_per_step: Milliseconds per decode step.
        kv_mib_per_rank: KV cache MiB of the fullest rank.
        weight_mib_per_rank: Parameter MiB of rank 0 (the fullest: the first ranks take the extra heads).
        same_tokens: Whether the tokens equal the single process's.
    """

    setup: str
    ranks: int
    threads: int
    vocab_parallel: bool | None
    batch: int
    new_tokens: int
    tokens_per_s: float
    ms_per_step: float
    kv_mib_per_rank: float
    weight_mib_per_rank: float
    same_tokens: bool


def add_tp_arguments(group: Any) -> None:
    """The options of the ``tp`` section."""
    group.add_argument("--tp-ranks", "--tensor-parallel-size", dest="tp_ranks", type=int, default=2,
                       help="ranks of the tp section's tensor-parallel runs (vLLM's name works too), one thread "
                            "each; the single process gets as many threads (default 2)")
    group.add_argument("--tp-batches", type=str, default="1,4", help="batch sizes (default 1,4)")
    group.add_argument("--tp-new-tokens", type=int, default=64, help="new tokens per sequence (default 64)")


def _weight_mib(model: torch.nn.Module) -> float:
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values()) / 2**20


def _fullest_kv_share(config: ModelConfig, ranks: int) -> float:
    """The fullest rank's share of the KV heads' bytes (its heads over rank 0's)."""
    plans = [ShardPlan(config, ranks, r) for r in range(ranks)]
    return max(len(p.kv_heads) for p in plans) / len(plans[0].kv_heads)


def run_tp_section(args: argparse.Namespace, path: Path, device: torch.device,
                   log: Callable[[str], None]) -> dict[str, Any]:
    """Runs the section (see the module docstring); returns ``{"workload": ..., "rows": [...]}``.

    Raises:
        BenchError: ``--tp-ranks`` below 2, or a device other than the CPU (the section compares ranks and
            threads on one CPU; on GPUs use ``torchrun`` and the guide's recipe).
    """
    if args.tp_ranks < 2:
        raise BenchError(f"--tp-ranks={args.tp_ranks} must be at least 2 (the single process is the baseline).")
    if device.type != "cpu":
        raise BenchError("--sections tp compares ranks with threads on one CPU; run it with --device cpu.")
    ranks, new, repeats = args.tp_ranks, args.tp_new_tokens, max(1, getattr(args, "repeats", 1))
    batches = [int(b) for b in str(args.tp_batches).split(",")]
    vocab = ModelConfig.from_file(path).vocab_size
    prompts = {b: [[1 + (17 * i + j) % min(500, vocab - 1) for j in range(48 + 8 * i)] for i in range(b)]
               for b in batches}
    policy = BeaconKV(args.budget)
    settings = dict(max_new_tokens=new, policy=policy, eos_token_ids=[])

    def best(run: Callable[..., Any], b: int) -> Any:
        """The fastest of ``repeats`` runs after a short warm-up."""
        run(None, prompts[b], **{**settings, "max_new_tokens": 4})
        return max((run(None, prompts[b], **settings) for _ in range(repeats)), key=lambda o: o.stats.tokens_per_s)

    rows: list[TPRow] = []
    load = list(os.getloadavg()) if hasattr(os, "getloadavg") else None  # other work on the cores skews every row
    threads_before = torch.get_num_threads()
    try:
        whole = load_model(path)
        reference: dict[int, list[list[int]]] = {}
        for threads in (ranks, 1):
            torch.set_num_threads(threads)
            for b in batches:
                out = best(lambda *a, **k: generate(whole, *a, **k), b)
                reference[b] = out.token_ids
                s = out.stats
                label = f"1 rank x {threads} thread{'s' if threads > 1 else ''}"
                rows.append(TPRow(label, 1, threads, None, b, new, s.tokens_per_s, 1e3 * b / s.tokens_per_s,
                                  s.cache_bytes / 2**20, _weight_mib(whole), True))
                log(f"  {label}, batch {b}: {s.tokens_per_s:.1f} tokens/s")
        share = _fullest_kv_share(whole.config, ranks)
        del whole
        for vocab_parallel in (True, False):
            label = f"{ranks} ranks x 1 thread, " + ("vocab-parallel" if vocab_parallel else "vocab replicated")
            log(f"  starting {label}…")
            with TensorParallelRun(path, ranks, vocab_parallel=vocab_parallel, threads=1) as run:
                for b in batches:
                    out = best(functools.partial(generate, run.model), b)
                    s = out.stats
                    rows.append(TPRow(label, ranks, 1, vocab_parallel, b, new, s.tokens_per_s, 1e3 * b / s.tokens_per_s,
                                      share * s.cache_bytes / 2**20, _weight_mib(run.model),
                                      out.token_ids == reference[b]))
                    log(f"  {label}, batch {b}: {s.tokens_per_s:.1f} tokens/s")
    finally:
        torch.set_num_threads(threads_before)
    workload = {"policy": repr(policy), "prompt_tokens": [len(p) for p in prompts[max(batches)]], "new_tokens": new,
                "ranks": ranks, "repeats": repeats, "load_average": load}
    return {"workload": workload, "rows": [vars(r) for r in rows]}


def markdown_tp(section: dict[str, Any]) -> str:
    """The section's table (decode speed and per-rank memory of each setup and batch)."""
    w = section["workload"]
    lines = [f"## Tensor parallelism on the CPU ({w['ranks']} ranks x 1 thread vs 1 rank x {w['ranks']} threads)",
             "", f"{w['policy']}, {w['new_tokens']} new tokens per sequence, eager, greedy, the best of "
             f"{w.get('repeats', 1)} run(s)" + (f"; load average {w['load_average'][0]:.1f} when it started (other "
             "processes on the cores slow the threaded rows most)" if w.get("load_average") else "") + ".", "",
             "| setup | batch | tokens/s | ms/step | KV MiB per rank | weights MiB per rank | same tokens |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in section["rows"]:
        same = "yes" if r["same_tokens"] else "NO"
        lines.append(f"| {r['setup']} | {r['batch']} | {r['tokens_per_s']:.1f} | {r['ms_per_step']:.1f} | "
                     f"{r['kv_mib_per_rank']:.2f} | {r['weight_mib_per_rank']:.1f} | {same} |")
    return "\n".join(lines)
