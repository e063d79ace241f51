"""Results files: one JSONL per (benchmark, policy, budget), per-rank parts, resume and merge.

Layout of ``--out``::

    aime24__beacon__b1024.jsonl          merged results, sorted by (problem id, sample index)
    aime24__beacon__b1024.rank0.jsonl    written by rank 0 while running (merged, then deleted)
    aime24__beacon__b1024.rank0.jsonl.torn   bytes of torn last lines set aside (see beaconkv.eval.jsonl)
    aime24__full.jsonl                   FullKV has no budget
    summary.md / summary.json            the table over every merged file in the folder

A sample is done when a record with its key — (benchmark, problem id, sample index, policy,
budget) — is in the merged file or in any rank file, so an interrupted run (single process or any
number of ranks) resumes where it stopped. Each record also carries the run's ``settings``; a file
written with other settings (model, sampling, max_new_tokens, ...) is refused rather than mixed.

How a results file is opened, read and repaired (regular files only, torn tails set aside) is
:mod:`beaconkv.eval.jsonl`; its names are importable from here too.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .errors import ResultsConflictError
from .jsonl import (
    MAX_RECORD_BYTES,
    iter_jsonl_records,
    open_results_file,
    read_jsonl_records,
    record_field_problem,
    set_aside_torn_tail,
    torn_file,
)

__all__ = [
    "LEGACY_SETTINGS",
    "MAX_RECORD_BYTES",
    "RETIRED_SETTINGS",
    "ResultKey",
    "glob_escape",
    "is_rank_file",
    "iter_jsonl_records",
    "load_done",
    "merge_results",
    "natural_id_key",
    "open_results_file",
    "policy_label",
    "rank_file",
    "read_jsonl_records",
    "record_field_problem",
    "record_key",
    "results_stem",
    "set_aside_torn_tail",
    "torn_file",
    "write_jsonl_atomic",
]

ResultKey = tuple[str, str, int, str, "int | None"]
"""The resume key of a record: (benchmark, problem id, sample index, policy, budget); see :func:`record_key`."""

LEGACY_SETTINGS: Mapping[str, Any] = {"kv_storage": "dense", "backend": "native", "prefill_chunk": None}
"""Settings added after results files were first written, with the value older records implied.

A record whose ``settings`` lack one of these keys is read as if it held this value, so results
written before the setting existed resume under the same settings instead of being refused."""

RETIRED_SETTINGS: Mapping[str, Any] = {"batch_size": 1}
"""Settings that runs no longer have, with the value under which older records equal today's.

``batch_size`` was the number of samples of one problem generated together, seeded ``seed + row``
from the first sample's seed; with 1 every sample had its own seed, as every sample has now (the
engine's ``max_batch`` does not change a sample). A record holding the value here is read as if it
lacked the key, so it resumes under today's settings; any other value is refused as other settings."""

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


def _part_rank(path: Path) -> int | None:
    m = _RANK_RE.search(path.name)
    return int(m.group(1)) if m else None


def _existing_files(out_dir: Path, stem: str) -> list[Path]:
    merged = out_dir / f"{stem}.jsonl"
    parts = [p for p in out_dir.glob(f"{glob_escape(stem)}.rank*.jsonl") if _part_rank(p) is not None]
    parts.sort(key=lambda p: _part_rank(p) or 0)
    return [merged, *parts]


def glob_escape(text: str) -> str:
    """Escape ``*``, ``?`` and ``[`` for :meth:`pathlib.Path.glob`.

    Args:
        text: A literal file name part.

    Returns:
        The escaped pattern.
    """
    return re.sub(r"([*?\[])", r"[\1]", text)


def _may_repair(path: Path, rank: int, world_size: int) -> bool:
    """Whether no other rank of this run writes ``path``, so ``rank`` may cut its torn tail."""
    part = _part_rank(path)
    if part is None:  # the merged file: written by rank 0 only, after every rank has finished
        return rank == 0
    return part == rank or (rank == 0 and part >= world_size)


def _settings_of(record: Mapping[str, Any]) -> dict[str, Any]:
    settings = {**LEGACY_SETTINGS, **(record.get("settings") or {})}
    for key, same in RETIRED_SETTINGS.items():
        if key in settings and settings[key] == same:
            del settings[key]
    return settings


def load_done(
    out_dir: Path,
    stem: str,
    settings: Mapping[str, Any] | None = None,
    *,
    rank: int = 0,
    world_size: int = 1,
) -> dict[ResultKey, dict[str, Any]]:
    """Collect the finished samples of one results file and its rank parts.

    First the torn tails of the files this rank may repair are set aside
    (:func:`set_aside_torn_tail`): its own part, and on rank 0 the merged file and the parts of
    ranks ``>= world_size`` (left by a run with more ranks). The parts other ranks are writing are
    only read, skipping a torn last line.

    Args:
        out_dir: The results folder.
        stem: See :func:`results_stem`.
        settings: This run's settings; if given, every existing record must carry equal
            ``settings`` (keys missing from old records read as in :data:`LEGACY_SETTINGS`; retired
            keys holding the value of :data:`RETIRED_SETTINGS` are ignored).
        rank: This process's rank.
        world_size: Number of ranks of this run.

    Returns:
        Key -> record of every finished sample (the merged file wins over parts).

    Raises:
        ResultsConflictError: If a record was written with different settings.
        ResultsFileError: A file is a symlink or not a regular file, a line before the last of
            a file is not a JSON object, or a record's key field is missing or mistyped.
    """
    done: dict[ResultKey, dict[str, Any]] = {}
    for path in _existing_files(out_dir, stem):
        if _may_repair(path, rank, world_size):
            set_aside_torn_tail(path)
        for record in read_jsonl_records(path):
            theirs = _settings_of(record)
            if settings is not None and theirs != dict(settings):
                diff = {
                    k: (theirs.get(k), settings.get(k))
                    for k in sorted(set(theirs) | set(settings))
                    if theirs.get(k) != settings.get(k)
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

    Raises:
        ResultsFileError: The temporary file's name is taken by something that is not a regular
            file or link (a directory, a FIFO).
    """
    tmp = path.with_name(path.name + ".tmp")
    if os.path.lexists(tmp):  # left by an interrupted merge; a link there is removed, never followed
        tmp.unlink()
    with open_results_file(tmp, "xb") as f:
        for record in records:
            f.write((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # replaces a link at ``path`` itself, not its target


def merge_results(out_dir: Path, stem: str) -> Path:
    """Merge the rank parts into ``<stem>.jsonl`` (deduplicated, sorted) and delete the parts.

    Call it on rank 0 once every rank has finished writing: the torn tail of every file is set
    aside first (:func:`set_aside_torn_tail`), so no partial record is merged and none is lost.
    Records are sorted by (problem id, sample index), integers numerically, so the merged file
    of a sharded run is byte-identical to that of a single-process run with the same settings
    (apart from timing fields).

    Args:
        out_dir: The results folder.
        stem: See :func:`results_stem`.

    Returns:
        The merged file's path.

    Raises:
        ResultsFileError: A file is a symlink or not a regular file, a line before the last of
            a file is not a JSON object, or a record's key field is missing or mistyped.
    """
    files = _existing_files(out_dir, stem)
    merged: dict[ResultKey, dict[str, Any]] = {}
    for path in files:
        set_aside_torn_tail(path)
        for record in read_jsonl_records(path):
            merged.setdefault(record_key(record), record)
    target = files[0]
    write_jsonl_atomic(target, sorted(merged.values(), key=_sort_key))
    for path in files[1:]:
        path.unlink()
    return target
