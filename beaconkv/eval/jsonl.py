"""Results files as JSONL, read and repaired safely: opened only as regular files, read a line at a time,
a torn tail set aside.

A process killed in the middle of appending a record leaves a *torn tail*: a last line without
its newline, or one that is not a JSON object. Appending after it would glue the next record onto
it (and then lose that record, or break every later merge), so before a file is appended to or
merged, :func:`set_aside_torn_tail` moves the torn bytes to a sibling ``<file>.torn`` (appended to,
so nothing is ever lost) and cuts them from the file; the sample they belonged to is simply
generated again. A process repairs only the files no other process is writing: its own rank part,
and on rank 0 the merged file and the parts of ranks that no longer exist; rank 0 repairs every
part when it merges, after all ranks have finished.

Every results file, rank part, torn file and temporary file is opened as a **regular file of the
results folder and nothing else**: with ``O_NOFOLLOW`` (a symlink there is refused, never followed
to its target) and ``O_NONBLOCK`` for the open (a FIFO cannot block a resume), then checked to be a
regular file, else :class:`~beaconkv.eval.errors.ResultsFileError` names the path. Lines are read
a block at a time and none beyond :data:`MAX_RECORD_BYTES`; the torn-tail scan reads each byte of
the tail at most once (linear in the tail's length). A record lacking a key field, or holding one of
the wrong type, is refused in one line that names the file and the line.
"""

from __future__ import annotations

import json
import os
import stat
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO

from .errors import ResultsFileError

__all__ = [
    "MAX_RECORD_BYTES",
    "iter_jsonl_records",
    "open_results_file",
    "read_jsonl_records",
    "record_field_problem",
    "set_aside_torn_tail",
    "torn_file",
]

MAX_RECORD_BYTES = 256 << 20
"""The longest line a results file may hold (256 MiB): a record is a sample's text and, with
``--save-token-ids``, its token ids; a longer line is not a record (torn, or not a results file)."""

_BLOCK = 1 << 16
_BLANK = b" \t\r\n\x0b\x0c"  # what bytes.strip() strips


def open_results_file(path: Path, mode: str) -> BinaryIO:
    """Open a results file only if it is a regular file, never following a symlink.

    Args:
        path: The file, inside the results folder.
        mode: ``"rb"``, ``"rb+"``, ``"ab"`` (created if missing) or ``"xb"`` (created, must not exist).

    Returns:
        The open binary file.

    Raises:
        ResultsFileError: ``path`` is a symlink, a FIFO, a device, a directory or any other
            non-regular file; the message names it and the fix.
        FileNotFoundError: ``"rb"`` or ``"rb+"`` of a missing file.
    """
    flags = {
        "rb": os.O_RDONLY,
        "rb+": os.O_RDWR,
        "ab": os.O_WRONLY | os.O_APPEND | os.O_CREAT,
        "xb": os.O_WRONLY | os.O_CREAT | os.O_EXCL,
    }[mode]
    flags |= os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        try:
            kind = os.lstat(path).st_mode
        except OSError:
            raise exc from None
        if stat.S_ISLNK(kind):  # ELOOP (Linux) or EMLINK (BSD) from O_NOFOLLOW
            raise ResultsFileError(
                f"{path} is a symbolic link; results files are only regular files of the results folder "
                "and are never followed to another place: remove the link, or choose another --out"
            ) from exc
        if not stat.S_ISREG(kind):  # e.g. ENXIO: a FIFO opened for writing with no reader
            raise ResultsFileError(
                f"{path} is not a regular file ({_file_kind(kind)}); results files are only regular files "
                "of the results folder: remove it, or choose another --out"
            ) from exc
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ResultsFileError(
                f"{path} is not a regular file ({_file_kind(info.st_mode)}); results files are only "
                "regular files of the results folder: remove it, or choose another --out"
            )
        os.set_blocking(fd, True)
        return os.fdopen(fd, mode.replace("x", "w") if mode == "xb" else mode)
    except BaseException:
        os.close(fd)
        raise


def _file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


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


def _backwards(f: BinaryIO, end: int) -> Iterator[tuple[int, bytes]]:
    """The blocks of ``f`` before offset ``end``, last first: ``(offset, bytes)``."""
    while end > 0:
        start = max(0, end - _BLOCK)
        f.seek(start)
        yield start, f.read(end - start)
        end = start


def _last_newline_before(f: BinaryIO, end: int) -> int:
    """Offset of the last ``\n`` before ``end``, or -1."""
    for start, block in _backwards(f, end):
        at = block.rfind(b"\n")
        if at >= 0:
            return start + at
    return -1


def _content_end(f: BinaryIO, end: int) -> int:
    """Offset just after the last non-blank byte before ``end`` (0 if there is none)."""
    for start, block in _backwards(f, end):
        kept = len(block.rstrip(_BLANK))
        if kept:
            return start + kept
    return 0


def _torn_tail_start(f: BinaryIO, size: int) -> int | None:
    """Offset at which the torn tail of an open file starts, or ``None`` if its tail is sound.

    Reads each byte of the tail at most once (plus the last line, to judge it).
    """
    f.seek(size - 1)
    if f.read(1) != b"\n":  # a line without its newline: cut after the last newline
        return _last_newline_before(f, size) + 1
    body_end = _content_end(f, size)
    if body_end == 0:
        return None  # only blank lines
    line_start = _last_newline_before(f, body_end) + 1
    if body_end - line_start > MAX_RECORD_BYTES:
        return line_start
    f.seek(line_start)
    return None if _is_record_line(f.read(body_end - line_start)) else line_start


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

    Raises:
        ResultsFileError: ``path`` or its ``.torn`` file is a symlink or not a regular file.
    """
    if not os.path.lexists(path):
        return 0
    with open_results_file(path, "rb+") as f:
        size = f.seek(0, os.SEEK_END)
        cut = _torn_tail_start(f, size) if size else None
        if cut is None or cut >= size:
            return 0
        aside = torn_file(path)
        with open_results_file(aside, "ab") as sink:
            f.seek(cut)
            while block := f.read(_BLOCK):  # a block at a time: a torn tail may be long
                sink.write(block)
            sink.flush()
            os.fsync(sink.fileno())
        f.truncate(cut)
        f.flush()
        os.fsync(f.fileno())
    warnings.warn(
        f"{path}: set aside a torn last line ({size - cut} bytes, from an interrupted write) in "
        f"{aside.name}; the sample it belonged to is generated again",
        stacklevel=2,
    )
    return size - cut


_KEY_FIELDS: Mapping[str, tuple[type, ...]] = {
    "benchmark": (str,),
    "problem_id": (str, int),
    "sample_idx": (int,),
    "policy": (str,),
    "budget": (int, type(None)),
    "settings": (dict, type(None)),
}
_OPTIONAL = frozenset({"settings"})


def record_field_problem(record: Mapping[str, Any], fields: Mapping[str, tuple[type, ...]],
                         optional: frozenset[str] = frozenset()) -> str | None:
    """What is wrong with a record's fields, or ``None``.

    Args:
        record: A results record.
        fields: Field name -> the types it may hold (``bool`` never counts as ``int``).
        optional: Fields that may be missing.

    Returns:
        A short description of the first missing or mistyped field, or ``None``.
    """
    for name, types in fields.items():
        if name not in record:
            if name in optional:
                continue
            return f"the record has no {name!r} field"
        value = record[name]
        if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
            wanted = " or ".join(_JSON_NAMES.get(t, t.__name__) for t in types)
            shown = json.dumps(value)[:60]
            return f"the record's {name!r} is {shown} ({_JSON_NAMES.get(type(value), 'a value')}), not {wanted}"
    return None


_JSON_NAMES: Mapping[type, str] = {
    str: "a string", int: "an integer", float: "a number", bool: "a boolean", dict: "an object",
    list: "an array", type(None): "null",
}


def _lines(f: BinaryIO) -> Iterator[tuple[bytes | None, bool]]:
    """``(line without its newline, had a newline)`` for each line of ``f``; ``None`` for a line
    over :data:`MAX_RECORD_BYTES` (skipped without being held)."""
    while line := f.readline(MAX_RECORD_BYTES + 1):
        if len(line) > MAX_RECORD_BYTES and not line.endswith(b"\n"):
            del line
            while (more := f.readline(_BLOCK)) and not more.endswith(b"\n"):
                pass
            yield None, bool(more)
        elif line.endswith(b"\n"):
            yield line[:-1], True
        else:
            yield line, False


def iter_jsonl_records(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Read a results JSONL file line by line: ``(line number, record)``, a torn last line skipped.

    The file is not changed (see :func:`read_jsonl_records`).

    Args:
        path: The file; a missing file gives nothing.

    Yields:
        The line number (1-based) and the record of each record line.

    Raises:
        ResultsFileError: The file is a symlink or not a regular file; a line before the last is
            not a JSON object or is longer than :data:`MAX_RECORD_BYTES`; or a record lacks a key
            field or holds one of the wrong type (the message names the file and the line).
    """
    if not os.path.lexists(path):
        return
    with open_results_file(path, "rb") as f:
        torn: tuple[int, str] | None = None  # a line that is no record, not yet known to be the last
        for lineno, (line, _) in enumerate(_lines(f), start=1):
            if line is not None and not line.strip():
                continue
            if torn is not None:
                raise ResultsFileError(
                    f"{path}:{torn[0]}: {torn[1]}; fix or delete that line (its sample is then generated again)"
                )
            if line is None:
                torn = (lineno, f"a line of more than {MAX_RECORD_BYTES} bytes")
                continue
            try:
                record = json.loads(line)
                problem = "" if isinstance(record, dict) else f"a JSON {type(record).__name__}, not an object"
            except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
                problem = f"not valid JSON ({getattr(exc, 'msg', None) or exc})"
            except RecursionError:
                problem = "JSON nested too deep to be a record"
            if problem:
                torn = (lineno, problem)
                continue
            wrong = record_field_problem(record, _KEY_FIELDS, _OPTIONAL)
            if wrong:  # a whole JSON object is no torn write: refused wherever it is
                raise ResultsFileError(
                    f"{path}:{lineno}: {wrong}; fix or delete that line (its sample is then generated again)"
                )
            yield lineno, record
        if torn is not None:
            warnings.warn(f"{path}:{torn[0]}: ignoring a torn last line (interrupted write)", stacklevel=3)


def read_jsonl_records(path: Path) -> list[dict[str, Any]]:
    """Read a results JSONL file, skipping a torn last line (a write still under way, or killed).

    The file is not changed: a torn last line is set aside by :func:`set_aside_torn_tail`, which
    :func:`load_done` and :func:`merge_results` call on the files this process may repair. Lines are
    split on ``\n`` only (a text may hold U+2028 or U+0085), read one at a time.

    Args:
        path: The file; a missing file gives ``[]``.

    Returns:
        The records.

    Raises:
        ResultsFileError: See :func:`iter_jsonl_records` (a
            :class:`~beaconkv.eval.errors.DatasetFormatError`).
    """
    return [record for _, record in iter_jsonl_records(path)]
