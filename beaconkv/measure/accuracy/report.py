"""The accuracy suite's tables and plot: accuracy with its 95% interval per policy, budget and length.

One Markdown table per (task, protocol): a row per policy (FullKV first, kvpress's presses after ours),
a column per (length, compression), each cell ``accuracy % [95% interval]`` over the cell's cases (Wilson
score interval), and under it the memory (KV MiB a sequence needs) and seconds per case. The plot draws
accuracy against length, one panel per (task, compression), a line per policy.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["markdown_report", "plot_accuracy"]


def _label(row: dict[str, Any]) -> str:
    name = "FullKV" if row["policy"] == "full" else row["policy"]
    return f"kvpress:{name}" if row["engine"] == "kvpress" else name


def _order(row: dict[str, Any]) -> tuple:
    return (row["engine"] != "beaconkv", row["policy"] not in ("full", "none"), row["policy"])


def _column(row: dict[str, Any]) -> tuple[int, float]:
    return (row["length"], row["compression"] or 1.0)


def _pct(row: dict[str, Any]) -> str:
    if not row["n"]:
        return "n/a: " + "; ".join(row["errors"])[:80]
    return f"{100 * row['accuracy']:.0f} [{100 * row['lo']:.0f}-{100 * row['hi']:.0f}]"


def markdown_report(rows: Sequence[dict[str, Any]]) -> str:
    """The tables of :func:`~beaconkv.measure.accuracy.suite.summarize`'s rows, as Markdown.

    Args:
        rows: One per cell.

    Returns:
        The report: per (task, protocol) an accuracy table and a memory/time table.
    """
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        groups[(row["task"], row["protocol"])].append(row)
    out = []
    for (task, protocol), group in groups.items():
        # the compressed cells' columns; a group with only the references (FullKV, kvpress's 'none') shows theirs
        columns = sorted({_column(r) for r in group if r["compression"] is not None}) or sorted(
            {_column(r) for r in group})
        header = ["policy"] + [f"{length} / {c:g}x" for length, c in columns]
        unit = "decode steps" if protocol == "decode" else "context tokens"
        out.append(f"### {task}, {protocol} (accuracy %, 95% interval; columns: {unit} / compression)\n")
        out.append("| " + " | ".join(header) + " |")
        out.append("|" + "---|" * len(header))
        by_policy: dict[str, dict[tuple, dict]] = defaultdict(dict)
        for r in sorted(group, key=_order):
            by_policy[_label(r)][_column(r)] = r
        for label, cells in by_policy.items():
            if label in ("FullKV", "kvpress:none"):  # one run per length, shown under every compression
                cells = {(length, c): cells[(length, 1.0)] for length, c in columns if (length, 1.0) in cells}
            out.append("| " + " | ".join([label] + [_pct(cells[c]) if c in cells else "" for c in columns]) + " |")
        out.append("")
        out.append(f"KV MiB per sequence / prefill s / decode s per case ({task}, {protocol}):\n")
        header = ["policy"] + [f"{length} / {c:g}x" for length, c in columns]
        out.append("| " + " | ".join(header) + " |")
        out.append("|" + "---|" * len(header))
        for label, cells in by_policy.items():
            if label in ("FullKV", "kvpress:none"):
                cells = {(length, c): cells[(length, 1.0)] for length, c in columns if (length, 1.0) in cells}
            texts = []
            for c in columns:
                r = cells.get(c)
                texts.append("" if r is None or not r["n"] else
                             f"{r['kv_mib']:.1f} / {r['prefill_s']:.2f} / {r['decode_s']:.2f}")
            out.append("| " + " | ".join([label] + texts) + " |")
        notes = sorted({f"{_label(r)}: {r['note']}" for r in group if r.get("note")})
        out.extend(["", *(f"- {n}" for n in notes)] if notes else [])
        out.append("")
    return "\n".join(out)


def plot_accuracy(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """Accuracy against length, a panel per (task, compression), a line per policy (kvpress dashed).

    Args:
        rows: One per cell.
        path: The PNG to write.

    Returns:
        ``path``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({(r["task"], r["protocol"]) for r in rows})
    compressions = sorted({r["compression"] for r in rows if r["compression"] is not None})
    fig, axes = plt.subplots(len(tasks), max(len(compressions), 1), squeeze=False,
                             figsize=(4 * max(len(compressions), 1), 3 * len(tasks)))
    for i, (task, protocol) in enumerate(tasks):
        for j, c in enumerate(compressions or [None]):
            ax = axes[i][j]
            lines: dict[str, list[tuple[int, float]]] = defaultdict(list)
            for r in rows:
                if r["task"] == task and r["protocol"] == protocol and r["compression"] in (c, None) and r["n"]:
                    lines[_label(r)].append((r["length"], 100 * r["accuracy"]))
            for label, points in sorted(lines.items()):
                points.sort()
                style = "--" if label.startswith("kvpress") else "-"
                color = "black" if label == "FullKV" else None
                ax.plot([p[0] for p in points], [p[1] for p in points], style, marker="o", label=label, color=color)
            ax.set_title(f"{task} ({protocol}), {c:g}x" if c else f"{task} ({protocol})", fontsize=9)
            ax.set_ylim(-5, 105)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("decode steps" if protocol == "decode" else "context tokens", fontsize=8)
            ax.set_ylabel("accuracy %", fontsize=8)
            if i == 0 and j == 0:
                ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
