"""The summary table: one row per benchmark x policy x budget over every results file in a folder.

pass@1 is the mean over problems of the fraction of a problem's samples that are correct (with the
same number of samples per problem, simply the mean over samples), in percent.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .errors import ResultsFileError
from .results import is_rank_file, iter_jsonl_records, record_field_problem

__all__ = ["SUMMARY_FIELDS", "SummaryRow", "format_summary_table", "summarize", "write_summary"]

SUMMARY_FIELDS: dict[str, tuple[type, ...]] = {
    "correct": (bool,),
    "new_tokens": (int,),
    "peak_cache_tokens": (int, float),
    "evictions": (int,),
    "finish_reason": (str,),
    "seconds": (int, float),
}
"""The fields of a record the summary reads (beyond the key fields), with the JSON types they may hold."""


@dataclass(frozen=True)
class SummaryRow:
    """Aggregates of one (benchmark, policy, budget).

    Attributes:
        benchmark: Benchmark name.
        policy: Policy label.
        budget: KV budget (``None`` for FullKV).
        model: Model id (the one of the first record).
        problems: Number of problems with at least one sample.
        samples: Number of samples.
        pass_at_1: pass@1 in percent.
        mean_new_tokens: Mean generated tokens per sample.
        mean_peak_cache_tokens: Mean peak cache occupancy (tokens per sequence).
        mean_evictions: Mean eviction rounds per sample.
        truncated: Fraction of samples that hit ``max_new_tokens`` (finish reason ``length``).
        mean_seconds: Mean seconds a sample spent generating (in its cache slot: admission to last token).
        containment: The sandbox containment the programs of a code benchmark ran under
            (:mod:`beaconkv.eval.sandbox`; several, comma-separated, if the samples differ);
            ``""`` where no program ran.
        grader_errors: Samples whose response could not be judged (their record's
            ``grade_error``, e.g. a sandbox that failed to start); they count as not correct in
            ``pass_at_1``, and a run with any should be re-run once the cause is fixed.
    """

    benchmark: str
    policy: str
    budget: int | None
    model: str
    problems: int
    samples: int
    pass_at_1: float
    mean_new_tokens: float
    mean_peak_cache_tokens: float
    mean_evictions: float
    truncated: float
    mean_seconds: float
    containment: str = ""
    grader_errors: int = 0


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def summarize(records: Sequence[dict[str, Any]]) -> list[SummaryRow]:
    """Aggregate result records into summary rows, sorted by benchmark, policy, budget.

    Args:
        records: Result records (from any number of files).

    Returns:
        One :class:`SummaryRow` per (benchmark, policy, budget).
    """
    groups: dict[tuple[str, str, int | None], list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        groups[(r["benchmark"], r["policy"], r["budget"])].append(r)
    rows = []
    for (benchmark, policy, budget), recs in groups.items():
        per_problem: dict[str, list[bool]] = defaultdict(list)
        for r in recs:
            per_problem[str(r["problem_id"])].append(bool(r["correct"]))
        rows.append(
            SummaryRow(
                benchmark=benchmark,
                policy=policy,
                budget=budget,
                model=str(recs[0].get("model", "")),
                problems=len(per_problem),
                samples=len(recs),
                pass_at_1=100.0 * _mean([_mean(v) for v in per_problem.values()]),
                mean_new_tokens=_mean([r["new_tokens"] for r in recs]),
                mean_peak_cache_tokens=_mean([r["peak_cache_tokens"] for r in recs]),
                mean_evictions=_mean([r["evictions"] for r in recs]),
                truncated=_mean([r["finish_reason"] == "length" for r in recs]),
                mean_seconds=_mean([r["seconds"] for r in recs]),
                containment=", ".join(sorted({r["containment"] for r in recs if r.get("containment")})),
                grader_errors=sum(1 for r in recs if r.get("grade_error")),
            )
        )
    rows.sort(key=lambda r: (r.benchmark, r.policy, -1 if r.budget is None else r.budget))
    return rows


def format_summary_table(rows: Sequence[SummaryRow]) -> str:
    """Render summary rows as a Markdown table.

    Args:
        rows: The rows.

    Returns:
        The table (header, separator, one line per row).
    """
    header = [
        "benchmark", "policy", "budget", "problems", "samples", "pass@1 %",
        "new tokens", "peak cache", "evictions", "truncated %", "s/sample", "sandbox", "grader errors",
    ]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        cells = [
            r.benchmark,
            r.policy,
            "-" if r.budget is None else str(r.budget),
            str(r.problems),
            str(r.samples),
            f"{r.pass_at_1:.2f}",
            f"{r.mean_new_tokens:.1f}",
            f"{r.mean_peak_cache_tokens:.1f}",
            f"{r.mean_evictions:.1f}",
            f"{100 * r.truncated:.1f}",
            f"{r.mean_seconds:.2f}",
            r.containment or "-",
            str(r.grader_errors),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_summary(out_dir: Path) -> tuple[list[SummaryRow], str]:
    """Summarise every merged results file in ``out_dir`` into ``summary.md`` and ``summary.json``.

    Rank parts (``*.rank<r>.jsonl``) of unfinished runs are not counted.

    Args:
        out_dir: The results folder.

    Returns:
        ``(rows, markdown table)``.

    Raises:
        ResultsFileError: A results file is not a regular file, or a record lacks a field the
            summary needs (:data:`SUMMARY_FIELDS`) or holds one of the wrong type; the message
            names the file and the line.
    """
    records: list[dict[str, Any]] = []
    for path in sorted(out_dir.glob("*.jsonl")):
        if is_rank_file(path):
            continue
        for lineno, record in iter_jsonl_records(path):
            wrong = record_field_problem(record, SUMMARY_FIELDS)
            if wrong:
                raise ResultsFileError(f"{path}:{lineno}: {wrong}; fix or delete that line (its sample is then "
                                       "generated again)")
            records.append(record)
    rows = summarize(records)
    table = format_summary_table(rows)
    (out_dir / "summary.md").write_text(table + "\n", encoding="utf-8")
    (out_dir / "summary.json").write_text(
        json.dumps([asdict(r) for r in rows], indent=2) + "\n", encoding="utf-8"
    )
    return rows, table

