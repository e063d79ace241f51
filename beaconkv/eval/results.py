"""Results files: one JSONL per (benchmark, policy, budget), per-rank parts, resume and merge.

Layout of ``--out``::

    aime24__beacon__b1024.jsonl          merged results, sorted by (problem id, sample index)
    aime24__beacon__b1024.rank0.jsonl    written by rank 0 while running (merged, then deleted)
    aime24__beacon__b1024.rank0.jsonl.torn   bytes of torn last lines set aside (see below)
    aime24__full.jsonl                   FullKV has no budget
    summary.md / summary.json            the table over every merged file in the folder

A sample is done when a record with its key — (benchmark, problem id, sample index, policy,
budget) — is in the merged file or in any rank file, so an interrupted run (single process or any
number of ranks) resumes where it stopped. Each record also carries the run's ``settings``; a file
written with other settings (model, sampling, max_new_tokens, ...) is refused rather than mixed.

A process killed in the middle of appending a record leaves a *torn tail*: a last line without
its newline, or one that is not a JSON object. Appending after it would glue the next record onto
it (and then lose that record, or break every later merge), so before a file is appended to or
merged, :func:`set_aside_torn_tail` moves the torn bytes to a sibling ``<file>.torn`` (appended to,
so nothing is ever lost) and cuts them from the file; the sample they belonged to is simply
generated again. A process repairs only the files no other process is writing: its own rank part,
and on rank 0 the merged file and the parts of ranks that no longer exist; rank 0 repairs every
part when it merges, after all ranks have finished.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

from beaconkv.eval.errors import DatasetFormatError, ResultsConflictError

__all__ = [
    "LEGACY_SETTINGS",
    "RETIRED_SETTINGS",
    "ResultKey",
    "glob_escape",
    "is_rank_file",
    "load_done",
    "merge_results",
    "natural_id_key",
    "policy_label",
    "rank_file",
    "read_jsonl_records",
    "record_key",
    "results_stem",
    "set_aside_torn_tail",
    "torn_file",
    "write_jsonl_atomic",
]

ResultKey = tuple[str, str, int, str, "int | None"]
"""The resume key of a record: (benchmark, problem id, sample index, policy, budget); see :func:`record_key`."""

LEGACY_SETTINGS: Mapping[str, Any] = {"kv_storage": "dense", "backend": "native"}
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
_TAIL_BLOCK = 1 << 16


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


def torn_file(path: Path) -> Path:
    """Where the torn tails of a results file are set aside: ``<file>.torn`` beside it.

    Args:
        path: A results file or rank part.

    Returns:
        ``path`` with ``.torn`` appended to its name.
    """
    return path.with_name(path.name + ".torn")


def _is_record_line(line: bytes) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:  # JSONDecodeError, or UnicodeDecodeError of a cut multi-byte character
        return False


def _torn_tail_start(f: BinaryIO, size: int) -> int | None:
    """Offset at which the torn tail of an open file starts, or ``None`` if its tail is sound."""
    start = size
    data = b""
    while start > 0:  # read backwards until the line to judge is whole in `data`
        step = min(_TAIL_BLOCK, start)
        start -= step
        f.seek(start)
        data = f.read(step) + data
        whole = data.rstrip() if data.endswith(b"\n") else data
        if b"\n" in whole:
            break
    if not data.endswith(b"\n"):  # a line without its newline: cut after the last newline
        return start + data.rfind(b"\n") + 1
    body = data.rstrip()
    if not body:
        return None  # only blank lines
    line_start = body.rfind(b"\n") + 1
    return None if _is_record_line(body[line_start:]) else start + line_start


def set_aside_torn_tail(path: Path) -> int:
    """Move a torn last line of a JSONL results file to ``<file>.torn`` and cut it from the file.

    The tail is torn when the file does not end with a newline (everything after the last newline
    is the torn part) or when its last non-blank line is not a JSON object (that line and the blank
    lines after it). The bytes are appended to :func:`torn_file` and flushed to disk *before* the
    file is truncated, so an interruption in between loses nothing. Call it only on a file that no
    other process is appending to.

    Args:
        path: A results file or rank part; a missing or empty file is left alone.

    Returns:
        The number of bytes set aside (0 if the tail was sound).
    """
    if not path.is_file():
        return 0
    with path.open("rb+") as f:
        size = f.seek(0, os.SEEK_END)
        cut = _torn_tail_start(f, size) if size else None
        if cut is None or cut >= size:
            return 0
        f.seek(cut)
        tail = f.read()
        aside = torn_file(path)
        with aside.open("ab") as sink:
            sink.write(tail)
            sink.flush()
            os.fsync(sink.fileno())
        f.truncate(cut)
        f.flush()
        os.fsync(f.fileno())
    warnings.warn(
        f"{path}: set aside a torn last line ({len(tail)} bytes, from an interrupted write) in "
        f"{aside.name}; the sample it belonged to is generated again",
        stacklevel=2,
    )
    return len(tail)


def read_jsonl_records(path: Path) -> list[dict[str, Any]]:
    """Read a results JSONL file, skipping a torn last line (a write still under way, or killed).

    The file is not changed: a torn last line is set aside by :func:`set_aside_torn_tail`, which
    :func:`load_done` and :func:`merge_results` call on the files this process may repair.

    Args:
        path: The file; a missing file gives ``[]``.

    Returns:
        The records.

    Raises:
        DatasetFormatError: If a line other than the last is not a JSON object.
    """
    if not path.exists():
        return []
    # bytes split on b"\n" only: a text may hold U+2028 or U+0085 (splitlines() splits on them), and
    # a line being written may end inside a multi-byte character
    lines = path.read_bytes().split(b"\n")
    while lines and not lines[-1].strip():
        lines.pop()
    records = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            problem = "" if isinstance(record, dict) else f"a JSON {type(record).__name__}, not an object"
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
            problem = f"not valid JSON ({getattr(exc, 'msg', None) or exc})"
        if not problem:
            records.append(record)
        elif lineno == len(lines):
            warnings.warn(f"{path}:{lineno}: ignoring a torn last line (interrupted write)", stacklevel=2)
        else:
            raise DatasetFormatError(
                f"{path}:{lineno}: {problem}; fix or delete that line (its sample is then "
                f"generated again)"
            )
    return records


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
        DatasetFormatError: If a line before the last of a file is not valid JSON.
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
        DatasetFormatError: If a line before the last of a file is not valid JSON.
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
