"""The length effect: does a compressed cache change how long a model writes before it stops?

A budget that drops what the model needs can make it lose its place and go round in circles, so it
writes *longer* (and repeats itself) — eating the memory the budget saved. ``beaconkv lengths`` lets
every policy and budget write freely to end of sequence from the same MATH-500 prompts, with the same
sampling seeds, and reports per run the output length (mean, median, share that reached the cap) and
the repeated-n-gram rate, against FullKV's.

.. code-block:: bash

    beaconkv lengths --num-problems 32 --max-new-tokens 1024 --budgets 64,128,256 --policies beacon,snapkv
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..arguments import (
    add_model_arguments,
    add_n_recent_argument,
    add_policy_arg_argument,
    add_threads_argument,
    int_list,
    model_path,
    policy_args_by_policy,
    positive_int,
    str_list,
)
from ..eval.datasets import load_benchmark
from ..eval.prompts import build_prompt
from ..generation import generate
from ..models.decoder import CausalLM
from ..models.loading import load_model
from ..policies.base import EvictionPolicy, FullKV
from ..policies.config import PolicyConfigError
from ..tokenizer import Tokenizer, load_tokenizer
from .fidelity.errors import FidelityError
from .fidelity.study import study_runs

#: ``--policies``' default: BeaconKV and the recency baselines of the paper's main table.
DEFAULT_POLICIES = ("beacon", "snapkv", "h2o", "streaming")
#: ``--budgets``' default: budgets a 1,024-token answer fills several times over.
DEFAULT_BUDGETS = (64, 128, 256)

__all__ = ["LengthRun", "add_lengths_arguments", "length_change_interval", "length_runs", "lengths_table",
           "plot_lengths", "read_length_runs", "repeated_ngram_rate", "run_lengths"]


def repeated_ngram_rate(tokens: Sequence[int], n: int = 4) -> float:
    """Share of the ``n``-grams of a sequence that already occurred earlier in it (``1 - distinct / total``).

    0 for text that never repeats a span of ``n`` tokens; near 1 for a loop. A sequence shorter than
    ``n`` has no n-gram and rate 0.

    Args:
        tokens: Token ids.
        n: Span length (default 4).

    Raises:
        ValueError: ``n < 1``.
    """
    if n < 1:
        raise ValueError(f"n={n} must be >= 1 (the span of tokens compared)")
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return 0.0 if not grams else 1.0 - len(set(grams)) / len(grams)


@dataclass
class LengthRun:
    """What one policy at one budget wrote, over every prompt.

    Attributes:
        policy: Registry name (``full`` for FullKV).
        budget: ``B_max`` (None for FullKV).
        lengths: New tokens per prompt (the stop token included).
        stopped: Per prompt, whether it ended on its own (False: it reached the cap).
        rep: Repeated-n-gram rate per prompt (:func:`repeated_ngram_rate`).
        evictions: Evictions per prompt.
        seconds: Wall time of the run.
    """

    policy: str
    budget: int | None
    lengths: list[int]
    stopped: list[bool]
    rep: list[float]
    evictions: list[int]
    seconds: float

    @property
    def mean_length(self) -> float:
        """Mean new tokens per prompt."""
        return statistics.fmean(self.lengths)

    @property
    def median_length(self) -> float:
        """Median new tokens per prompt."""
        return float(statistics.median(self.lengths))

    @property
    def capped(self) -> float:
        """Share of the prompts that reached the cap without stopping."""
        return 1.0 - statistics.fmean(self.stopped)

    @property
    def mean_rep(self) -> float:
        """Mean repeated-n-gram rate."""
        return statistics.fmean(self.rep)


def length_runs(
    model: CausalLM,
    tokenizer: Tokenizer,
    conversations: Sequence[list[dict[str, str]]],
    policies: Sequence[tuple[str, EvictionPolicy]],
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    seed: int,
    ngram: int = 4,
    progress: bool = False,
) -> list[LengthRun]:
    """Lets each policy write freely from every prompt to end of sequence (or ``max_new_tokens``).

    Every run decodes the whole batch with the same per-prompt sampling seeds (prompt ``i`` draws from
    seed ``seed + i``), so runs differ only by their cache.

    Args:
        model: The model.
        tokenizer: Its tokenizer (chat template, end-of-sequence ids).
        conversations: One chat per prompt.
        policies: ``(name, policy)`` per run (FullKV first, as the reference, by convention).
        max_new_tokens: The cap.
        temperature: Sampling temperature (0: greedy).
        top_p: Nucleus mass.
        seed: Base sampling seed.
        ngram: Span of the repeated-n-gram rate.
        progress: Print one line per run to stderr.

    Returns:
        One :class:`LengthRun` per policy, in order.
    """
    runs = []
    for name, policy in policies:
        t0 = time.perf_counter()
        out = generate(model, tokenizer, list(conversations), chat=True, max_new_tokens=max_new_tokens,
                       temperature=temperature, top_p=top_p, seed=seed, policy=policy)
        run = LengthRun(
            name, policy.budget, [len(t) for t in out.token_ids], [r == "stop" for r in out.finish_reasons],
            [repeated_ngram_rate(t, ngram) for t in out.token_ids], list(out.stats.evictions),
            time.perf_counter() - t0,
        )
        runs.append(run)
        if progress:
            print(f"{name} budget={policy.budget}: mean {run.mean_length:.0f} tokens, "
                  f"capped {run.capped:.0%}, rep-{ngram} {run.mean_rep:.3f} ({run.seconds:.0f}s)", file=sys.stderr)
    return runs


def length_change_interval(run: LengthRun, ref: LengthRun, resamples: int = 2000, seed: int = 0,
                           level: float = 0.95) -> tuple[float, float]:
    """Paired bootstrap interval of the change of mean length, ``mean(run) / mean(ref) - 1``.

    The prompts are resampled with replacement, the same draw for both runs (each prompt's two lengths stay
    paired), and the interval is the central ``level`` share of the resampled changes. It says how far a
    measured change could be from zero by the choice of prompts alone.

    Args:
        run: The compressed run.
        ref: The reference (FullKV) run over the same prompts.
        resamples: Bootstrap draws.
        seed: Seed of the draws (the interval is reproducible).
        level: Coverage, in ``(0, 1)``.

    Returns:
        ``(low, high)`` as fractions (``-0.1`` is 10% shorter).

    Raises:
        ValueError: Runs over different numbers of prompts, no prompt, or ``level`` outside ``(0, 1)``.
    """
    if len(run.lengths) != len(ref.lengths) or not ref.lengths:
        raise ValueError(f"the runs have {len(run.lengths)} and {len(ref.lengths)} prompts; a paired interval "
                         "needs the same prompts, at least one")
    if not 0 < level < 1:
        raise ValueError(f"level={level} must lie in (0, 1), e.g. 0.95")
    a = torch.tensor(run.lengths, dtype=torch.float64)
    b = torch.tensor(ref.lengths, dtype=torch.float64)
    draw = torch.randint(len(a), (resamples, len(a)), generator=torch.Generator().manual_seed(seed))
    change = (a[draw].sum(1) / b[draw].sum(1).clamp_min(1.0) - 1).sort().values
    tail = (1 - level) / 2
    return change[int(tail * (resamples - 1))].item(), change[int((1 - tail) * (resamples - 1))].item()


def lengths_table(runs: Sequence[LengthRun], ngram: int = 4) -> str:
    """A markdown table of the runs, with each run's change of mean length against the first (FullKV) and its
    paired 95% bootstrap interval (:func:`length_change_interval`)."""
    ref = runs[0]
    lines = [f"| policy | budget | mean length | vs FullKV | 95% interval | median | capped | rep-{ngram} | "
             "evictions (mean) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        change = "—" if r is ref else f"{(r.mean_length / ref.mean_length - 1) * 100:+.1f}%"
        interval = "—" if r is ref else "{:+.0f}% to {:+.0f}%".format(*(100 * x for x in length_change_interval(r, ref)))
        budget = "—" if r.budget is None else str(r.budget)
        lines.append(f"| {r.policy} | {budget} | {r.mean_length:.1f} | {change} | {interval} | {r.median_length:.0f} | "
                     f"{r.capped:.0%} | {r.mean_rep:.3f} | {statistics.fmean(r.evictions):.1f} |")
    return "\n".join(lines) + "\n"


def read_length_runs(path: str | Path) -> list[LengthRun]:
    """The runs of a ``lengths.csv`` that ``beaconkv lengths`` wrote, in its order (FullKV first), so its table
    can be made again (``lengths_table(read_length_runs(path))``); ``seconds`` is not in the file (0).

    Raises:
        ValueError: A file without the columns ``beaconkv lengths`` writes.
    """
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    rep = next((k for k in (rows[0] if rows else {}) if k.startswith("rep")), None)
    if not rows or rep is None or not {"policy", "budget", "length", "stopped", "evictions"} <= rows[0].keys():
        raise ValueError(f"{path} is not a lengths.csv of `beaconkv lengths` (columns policy, budget, problem, "
                         "length, stopped, rep<n>, evictions)")
    runs: dict[tuple[str, str], LengthRun] = {}
    for row in rows:
        key = (row["policy"], row["budget"])
        if key not in runs:
            runs[key] = LengthRun(row["policy"], int(row["budget"]) if row["budget"] else None, [], [], [], [], 0.0)
        run = runs[key]
        run.lengths.append(int(row["length"]))
        run.stopped.append(row["stopped"] == "1")
        run.rep.append(float(row[rep]))
        run.evictions.append(int(row["evictions"]))
    return list(runs.values())


def plot_lengths(runs: Sequence[LengthRun], path: str | Path, ngram: int = 4) -> Path:
    """Mean output length (with each run's paired 95% interval, :func:`length_change_interval`) and
    repeated-n-gram rate against the budget, one line per policy, FullKV dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ref = runs[0]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    names = list(dict.fromkeys(r.policy for r in runs[1:]))
    for name in names:
        mine = sorted((r for r in runs if r.policy == name), key=lambda r: r.budget or 0)
        budgets = [r.budget for r in mine]
        # the paired 95% interval of each run's change, around its mean: how much the prompts alone could move it
        bounds = [length_change_interval(r, ref) for r in mine]
        means = [r.mean_length for r in mine]
        spread = [[m - ref.mean_length * (1 + lo) for m, (lo, _) in zip(means, bounds)],
                  [ref.mean_length * (1 + hi) - m for m, (_, hi) in zip(means, bounds)]]
        axes[0].errorbar(budgets, means, yerr=spread, marker="o", capsize=4, label=f"{name} (95% interval)")
        axes[1].plot(budgets, [r.mean_rep for r in mine], marker="o", label=name)
    for ax, value, title in ((axes[0], ref.mean_length, "mean output length (tokens)"),
                             (axes[1], ref.mean_rep, f"repeated {ngram}-gram rate")):
        ax.axhline(value, color="black", linestyle="--", label="FullKV")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("budget (B_max)")
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------- CLI
def add_lengths_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the ``beaconkv lengths`` options to ``parser``.

    Args:
        parser: A parser (or subparser).

    Returns:
        The same parser.
    """
    parser.description = ("The length effect: each policy and budget writes freely from the same MATH-500 prompts "
                          "to end of sequence; output length and repetition against FullKV.")
    add_model_arguments(parser)
    add_threads_argument(parser)
    w = parser.add_argument_group("workload")
    w.add_argument("--num-problems", type=positive_int, default=32, help="the first N problems of MATH-500 (default 32)")
    w.add_argument("--max-new-tokens", type=positive_int, default=1024, help="the cap (default 1024)")
    w.add_argument("--temperature", type=float, default=0.6, help="sampling temperature (default 0.6, the paper's)")
    w.add_argument("--top-p", type=float, default=0.95, help="nucleus mass (default 0.95, the paper's)")
    w.add_argument("--seed", type=int, default=0, help="base sampling seed: prompt i draws from seed + i (default 0)")
    w.add_argument("--ngram", type=positive_int, default=4, help="span of the repeated-n-gram rate (default 4)")
    p = parser.add_argument_group("policies")
    p.add_argument("--policies", type=str_list, default=list(DEFAULT_POLICIES),
                   help=f"comma-separated registry names or classes of your own, each run at every budget; FullKV "
                        f"always runs first (default {','.join(DEFAULT_POLICIES)})")
    p.add_argument("--budgets", type=int_list, default=list(DEFAULT_BUDGETS),
                   help=f"comma-separated budgets (default {','.join(map(str, DEFAULT_BUDGETS))})")
    add_n_recent_argument(p)
    add_policy_arg_argument(p)
    o = parser.add_argument_group("output")
    o.add_argument("--out", type=Path, default=Path("results/lengths"), help="output directory (default results/lengths)")
    o.add_argument("--no-progress", action="store_true", help="no line per run on stderr")
    return parser


def run_lengths(args: argparse.Namespace) -> int:
    """Runs ``beaconkv lengths`` from parsed arguments; writes ``lengths.md``, ``lengths.csv``, ``lengths.png``.

    Returns:
        0 on success.

    Raises:
        FidelityError: Bad policy settings (checked before the model loads).
    """
    t0 = time.perf_counter()
    try:
        extra = policy_args_by_policy(args, args.policies)
    except PolicyConfigError as err:
        raise FidelityError(str(err)) from err
    runs = study_runs(args.policies, args.budgets, args.n_recent, None, None, extra=extra)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    path = model_path(args.model)
    model = load_model(path, dtype=args.dtype, device=args.device)
    tokenizer = load_tokenizer(path)
    problems = load_benchmark("math500", limit=args.num_problems)
    conversations = [build_prompt(p).messages for p in problems]
    results = length_runs(model, tokenizer, conversations, [("full", FullKV())] + [(r.name, r.policy) for r in runs],
                          max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                          seed=args.seed, ngram=args.ngram, progress=not args.no_progress)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = lengths_table(results, args.ngram)
    (out / "lengths.md").write_text(table)
    with open(out / "lengths.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["policy", "budget", "problem", "length", "stopped", f"rep{args.ngram}", "evictions"])
        for r in results:
            for i, (n, stopped, rep, e) in enumerate(zip(r.lengths, r.stopped, r.rep, r.evictions)):
                writer.writerow([r.policy, "" if r.budget is None else r.budget, problems[i].id, n, int(stopped),
                                 f"{rep:.4f}", e])
    plot_lengths(results, out / "lengths.png", args.ngram)
    print(table, end="")
    print(f"wrote lengths.md, lengths.csv, lengths.png in {out} ({time.perf_counter() - t0:.0f}s)", file=sys.stderr)
    return 0
