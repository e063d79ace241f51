"""Loaders: the project's AIME24 / MATH-500 files (the default), every file format, field maps, the hub path, errors."""

from __future__ import annotations

import base64
import csv
import json
import pickle
import zlib
from pathlib import Path

import pytest

from beaconkv.eval import benchmarks
from beaconkv.eval.benchmarks import get_benchmark
from beaconkv.eval.datasets import load_benchmark, local_data_file, read_records
from beaconkv.eval.errors import (
    DatasetAccessError,
    DatasetFormatError,
    MissingFieldError,
    UnknownBenchmarkError,
)

ROWS = [
    {"id": 1, "problem": "What is 1+1?", "answer": "2"},
    {"id": 2, "problem": "What is 2+2?", "answer": "4"},
]


def test_aime24_from_project_data(project_data: Path) -> None:
    problems = load_benchmark("aime24", project_data / "aime24.jsonl")
    assert len(problems) == 30
    first = problems[0]
    assert (first.id, first.answer) == ("60", "204")
    assert first.question.startswith("Every morning Aya")
    assert "url" in first.metadata


def test_math500_from_project_data(project_data: Path) -> None:
    problems = load_benchmark("MATH-500", project_data / "math500.jsonl", limit=5)
    assert len(problems) == 5
    assert problems[0].id == "test/precalculus/807.json"
    assert problems[0].answer == r"\left( 3, \frac{\pi}{2} \right)"
    assert problems[0].metadata["subject"] == "Precalculus"


def write(path: Path, fmt: str, rows: list[dict]) -> Path:
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "json":
        path.write_text(json.dumps({"data": rows}))
    elif fmt == "csv":
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    else:
        pq = pytest.importorskip("pyarrow.parquet")
        import pyarrow as pa

        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "parquet"])
def test_every_format_loads_the_same_problems(tmp_path: Path, fmt: str) -> None:
    path = write(tmp_path / f"data.{fmt}", fmt, ROWS)
    problems = load_benchmark("math", path)
    assert [(p.id, p.question, p.answer) for p in problems] == [
        ("1", "What is 1+1?", "2"),
        ("2", "What is 2+2?", "4"),
    ]


def test_json_dict_of_columns(tmp_path: Path) -> None:
    path = tmp_path / "cols.json"
    path.write_text(json.dumps({"problem": ["a", "b"], "answer": ["1", "2"]}))
    assert [p.id for p in load_benchmark("math", path)] == ["0", "1"]  # no id column: row index


def test_field_map_override_and_answer_from_solution(tmp_path: Path) -> None:
    rows = [{"Q": "x?", "sol": r"so \boxed{\frac{1}{2}}."}]
    path = write(tmp_path / "d.jsonl", "jsonl", rows)
    (p,) = load_benchmark("math", path, field_map={"question": "Q", "solution": "sol"})
    assert p.question == "x?" and p.answer == r"\frac{1}{2}"


def test_gpqa_csv(tmp_path: Path) -> None:
    row = {
        "Record ID": "rec1",
        "Question": "Which?",
        "Correct Answer": "right",
        "Incorrect Answer 1": "w1",
        "Incorrect Answer 2": "w2",
        "Incorrect Answer 3": "w3",
        "Subdomain": "Physics",
    }
    (p,) = load_benchmark("gpqa", write(tmp_path / "gpqa_diamond.csv", "csv", [row]))
    assert p.benchmark == "gpqa_diamond" and p.id == "rec1"
    assert p.choices == ("right", "w1", "w2", "w3") and p.answer == "right"


def lcb_row(qid: str = "abc301_a") -> dict:
    private = [{"input": "5 7\n", "output": "12\n", "testtype": "stdin"}]
    packed = base64.b64encode(zlib.compress(pickle.dumps(json.dumps(private)))).decode()
    return {
        "question_id": qid,
        "question_title": "Sum",
        "question_content": "Print a+b.",
        "platform": "atcoder",
        "starter_code": "",
        "public_test_cases": json.dumps([{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}]),
        "private_test_cases": packed,
        "metadata": json.dumps({}),
    }


def test_livecodebench_tests_are_decoded(tmp_path: Path) -> None:
    (p,) = load_benchmark("lcb", write(tmp_path / "test.jsonl", "jsonl", [lcb_row()]))
    assert p.id == "abc301_a" and p.fn_name is None
    assert [(t.input, t.output, t.kind) for t in p.tests] == [
        ("1 2\n", "3\n", "stdin"),
        ("5 7\n", "12\n", "stdin"),
    ]


def test_livecodebench_pickle_building_objects_is_refused(tmp_path: Path) -> None:
    row = lcb_row()

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    row["private_test_cases"] = base64.b64encode(zlib.compress(pickle.dumps(Evil()))).decode()
    with pytest.raises(DatasetFormatError, match="refusing to unpickle"):
        load_benchmark("livecodebench", write(tmp_path / "t.jsonl", "jsonl", [row]))


def test_unknown_benchmark_names_the_choices() -> None:
    with pytest.raises(UnknownBenchmarkError, match="'aime23'.*aime24"):
        get_benchmark("aime23")


def test_missing_field_names_the_fix(tmp_path: Path) -> None:
    path = write(tmp_path / "d.jsonl", "jsonl", [{"problem": "x"}])
    with pytest.raises(MissingFieldError, match="--field answer=COLUMN"):
        load_benchmark("math", path)


def test_bad_formats(tmp_path: Path) -> None:
    bad_suffix = tmp_path / "d.txt"
    bad_suffix.write_text("hi")
    with pytest.raises(DatasetFormatError, match="unknown suffix '.txt'"):
        read_records(bad_suffix)
    bad_line = tmp_path / "d.jsonl"
    bad_line.write_text('{"a": 1}\nnot json\n')
    with pytest.raises(DatasetFormatError, match=r"d.jsonl:2"):
        read_records(bad_line)
    with pytest.raises(FileNotFoundError):
        read_records(tmp_path / "missing.jsonl")
    dup = write(tmp_path / "dup.jsonl", "jsonl", [ROWS[0], ROWS[0]])
    with pytest.raises(DatasetFormatError, match="appears twice"):
        load_benchmark("math", dup)


def test_hub_download_uses_the_documented_defaults(tmp_path: Path, monkeypatch) -> None:
    import huggingface_hub

    local = write(tmp_path / "test.jsonl", "jsonl", ROWS)
    calls = []

    def fake_download(repo_id, filename, repo_type, revision):
        calls.append((repo_id, filename, repo_type, revision))
        return str(local)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    monkeypatch.setenv("BEACONKV_DATA", str(tmp_path / "no-local-copy"))  # no project file: the hub
    problems = load_benchmark("math500")
    assert len(problems) == 2
    assert calls == [("HuggingFaceH4/MATH-500", "test.jsonl", "dataset", None)]


def test_hub_gated_error_explains_the_fix(monkeypatch) -> None:
    import huggingface_hub

    class GatedRepoError(Exception):
        pass

    def fake_download(**kwargs):
        raise GatedRepoError("403")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    with pytest.raises(DatasetAccessError, match="accept its terms.*Idavidrein/gpqa"):
        load_benchmark("gpqa_diamond")


def test_benchmark_without_hub_default_needs_a_file() -> None:
    with pytest.raises(DatasetAccessError, match="--data FILE"):
        load_benchmark("math")


def test_registry_defaults() -> None:
    assert benchmarks.BENCHMARKS["aime24"].hub_repo == "HuggingFaceH4/aime_2024"
    assert benchmarks.BENCHMARKS["aime24"].default_samples == 8
    assert benchmarks.BENCHMARKS["gpqa_diamond"].gated
    assert benchmarks.BENCHMARKS["aime24"].local_file == "aime24"
    assert benchmarks.BENCHMARKS["math500"].local_file == "math500"


# ------------------------------------------------------------------------------ the project's data


def no_hub(monkeypatch) -> None:
    import huggingface_hub

    def refuse(**kwargs):
        raise AssertionError(f"hub download although the project has the file: {kwargs}")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", refuse)


@pytest.mark.parametrize("name", ["aime24", "aime", "AIME-2024", "aime_2024"])
def test_aime24_defaults_to_the_project_file(project_data: Path, monkeypatch, name: str) -> None:
    no_hub(monkeypatch)
    assert local_data_file(get_benchmark(name)) == project_data / "aime24.jsonl"
    problems = load_benchmark(name)
    assert problems == load_benchmark("aime24", project_data / "aime24.jsonl")
    assert len(problems) == 30 and (problems[0].id, problems[0].answer) == ("60", "204")


@pytest.mark.parametrize("name", ["math500", "MATH-500", "math_500"])
def test_math500_defaults_to_the_project_file(project_data: Path, monkeypatch, name: str) -> None:
    no_hub(monkeypatch)
    problems = load_benchmark(name, limit=3)
    assert [p.id for p in problems] == [p.id for p in load_benchmark("math500", project_data / "math500.jsonl", limit=3)]
    assert problems[0].id == "test/precalculus/807.json"


def test_the_project_data_lies_inside_the_repository(project_data: Path) -> None:
    repo = Path(__file__).resolve().parents[2]
    assert project_data.resolve() == (repo / "data").resolve()
    for name in ("aime24", "math500"):
        path = local_data_file(get_benchmark(name))
        assert path is not None and path.resolve().is_relative_to(repo.resolve())


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"hub_repo": "me/aime"}, ("me/aime", "data/train-00000-of-00001.parquet", None)),
        ({"hub_file": "other.jsonl"}, ("HuggingFaceH4/aime_2024", "other.jsonl", None)),
        ({"hub_revision": "v2"}, ("HuggingFaceH4/aime_2024", "data/train-00000-of-00001.parquet", "v2")),
    ],
)
def test_a_hub_location_overrides_the_project_file(tmp_path: Path, monkeypatch, kwargs, expected) -> None:
    import huggingface_hub

    local = write(tmp_path / "hub.jsonl", "jsonl", ROWS)
    calls = []

    def fake_download(repo_id, filename, repo_type, revision):
        calls.append((repo_id, filename, revision))
        return str(local)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    problems = load_benchmark("aime24", **kwargs)
    assert calls == [expected] and [p.id for p in problems] == ["1", "2"]


def test_benchmarks_without_a_project_copy_still_use_the_hub() -> None:
    assert local_data_file(get_benchmark("gpqa_diamond")) is None
    assert local_data_file(get_benchmark("livecodebench")) is None
    assert local_data_file(get_benchmark("math")) is None


# ------------------------------------------------------------------------- files without problems


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("empty.jsonl", "", "is empty"),
        ("blank.jsonl", "\n\n  \n", "holds no records"),
        ("header.csv", "id,problem,answer\n", "holds no records"),
        ("list.json", "[]", "holds no records"),
    ],
)
def test_a_file_without_records_is_refused_naming_it(tmp_path: Path, name: str, content: str, message: str) -> None:
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(DatasetFormatError, match=message) as info:
        load_benchmark("aime24", path)
    assert str(path) in str(info.value) and "--data FILE" in str(info.value)


def test_limit_below_one_is_refused() -> None:
    for limit in (0, -1):
        with pytest.raises(ValueError, match=f"limit={limit} must be >= 1.*--limit"):
            load_benchmark("aime24", limit=limit)
