"""Results files: one JSONL per (benchmark, policy, budget), per-rank parts, resume and merge.

Layout of ``--out``::

    aime24__beacon__b1024.jsonl          merged results, sorted by (problem id, sample index)
    aime24__beacon__b1024.rank0.jsonl    written by rank 0 while running (merged, then deleted)
    aime24__full.jsonl                   FullKV has no budget
    summary.md / summary.json            the table over every merged file in the folder

A sample is done when a record with its key — (benchmark, problem id, sample index, policy,
budget) — is in the merged file or in any rank file, so an interrupted run (single process or any
number of ranks) resumes where it stopped. Each record also carries the run's ``settings``; a file
written with other settings (model, sampling, max_new_tokens, ...) is refused rather than mixed.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from beaconkv.eval.errors import DatasetFormatError, ResultsConflictError

__all__ = [
    "ResultKey",
    "is_rank_file",
    "load_done",
    "merge_results",
    "natural_id_key",
    "policy_label",
    "rank_file",
    "read_jsonl_records",
    "record_key",
    "results_stem",
]

ResultKey = tuple[str, str, int, str, "int | None"]
"""The resume key of a record: (benchmark, problem id, sample index, policy, budget); see :func:`record_key`."""

_RANK_RE = re.compile(r"\.rank(\d+)\.jsonl$")


def policy_label(policy: str, tag: str | None = None) -> str:
    """The policy name as used in file names and tables: ``beacon`` or ``beacon-<tag>``.

    Args:
        policy: Policy name.
        tag: Optional label of a variant (e.g. ``mean-agg`` for other policy arguments).

    Returns:
        The label.

    Raises:
        ValueError: If the tag has characters other than letters, digits, ``.``, ``_``, ``-``.
    """
    if not tag:
        return policy
    if not re.fullmatch(r"[A-Za-z0-9._-]+", tag):
        raise ValueError(f"tag {tag!r} may only hold letters, digits, '.', '_' and '-'")
    return f"{policy}-{tag}"


def results_stem(benchmark: str, policy: str, budget: int | None) -> str:
    """File stem of a results file, e.g. ``aime24__beacon__b1024`` (``aime24__full`` without budget).

    Args:
        benchmark: Benchmark name.
        policy: Policy label (see :func:`policy_label`).
        budget: KV budget, ``None`` for FullKV.

    Returns:
        The stem.
    """
    return f"{benchmark}__{policy}" + ("" if budget is None else f"__b{budget}")


def rank_file(out_dir: Path, stem: str, rank: int) -> Path:
    """Path of the part a rank writes while running.

    Args:
        out_dir: The results folder.
        stem: See :func:`results_stem`.
        rank: The rank.

    Returns:
        ``out_dir / f"{stem}.rank{rank}.jsonl"``.
    """
    return out_dir / f"{stem}.rank{rank}.jsonl"


def is_rank_file(path: Path) -> bool:
    """Whether ``path`` is a rank's part (``<stem>.rank<r>.jsonl``) rather than a merged file.

    Args:
        path: A file path.

    Returns:
        ``True`` for a rank part.
    """
    return _RANK_RE.search(path.name) is not None


def record_key(record: Mapping[str, Any]) -> ResultKey:
    """The resume key of a record: (benchmark, problem id, sample index, policy, budget).

    Args:
        record: A results record.

    Returns:
        The key.
    """
    return (
        record["benchmark"],
        str(record["problem_id"]),
        int(record["sample_idx"]),
        record["policy"],
        record["budget"],
    )


def natural_id_key(problem_id: str) -> tuple[int, int | str]:
    """Sort key of problem ids: integers numerically, before other strings, which sort as text.

    Args:
        problem_id: A problem id.

    Returns:
        The key.
    """
    return (0, int(problem_id)) if re.fullmatch(r"-?\d+", problem_id) else (1, problem_id)


def read_jsonl_records(path: Path) -> list[dict[str, Any]]:
    """Read a results JSONL file, tolerating a torn last line (a run killed mid-write).

    Args:
        path: The file; a missing file gives ``[]``.

    Returns:
        The records.

    Raises:
        DatasetFormatError: If a line other than the last is not valid JSON.
    """
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    records = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if lineno == len(lines):
                warnings.warn(f"{path}:{lineno}: ignoring a torn last line (interrupted run)", stacklevel=2)
                continue
            raise DatasetFormatError(
                f"{path}:{lineno}: not valid JSON ({exc.msg}); fix or delete that line"
            ) from exc
    return records


def _existing_files(out_dir: Path, stem: str) -> list[Path]:
    merged = out_dir / f"{stem}.jsonl"
    parts = sorted(
        out_dir.glob(f"{glob_escape(stem)}.rank*.jsonl"),
        key=lambda p: int(_RANK_RE.search(p.name).group(1)) if _RANK_RE.search(p.name) else -1,
    )
    return [merged, *[p for p in parts if _RANK_RE.search(p.name)]]


def glob_escape(text: str) -> str:
    """Escape ``*``, ``?`` and ``[`` for :meth:`pathlib.Path.glob`.

    Args:
        text: A literal file name part.

    Returns:
        The escaped pattern.
    """
    return re.sub(r"([*?\[])", r"[\1]", text)


def load_done(
    out_dir: Path, stem: str, settings: Mapping[str, Any] | None = None
) -> dict[ResultKey, dict[str, Any]]:
    """Collect the finished samples of one results file and its rank parts.

    Args:
        out_dir: The results folder.
        stem: See :func:`results_stem`.
        settings: This run's settings; if given, every existing record must carry equal
            ``settings``.

    Returns:
        Key -> record of every finished sample (the merged file wins over parts).

    Raises:
        ResultsConflictError: If a record was written with different settings.
    """
    done: dict[ResultKey, dict[str, Any]] = {}
    for path in _existing_files(out_dir, stem):
        for record in read_jsonl_records(path):
            if settings is not None and record.get("settings") != dict(settings):
                diff = {
                    k: (record.get("settings", {}).get(k), v)
                    for k, v in settings.items()
                    if record.get("settings", {}).get(k) != v
                }
                raise ResultsConflictError(
                    f"{path} holds results made with other settings (theirs, this run's): {diff}. "
                    f"Fix: use another --out folder, a --tag, or delete the file to start over."
                )
            done.setdefault(record_key(record), record)
    return done


def _sort_key(record: Mapping[str, Any]) -> tuple:
    return (natural_id_key(str(record["problem_id"])), int(record["sample_idx"]))


def write_jsonl_atomic(path: Path, records: Iterable[Mapping[str, Any]]) -> None:
    """Write records to ``path`` through a temporary file and an atomic rename.

    Args:
        path: Destination.
        records: The records, one JSON object a line.
    """
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def merge_results(out_dir: Path, stem: str) -> Path:
    """Merge the rank parts into ``<stem>.jsonl`` (deduplicated, sorted) and delete the parts.

    Records are sorted by (problem id, sample index), integers numerically, so the merged file
    of a sharded run is byte-identical to that of a single-process run with the same settings
    (apart from timing fields).

    Args:
        out_dir: The results folder.
        stem: See :func:`results_stem`.

    Returns:
        The merged file's path.
    """
    files = _existing_files(out_dir, stem)
    merged: dict[ResultKey, dict[str, Any]] = {}
    for path in files:
        for record in read_jsonl_records(path):
            merged.setdefault(record_key(record), record)
    target = files[0]
    write_jsonl_atomic(target, sorted(merged.values(), key=_sort_key))
    for path in files[1:]:
        path.unlink()
    return target
