"""Reports of the fidelity study: CSV, markdown table, PNG plots."""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from .study import FidelityRow

POLICY_ORDER = ("beacon", "initial_recent", "snapkv", "rpc", "rkv", "h2o", "streaming")
"""Display order of the built-in policies (others follow alphabetically)."""
METRICS = {
    "kl": "KL(full ‖ policy), nats/token",
    "top1": "top-1 agreement with FullKV",
    "recall_global": "attention recall, global queries",
    "recall_local": "attention recall, local queries",
}
"""Metric column -> human label, for tables and plots."""


def _sort_key(policy: str) -> tuple[int, str]:
    return (POLICY_ORDER.index(policy) if policy in POLICY_ORDER else len(POLICY_ORDER), policy)


def write_csv(rows: Sequence[FidelityRow], path: str | Path) -> Path:
    """Writes every row (all fields) as CSV and returns the path."""
    path = Path(path)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(asdict(rows[0])))
        w.writeheader()
        for r in rows:
            w.writerow(asdict(r))
    return path


def _fmt(x: float, digits: int = 3) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def markdown_table(rows: Sequence[FidelityRow], trace: str = "all") -> str:
    """A markdown table of the rows of one trace (default: pooled over traces), policies x budgets.

    Columns: policy, budget, n_recent (and n_beacon), KL, top-1 agreement, recall of the paper rule's
    global and local queries, recall of the length-aware rule's global queries, all queries, and the
    query memory of BeaconKV-like policies.
    """
    sel = sorted((r for r in rows if r.trace == trace), key=lambda r: (_sort_key(r.policy), r.budget or 0))
    lines = [
        ("| policy | budget | n_recent / n_beacon | KL(full ‖ policy) | top-1 agree | recall global | recall local "
         "| recall global (length-aware) | recall all | query memory |"),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in sel:
        nb = f" / {r.n_beacon}" if r.n_beacon is not None else ""
        mem = "–" if r.query_memory != r.query_memory else f"{r.query_memory:.1f}"
        lines.append(
            f"| {r.policy} | {r.budget} | {r.n_recent}{nb} | {_fmt(r.kl, 4)} | {_fmt(r.top1)} | "
            f"{_fmt(r.recall_global)} | {_fmt(r.recall_local)} | {_fmt(r.recall_global_la)} | {_fmt(r.recall)} | {mem} |"
        )
    if sel:
        r = sel[0]
        lines.append("")
        lines.append(
            f"{r.steps} decode steps; of {r.n_queries} queries, {r.n_global} "
            f"({100 * r.n_global / max(r.n_queries, 1):.2f}%) are global by the paper's rule and {r.n_global_la} "
            f"({100 * r.n_global_la / max(r.n_queries, 1):.2f}%) by the length-aware rule; "
            f"{100 * r.prompt_mass:.1f}% of the attention mass lies on the protected prompt "
            f"({100 * r.prompt_mass_global:.1f}% for the paper's global queries)."
        )
    return "\n".join(lines)


def plot_fidelity(rows: Sequence[FidelityRow], out_dir: str | Path, prefix: str = "fidelity") -> list[Path]:
    """Plots each metric against the budget, one line per policy (pooled rows).

    Writes ``<prefix>.png`` (the four metrics in one figure) and ``<prefix>_<metric>.png`` each.

    Returns:
        The written paths, overview first.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    sel = [r for r in rows if r.trace == "all"]
    names = sorted({r.policy for r in sel}, key=_sort_key)
    budgets = sorted({r.budget for r in sel})

    def draw(ax, metric: str) -> None:
        for name in names:
            pts = sorted((r.budget, getattr(r, metric)) for r in sel if r.policy == name)
            style = {"lw": 2.5, "marker": "o"} if name == "beacon" else {"lw": 1.3, "marker": "."}
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=name, **style)
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.set_xlabel("budget (evictable tokens per KV head)")
        ax.set_title(METRICS[metric], fontsize=10)
        if metric == "kl":
            ax.set_yscale("log")
        ax.grid(alpha=0.3)

    paths = []
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, metric in zip(axes.flat, METRICS):
        draw(ax, metric)
    axes[0, 0].legend(fontsize=8)
    fig.tight_layout()
    paths.append(out_dir / f"{prefix}.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    for metric in METRICS:
        fig, ax = plt.subplots(figsize=(6, 4.2))
        draw(ax, metric)
        ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(out_dir / f"{prefix}_{metric}.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths
