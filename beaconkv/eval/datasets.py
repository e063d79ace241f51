"""Benchmark loaders: read the project's data, a local file or a hub dataset file into problems.

Which benchmarks exist, and the :class:`~beaconkv.eval.benchmarks.Problem` records this module
produces, are described in :mod:`beaconkv.eval.benchmarks`. Local files may be JSONL, JSON, CSV or
parquet (parquet needs ``pyarrow``). A file without a single record is refused, naming the file.

Where the problems come from, first match wins:

1. a file given explicitly (``--data FILE``);
2. a hub location given explicitly (``--hub-repo``/``--hub-file``/``--hub-revision``);
3. the project's own copy, :func:`beaconkv.paths.benchmark_file`: ``<repo>/data/aime24.jsonl`` and
   ``<repo>/data/math500.jsonl`` (``$BEACONKV_DATA`` moves the folder), when the file exists;
4. the benchmark's default hub file, downloaded with
   ``huggingface_hub.hf_hub_download(..., repo_type="dataset")``:

   * ``aime24``: ``HuggingFaceH4/aime_2024``, ``data/train-00000-of-00001.parquet``
   * ``math500``: ``HuggingFaceH4/MATH-500``, ``test.jsonl``
   * ``gpqa_diamond``: ``Idavidrein/gpqa`` (gated), ``gpqa_diamond.csv``
   * ``livecodebench``: ``livecodebench/code_generation_lite``, ``test.jsonl`` (release v1;
     ``test2.jsonl`` ... ``test6.jsonl`` hold the problems added by later releases)
   * ``math``: no default; any local file with problem/answer columns.

GPQA is gated: accept its terms on https://huggingface.co/datasets/Idavidrein/gpqa, then log in
(``huggingface-cli login``) or set ``HF_TOKEN``; or download ``gpqa_diamond.csv`` once and pass it
as a local file.

LiveCodeBench stores its private tests as ``base64(zlib(pickle(json string)))``. They are decoded
here with an unpickler that refuses every class, so only plain strings, numbers and containers can
come out of it; a pickle that tries to build any object raises :class:`DatasetFormatError`.
"""

from __future__ import annotations

import base64
import csv
import io
import json
import pickle
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..paths import benchmark_file
from .answers import extract_last_boxed
from .benchmarks import BenchmarkSpec, CodeTest, Problem, get_benchmark
from .errors import (
    DatasetAccessError,
    DatasetFormatError,
    MissingFieldError,
)

__all__ = [
    "download_from_hub",
    "load_benchmark",
    "local_data_file",
    "read_records",
    "records_to_problems",
]

SUPPORTED_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")
"""Suffixes :func:`read_records` understands."""


# --------------------------------------------------------------------------------------------
# Reading files
# --------------------------------------------------------------------------------------------


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """Read a data file into a list of dict records.

    Args:
        path: A ``.jsonl`` (one object a line), ``.json`` (a list of objects, a dict holding such a
            list under ``data``/``rows``/``train``/``test``/``validation``, or a dict of equally long
            columns), ``.csv`` (header row) or ``.parquet`` file.

    Returns:
        The records, in file order.

    Raises:
        FileNotFoundError: If the file does not exist.
        DatasetFormatError: If the suffix is unknown or the content is malformed.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file {str(path)!r} does not exist; pass an existing file path")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _read_jsonl(path)
    if suffix == ".json":
        return _read_json(path)
    if suffix == ".csv":
        with path.open(newline="", encoding="utf-8-sig") as f:
            return [dict(row) for row in csv.DictReader(f)]
    if suffix == ".parquet":
        return _read_parquet(path)
    raise DatasetFormatError(
        f"cannot read {str(path)!r}: unknown suffix {suffix or '(none)'!r}; "
        f"supported: {', '.join(SUPPORTED_SUFFIXES)}. Convert the file or rename it."
    )


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetFormatError(
                    f"{path}:{lineno}: not valid JSON ({exc.msg}); a .jsonl file needs one JSON "
                    f"object per line (use .json for a single JSON document)"
                ) from exc
            if not isinstance(record, dict):
                raise DatasetFormatError(
                    f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}"
                )
            records.append(record)
    return records


def _read_json(path: Path) -> list[dict[str, Any]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise DatasetFormatError(
            f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}); if it holds one object per "
            f"line, name it .jsonl"
        ) from exc
    if isinstance(data, dict):
        for key in ("data", "rows", "train", "test", "validation"):
            if isinstance(data.get(key), list):
                data = data[key]
                break
        else:
            columns = [v for v in data.values() if isinstance(v, list)]
            if columns and len(columns) == len(data) and len({len(c) for c in columns}) == 1:
                keys = list(data)
                data = [dict(zip(keys, row)) for row in zip(*data.values())]
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise DatasetFormatError(
            f"{path}: expected a list of objects (or a dict holding one under 'data'/'rows'/"
            f"'train'/'test', or a dict of equally long columns); got {type(data).__name__}"
        )
    return data


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise DatasetFormatError(
            f"reading {str(path)!r} needs pyarrow: pip install pyarrow (or install "
            f"beaconkv[eval]); or convert the file to .jsonl"
        ) from exc
    try:
        return pq.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow raises several types for corrupt files
        raise DatasetFormatError(f"{path}: not a readable parquet file ({exc})") from exc


# --------------------------------------------------------------------------------------------
# The hub
# --------------------------------------------------------------------------------------------


def download_from_hub(repo_id: str, filename: str, *, revision: str | None = None) -> Path:
    """Download one file of a hub dataset repository (cached by ``huggingface_hub``).

    Args:
        repo_id: E.g. ``"HuggingFaceH4/MATH-500"``.
        filename: Path inside the repository, e.g. ``"test.jsonl"``.
        revision: Branch, tag or commit; ``None`` for the default branch.

    Returns:
        Local path of the downloaded file.

    Raises:
        DatasetAccessError: If the download fails; the message says why (gated, missing file,
            offline) and how to proceed.
    """
    import huggingface_hub

    try:
        local = huggingface_hub.hf_hub_download(
            repo_id=repo_id, filename=filename, repo_type="dataset", revision=revision
        )
    except Exception as exc:
        name = type(exc).__name__
        if name == "GatedRepoError":
            hint = (
                f"the dataset is gated: accept its terms on https://huggingface.co/datasets/"
                f"{repo_id}, then run `huggingface-cli login` or set HF_TOKEN"
            )
        elif name in ("EntryNotFoundError", "RemoteEntryNotFoundError"):
            hint = f"the repository has no file {filename!r}; pass --hub-file with an existing file"
        elif name == "RepositoryNotFoundError":
            hint = "the repository does not exist (or is private); check --hub-repo"
        else:
            hint = "check the network (or HF_HUB_OFFLINE), or download the file and pass --data FILE"
        raise DatasetAccessError(
            f"could not download {filename!r} from hub dataset {repo_id!r}"
            f"{f' at {revision!r}' if revision else ''}: {name}: {exc}. Fix: {hint}."
        ) from exc
    return Path(local)


# --------------------------------------------------------------------------------------------
# Records -> problems
# --------------------------------------------------------------------------------------------


def _pick(
    record: Mapping[str, Any],
    role: str,
    candidates: Sequence[str],
    *,
    where: str,
    required: bool = True,
) -> Any:
    for name in candidates:
        if name in record and record[name] is not None:
            return record[name]
    if not required:
        return None
    raise MissingFieldError(
        f"{where}: no {role!r} field; looked for {list(candidates)}, the record has "
        f"{sorted(record)}. Fix: --field {role}=COLUMN"
    )


class _NoObjectsUnpickler(pickle.Unpickler):
    """Unpickles only builtin scalars and containers: any class lookup is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise DatasetFormatError(
            f"refusing to unpickle {module}.{name}: LiveCodeBench test data should only hold "
            f"strings; the file may be corrupt or hostile"
        )


def _decode_lcb_tests(value: Any, *, where: str) -> list[dict[str, Any]]:
    """Decode a LiveCodeBench test list: JSON text, or base64(zlib(pickle(JSON text)))."""
    if isinstance(value, list):
        return value
    if not isinstance(value, str) or not value.strip():
        return []
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        pass
    try:
        raw = zlib.decompress(base64.b64decode(value.encode("utf-8")))
        obj = _NoObjectsUnpickler(io.BytesIO(raw)).load()
    except DatasetFormatError:
        raise
    except Exception as exc:
        raise DatasetFormatError(
            f"{where}: test cases are neither JSON nor base64(zlib(pickle)) ({exc})"
        ) from exc
    if isinstance(obj, bytes):
        obj = obj.decode("utf-8")
    return json.loads(obj) if isinstance(obj, str) else obj


def records_to_problems(
    records: Sequence[Mapping[str, Any]],
    spec: BenchmarkSpec,
    *,
    field_map: Mapping[str, str | Sequence[str]] | None = None,
    source: str = "<records>",
) -> list[Problem]:
    """Map raw records to :class:`Problem` objects with a benchmark's field map.

    Args:
        records: Raw rows.
        spec: The benchmark.
        field_map: Overrides of ``spec.fields``: role -> column name (or list of column names;
            for ``choices`` the correct option first).
        source: Where the records came from, for error messages.

    Returns:
        The problems, in record order.

    Raises:
        MissingFieldError: If a required field is absent.
        DatasetFormatError: If ids repeat or a value has the wrong shape.
    """
    fields = dict(spec.fields)
    for role, columns in (field_map or {}).items():
        fields[role] = (columns,) if isinstance(columns, str) else tuple(columns)
    problems: list[Problem] = []
    seen: set[str] = set()
    for index, record in enumerate(records):
        where = f"{source} record {index}"
        raw_id = _pick(record, "id", fields.get("id", ()), where=where, required=False)
        pid = str(index) if raw_id is None else str(raw_id)
        if pid in seen:
            raise DatasetFormatError(
                f"{where}: problem id {pid!r} appears twice; ids must be unique "
                f"(fix: --field id=COLUMN naming a unique column)"
            )
        seen.add(pid)
        question = str(_pick(record, "question", fields["question"], where=where))
        metadata = {k: record[k] for k in spec.keep if k in record}
        if spec.kind == "math":
            answer = _pick(record, "answer", fields.get("answer", ()), where=where, required=False)
            if answer is None:
                solution = _pick(record, "answer", fields.get("solution", ()), where=where)
                answer = extract_last_boxed(str(solution))
                if answer is None:
                    raise MissingFieldError(
                        f"{where}: no answer column and no \\boxed{{}} in the solution; "
                        f"fix: --field answer=COLUMN"
                    )
            problems.append(
                Problem(spec.name, pid, question, answer=str(answer), metadata=metadata)
            )
        elif spec.kind == "choice":
            columns = fields["choices"]
            missing = [c for c in columns if record.get(c) is None]
            if missing:
                raise MissingFieldError(
                    f"{where}: choice columns {missing} missing; the record has {sorted(record)}. "
                    f"Fix: --field choices=CORRECT,WRONG1,WRONG2,..."
                )
            choices = tuple(str(record[c]).strip() for c in columns)
            problems.append(
                Problem(
                    spec.name, pid, question, answer=choices[0], choices=choices, metadata=metadata
                )
            )
        else:
            tests: list[CodeTest] = []
            for role in ("public_tests", "private_tests"):
                value = _pick(record, role, fields.get(role, ()), where=where, required=False)
                for t in _decode_lcb_tests(value, where=where):
                    kind = t.get("testtype", "stdin")
                    if kind not in ("stdin", "functional"):
                        raise DatasetFormatError(
                            f"{where}: test type {kind!r} is neither 'stdin' nor 'functional'"
                        )
                    tests.append(CodeTest(str(t["input"]), str(t["output"]), kind))
            if not tests:
                raise MissingFieldError(
                    f"{where}: code problem {pid!r} has no tests; looked for "
                    f"{list(fields.get('public_tests', ()))} and "
                    f"{list(fields.get('private_tests', ()))}. Fix: --field public_tests=COLUMN"
                )
            meta = _pick(record, "metadata", fields.get("metadata", ()), where=where, required=False)
            if isinstance(meta, str):
                meta = json.loads(meta) if meta.strip() else {}
            fn_name = (meta or {}).get("func_name")
            starter = _pick(
                record, "starter_code", fields.get("starter_code", ()), where=where, required=False
            )
            problems.append(
                Problem(
                    spec.name,
                    pid,
                    question,
                    starter_code=str(starter or ""),
                    tests=tuple(tests),
                    fn_name=fn_name,
                    metadata=metadata,
                )
            )
    return problems


def local_data_file(spec: BenchmarkSpec) -> Path | None:
    """The project's own copy of a benchmark's problems, if it ships one and the file exists.

    Args:
        spec: The benchmark.

    Returns:
        :func:`beaconkv.paths.benchmark_file` of ``spec.local_file`` (``<repo>/data/aime24.jsonl``,
        ``<repo>/data/math500.jsonl``), or ``None`` when the benchmark has no local copy or the
        file is absent.
    """
    if spec.local_file is None:
        return None
    path = benchmark_file(spec.local_file)
    return path if path.is_file() else None


def load_benchmark(
    name: str,
    path: str | Path | None = None,
    *,
    hub_repo: str | None = None,
    hub_file: str | None = None,
    hub_revision: str | None = None,
    field_map: Mapping[str, str | Sequence[str]] | None = None,
    limit: int | None = None,
) -> list[Problem]:
    """Load a benchmark's problems from a local file, the project's data folder or the hub.

    Args:
        name: Benchmark name or alias (see :data:`beaconkv.eval.benchmarks.BENCHMARKS`).
        path: Local data file. When ``None``: the hub location if one of ``hub_repo``,
            ``hub_file``, ``hub_revision`` is given, else the project's copy
            (:func:`local_data_file`) if there is one, else the benchmark's default hub file.
        hub_repo: Hub dataset repository (default: the benchmark's).
        hub_file: File in that repository (default: the benchmark's).
        hub_revision: Branch, tag or commit of the hub repository.
        field_map: Column overrides (role -> column), see :func:`records_to_problems`.
        limit: Keep only the first ``limit`` problems (``>= 1``).

    Returns:
        The problems in file order (at least one).

    Raises:
        UnknownBenchmarkError: Unknown ``name``.
        DatasetAccessError: No local file and no hub default, or a failed download.
        DatasetFormatError: Unreadable file, or a file without a single record.
        MissingFieldError: A required column is missing.
        ValueError: ``limit`` below 1.
    """
    spec = get_benchmark(name)
    if limit is not None and limit < 1:
        raise ValueError(
            f"limit={limit} must be >= 1; pass --limit N with N >= 1, or leave it out to "
            f"evaluate every problem"
        )
    hub_requested = any(v is not None for v in (hub_repo, hub_file, hub_revision))
    if path is None and not hub_requested:
        path = local_data_file(spec)
    if path is None:
        repo = hub_repo or spec.hub_repo
        filename = hub_file or spec.hub_file
        if repo is None or filename is None:
            raise DatasetAccessError(
                f"benchmark {spec.name!r} has no default hub dataset; pass a local file "
                f"(--data FILE) or --hub-repo REPO --hub-file FILE"
            )
        path = download_from_hub(repo, filename, revision=hub_revision)
        source = f"hf://datasets/{repo}/{filename}"
    else:
        source = str(path)
    records = read_records(path)
    if not records:
        what = (
            "is empty"
            if Path(path).stat().st_size == 0
            else "holds no records (only blank lines, a header or an empty list)"
        )
        unit = "line" if Path(path).suffix.lower() == ".jsonl" else "row"
        raise DatasetFormatError(
            f"data file {source!r} {what}; {spec.name} needs one problem per {unit}. "
            f"Fix: pass a file with problems (--data FILE)"
            + (" or leave --data out to read the project's copy" if spec.local_file else "")
        )
    problems = records_to_problems(records, spec, field_map=field_map, source=source)
    if limit is not None:
        problems = problems[:limit]
    return problems
