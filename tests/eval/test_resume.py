"""Resume without loss: a torn last line (a process killed mid-write) is set aside, never glued to.

The scenario a user found: a rank part ends in a torn line; the next run appended its first record
onto it. With 3 good lines before the tear every rerun then failed at the merge; with 7 the new
record was silently dropped from the summary. Here the torn tail goes to ``<part>.torn`` and the
sample is generated again: no sample lost or duplicated, the summary counts all 8.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest

from beaconkv.cli import main
from beaconkv.eval import jsonl, runner
from beaconkv.eval.backend import GenerationBackend
from beaconkv.eval.config import EvalConfig
from beaconkv.eval.errors import DatasetFormatError, ResultsFileError
from beaconkv.eval.results import (
    load_done,
    merge_results,
    open_results_file,
    rank_file,
    read_jsonl_records,
    set_aside_torn_tail,
    torn_file,
)
from beaconkv.eval.runner import run_eval

from .fakes import PROBLEMS, FakeEngines, Tok, read, strip_timing, write_problems

STEM = "aime24__full"
TOTAL = 8  # 2 problems x 4 samples


def use_model(monkeypatch, gen: FakeEngines) -> FakeEngines:
    monkeypatch.setattr(runner, "load_backend", lambda *a, **k: GenerationBackend(Tok(), gen))
    return gen


def cli(out: Path, data: Path) -> list[str]:
    return [
        "eval", "--model", "fake", "--benchmark", "aime24", "--data", str(data), "--policy", "full",
        "--samples", "4", "--max-new-tokens", "4", "--out", str(out), "--no-progress", "--save-token-ids",
    ]  # fmt: skip


@pytest.fixture
def data(tmp_path) -> Path:
    return write_problems(tmp_path / "problems.jsonl", PROBLEMS[:2])


@pytest.fixture
def reference(tmp_path, data, monkeypatch, capsys) -> list[dict]:
    """The merged records of an uninterrupted run."""
    use_model(monkeypatch, FakeEngines())
    assert main(cli(tmp_path / "reference", data)) == 0
    capsys.readouterr()
    records = read(tmp_path / "reference" / f"{STEM}.jsonl")
    assert len(records) == TOTAL
    return records


def line_of(record: dict) -> bytes:
    """A record's line exactly as the runner writes it."""
    return (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")


@pytest.mark.parametrize("good", [3, 7])
def test_rerun_after_a_torn_part_loses_and_duplicates_nothing(
    tmp_path, data, reference, monkeypatch, capsys, good
) -> None:
    out = tmp_path / "out"
    use_model(monkeypatch, FakeEngines(fail_after=good))
    assert main(cli(out, data)) == 130  # killed after `good` samples
    part = rank_file(out, STEM, 0)
    assert len(read(part)) == good
    # the next record was being written when the process died: half of its line reached the disk
    written = [(r["problem_id"], r["sample_idx"]) for r in read(part)]
    by_key = {(r["problem_id"], r["sample_idx"]): r for r in reference}
    in_order = [("60", i) for i in range(4)] + [("61", i) for i in range(4)]
    following = next(k for k in in_order if k not in written)
    torn = line_of(by_key[following])[:57]
    with part.open("ab") as f:
        f.write(torn)
    capsys.readouterr()

    gen = use_model(monkeypatch, FakeEngines())
    with pytest.warns(UserWarning, match="torn last line"):
        code = main(cli(out, data))
    stdout, stderr = capsys.readouterr()
    assert code == 0, stderr
    assert len(gen.calls) == TOTAL - good
    assert f"{TOTAL - good} samples generated, {good} already done" in stderr

    merged = read(out / f"{STEM}.jsonl")
    keys = [(r["problem_id"], r["sample_idx"]) for r in merged]
    assert len(keys) == len(set(keys)) == TOTAL  # nothing lost, nothing twice
    assert strip_timing(merged) == strip_timing(reference)
    assert torn_file(part).read_bytes() == torn  # the torn bytes are kept
    assert not part.exists() and list(out.glob("*.rank*.jsonl")) == []
    (row,) = json.loads((out / "summary.json").read_text())
    assert (row["problems"], row["samples"]) == (2, TOTAL)
    assert f"| aime24 | full | - | 2 | {TOTAL} |" in stdout

    again = use_model(monkeypatch, FakeEngines())
    assert main(cli(out, data)) == 0 and again.calls == []
    assert strip_timing(read(out / f"{STEM}.jsonl")) == strip_timing(reference)


def test_a_torn_merged_file_is_repaired_too(tmp_path, data, reference, monkeypatch, capsys) -> None:
    out = tmp_path / "out"
    out.mkdir()
    merged = out / f"{STEM}.jsonl"
    torn = line_of(reference[5])[:-20]
    merged.write_bytes(b"".join(line_of(r) for r in reference[:5]) + torn)
    gen = use_model(monkeypatch, FakeEngines())
    with pytest.warns(UserWarning, match="torn last line"):
        assert main(cli(out, data)) == 0
    assert len(gen.calls) == 3
    assert strip_timing(read(merged)) == strip_timing(reference)
    assert torn_file(merged).read_bytes() == torn
    capsys.readouterr()


def test_a_newline_terminated_garbage_line_is_set_aside(tmp_path, reference) -> None:
    out = tmp_path / "out"
    out.mkdir()
    part = rank_file(out, STEM, 0)
    garbage = b"\x00\x00\x00\x00\n"  # a file system that zero-filled the last block
    part.write_bytes(b"".join(line_of(r) for r in reference[:2]) + garbage)
    gen = FakeEngines()
    config = EvalConfig(model="fake", benchmark="aime24", policy="full", samples=4, max_new_tokens=4,
                        out_dir=out, progress=False, save_token_ids=True)  # fmt: skip
    with pytest.warns(UserWarning, match="torn last line"):
        report = run_eval(config, backend=GenerationBackend(Tok(), gen), problems=PROBLEMS[:2])
    assert (report.generated, report.skipped) == (6, 2)
    assert strip_timing(read(report.results_file)) == strip_timing(reference)
    assert torn_file(part).read_bytes() == garbage


# --------------------------------------------------------------------------- set_aside_torn_tail


def record(i: int, text: str = "t") -> bytes:
    fields = {"benchmark": "b", "problem_id": str(i), "sample_idx": 0, "policy": "p", "budget": 8, "text": text}
    return (json.dumps(fields, ensure_ascii=False) + "\n").encode()


def test_a_sound_file_is_left_alone(tmp_path) -> None:
    path = tmp_path / "r.jsonl"
    assert set_aside_torn_tail(path) == 0  # missing
    path.write_bytes(b"")
    assert set_aside_torn_tail(path) == 0  # empty
    body = record(1) + record(2) + b"\n\n"
    path.write_bytes(body)
    assert set_aside_torn_tail(path) == 0
    assert path.read_bytes() == body and not torn_file(path).exists()


@pytest.mark.parametrize(
    ("tail", "aside"),
    [
        (b'{"benchmark": "b", "pro', b'{"benchmark": "b", "pro'),  # no newline
        (b'{"benchmark": "b"}', b'{"benchmark": "b"}'),  # JSON, but the write did not finish
        (b'{"benchmark": "b", "pro\n', b'{"benchmark": "b", "pro\n'),  # newline, not JSON
        (b'{"benchmark": "b", "pro\n\n  \n', b'{"benchmark": "b", "pro\n\n  \n'),  # blank lines after
        (b"[1, 2]\n", b"[1, 2]\n"),  # JSON, but not a record
        ('{"text": "caf\u00e9'.encode()[:-1], '{"text": "caf\u00e9'.encode()[:-1]),  # a cut character
        (b"\n   ", b"   "),  # blanks without a newline: only they go
    ],
)
def test_torn_tails_are_moved_aside(tmp_path, tail: bytes, aside: bytes) -> None:
    path = tmp_path / "r.jsonl"
    body = record(1) + record(2)
    path.write_bytes(body + tail)
    with pytest.warns(UserWarning, match="torn last line"):
        assert set_aside_torn_tail(path) == len(aside)
    assert torn_file(path).read_bytes() == aside
    assert path.read_bytes() + aside == body + tail  # every byte is somewhere
    assert [r["problem_id"] for r in read_jsonl_records(path)] == ["1", "2"]
    assert set_aside_torn_tail(path) == 0  # now sound


def test_a_file_that_is_one_torn_line(tmp_path) -> None:
    path = tmp_path / "r.jsonl"
    path.write_bytes(b'{"benchm')
    with pytest.warns(UserWarning):
        assert set_aside_torn_tail(path) == 8
    assert path.read_bytes() == b"" and torn_file(path).read_bytes() == b'{"benchm'


def test_successive_tears_are_appended_not_overwritten(tmp_path) -> None:
    path = tmp_path / "r.jsonl"
    path.write_bytes(record(1) + b'{"first tear')
    with pytest.warns(UserWarning):
        set_aside_torn_tail(path)
    with path.open("ab") as f:
        f.write(record(2) + b'{"second tear')
    with pytest.warns(UserWarning):
        set_aside_torn_tail(path)
    assert path.read_bytes() == record(1) + record(2)
    assert torn_file(path).read_bytes() == b'{"first tear{"second tear'


def test_long_lines_beyond_the_read_block(tmp_path) -> None:
    path = tmp_path / "r.jsonl"
    long_good = record(1, "x" * 200_000)
    long_torn = record(2, "y" * 150_000)[:-1000]
    path.write_bytes(record(0) + long_good + long_torn)
    with pytest.warns(UserWarning):
        assert set_aside_torn_tail(path) == len(long_torn)
    assert path.read_bytes() == record(0) + long_good
    assert set_aside_torn_tail(path) == 0  # a long sound last line stays


def test_line_separators_inside_a_text_do_not_split_a_record(tmp_path) -> None:
    path = tmp_path / "r.jsonl"
    path.write_bytes(record(1, "a\u2028b\u0085c\x0cd") + record(2))
    assert set_aside_torn_tail(path) == 0
    assert [r["text"] for r in read_jsonl_records(path)] == ["a\u2028b\u0085c\x0cd", "t"]


def test_a_rank_repairs_only_the_files_nobody_else_writes(tmp_path) -> None:
    stem = "b__p"
    merged, part0, part1, part5 = (tmp_path / f"{stem}.jsonl", *(rank_file(tmp_path, stem, r) for r in (0, 1, 5)))
    rows = {p: record(i) + b'{"to' for i, p in enumerate((merged, part0, part1, part5))}
    for p, content in rows.items():
        p.write_bytes(content)
    with pytest.warns(UserWarning):
        load_done(tmp_path, stem, rank=1, world_size=2)  # its own part only
    assert part1.read_bytes() == record(2) and torn_file(part1).exists()
    assert all(p.read_bytes() == rows[p] for p in (merged, part0, part5))
    with pytest.warns(UserWarning):
        done = load_done(tmp_path, stem, rank=0, world_size=2)  # its part, the merged file, stale rank 5
    assert len(done) == 4
    assert [p.read_bytes() for p in (merged, part0, part5)] == [record(0), record(1), record(3)]


def test_reading_a_part_another_rank_is_writing(tmp_path) -> None:
    stem = "b__p"
    part1 = rank_file(tmp_path, stem, 1)
    being_written = record(2, "\u601d\u8003")[:-6]  # cut inside a multi-byte character
    part1.write_bytes(record(1) + being_written)
    with pytest.warns(UserWarning, match="ignoring a torn last line"):
        done = load_done(tmp_path, stem, rank=0, world_size=2)
    assert [key[1] for key in done] == ["1"]
    assert part1.read_bytes() == record(1) + being_written  # not this rank's file: left alone


def test_a_broken_line_before_the_last_is_an_error(tmp_path) -> None:
    path = tmp_path / "r.jsonl"
    path.write_bytes(record(1) + b'{"glued{"benchmark": 1}\n' + record(2))
    with pytest.raises(DatasetFormatError, match=r"r.jsonl:2: not valid JSON.*fix or delete that line"):
        read_jsonl_records(path)
    path.write_bytes(record(1) + b"[1, 2]\n" + record(2))
    with pytest.raises(DatasetFormatError, match=r"r.jsonl:2: a JSON list, not an object"):
        read_jsonl_records(path)


# --------------------------------------------------------------------------- issue #39: resume stays in its run


def two_lines_torn() -> bytes:
    return record(1) + b'{"benchmark": "b", "pro'


@pytest.mark.parametrize("which", ["results", "torn"])
def test_a_symlink_is_never_followed(tmp_path, which: str) -> None:
    outside = tmp_path / "home"
    outside.mkdir()
    bashrc = outside / ".bashrc"
    bashrc.write_bytes(b"export PATH=/usr/bin\n")
    out = tmp_path / "out"
    out.mkdir()
    path = out / "r.jsonl"
    if which == "results":  # the merged file links to a file elsewhere: its last line was cut
        target = outside / "victim.jsonl"
        target.write_bytes(two_lines_torn())
        path.symlink_to(target)
    else:  # the torn file links to ~/.bashrc: the tail was appended to it
        target = bashrc
        path.write_bytes(two_lines_torn())
        torn_file(path).symlink_to(bashrc)
    before = target.read_bytes()
    with pytest.raises(ResultsFileError, match=r"r\.jsonl(\.torn)? is a symbolic link.*never followed"):
        set_aside_torn_tail(path)
    assert target.read_bytes() == before
    if which == "torn":
        assert path.read_bytes() == two_lines_torn()  # nothing cut when the tail has nowhere to go
    with pytest.raises(ResultsFileError, match="symbolic link"):
        read_jsonl_records(out / "r.jsonl" if which == "results" else torn_file(path))


def test_a_fifo_or_a_directory_is_refused_without_blocking(tmp_path) -> None:
    fifo = tmp_path / "f.jsonl"
    os.mkfifo(fifo)
    for call in (set_aside_torn_tail, read_jsonl_records):
        with pytest.raises(ResultsFileError, match=r"f\.jsonl is not a regular file \(a FIFO\)"):
            call(fifo)
    with pytest.raises(ResultsFileError, match=r"is not a regular file \(a FIFO\)"):
        open_results_file(fifo, "ab")  # a writer with no reader: ENXIO, named
    (tmp_path / "d.jsonl").mkdir()
    with pytest.raises(ResultsFileError, match=r"d\.jsonl is not a regular file \(a directory\)"):
        read_jsonl_records(tmp_path / "d.jsonl")


def test_a_link_to_dev_zero_is_refused_not_read(tmp_path) -> None:
    path = tmp_path / "r.jsonl"
    path.symlink_to("/dev/zero")
    with pytest.raises(ResultsFileError, match="symbolic link"):
        read_jsonl_records(path)
    with pytest.raises(ResultsFileError, match="symbolic link"):
        load_done(tmp_path, "r")


def test_the_merge_writes_through_no_link_left_at_its_temporary_name(tmp_path) -> None:
    stem = "b__p"
    rank_file(tmp_path, stem, 0).write_bytes(record(1))
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me\n")
    (tmp_path / f"{stem}.jsonl.tmp").symlink_to(victim)
    merged = merge_results(tmp_path, stem)
    assert victim.read_bytes() == b"keep me\n"
    assert not merged.is_symlink() and read_jsonl_records(merged)[0]["problem_id"] == "1"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (b'{"benchmark": "b", "problem_id": "1", "policy": "p", "budget": 8}', "the record has no 'sample_idx' field"),
        (b'{"benchmark": 7, "problem_id": "1", "sample_idx": 0, "policy": "p", "budget": 8}',
         "the record's 'benchmark' is 7 \\(an integer\\), not a string"),
        (b'{"benchmark": "b", "problem_id": "1", "sample_idx": "0", "policy": "p", "budget": 8}',
         "the record's 'sample_idx' is \"0\" \\(a string\\), not an integer"),
        (b'{"benchmark": "b", "problem_id": "1", "sample_idx": true, "policy": "p", "budget": 8}',
         "the record's 'sample_idx' is true \\(a boolean\\), not an integer"),
        (b'{"benchmark": "b", "problem_id": "1", "sample_idx": 0, "policy": "p", "budget": 8, "settings": [1]}',
         "the record's 'settings' is \\[1\\] \\(an array\\), not an object or null"),
    ],
)
def test_a_malformed_record_is_one_line_naming_the_file_and_line(tmp_path, line: bytes, message: str) -> None:
    path = tmp_path / "r.jsonl"
    for body in (record(1) + line + b"\n" + record(2), record(1) + line + b"\n"):  # in the middle, or last
        path.write_bytes(body)
        with pytest.raises(ResultsFileError, match=rf"r\.jsonl:2: {message}; fix or delete that line"):
            read_jsonl_records(path)


def test_a_record_the_summary_cannot_read_is_named_by_file_and_line(tmp_path) -> None:
    from beaconkv.eval.summary import write_summary

    good = {"benchmark": "b", "problem_id": "1", "sample_idx": 0, "policy": "p", "budget": 8, "correct": True,
            "new_tokens": 3, "peak_cache_tokens": 9, "evictions": 0, "finish_reason": "stop", "seconds": 0.5}
    bad = {**good, "sample_idx": 1, "correct": "yes"}
    (tmp_path / "b__p__b8.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(ResultsFileError, match=r"b__p__b8\.jsonl:2: the record's 'correct' is \"yes\" \(a string\), not a boolean"):
        write_summary(tmp_path)


def test_a_malformed_results_file_stops_the_cli_in_one_line(tmp_path, data, monkeypatch, capsys) -> None:
    use_model(monkeypatch, FakeEngines())
    out = tmp_path / "out"
    out.mkdir()
    (out / f"{STEM}.jsonl").write_bytes(b'{"benchmark": "aime24", "problem_id": ["60"], "sample_idx": 0}\n')
    assert main(cli(out, data)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("beaconkv eval: error: ") and f"{STEM}.jsonl:1: " in err[0]


class CountingReader(io.BytesIO):
    """A file that counts the bytes read from it."""

    read_bytes = 0

    def read(self, size: int | None = -1) -> bytes:  # type: ignore[override]
        data = super().read(size)
        self.read_bytes += len(data)
        return data


@pytest.mark.parametrize("newline", [b"", b"\n"])
def test_the_tail_scan_reads_each_byte_of_a_long_torn_line_once(newline: bytes) -> None:
    # a 40 MB torn line took 14.5 s: the scan joined the blocks it had read at every step
    tail = b'{"benchmark": "b", "text": "' + b"x" * (8 << 20) + newline
    body = record(1) + tail
    f = CountingReader(body)
    assert jsonl._torn_tail_start(f, len(body)) == len(record(1))
    assert f.read_bytes <= 2 * len(tail) + 2 * jsonl._BLOCK, f.read_bytes


def test_a_line_longer_than_any_record_is_torn_and_never_held(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(jsonl, "MAX_RECORD_BYTES", 1000)
    path = tmp_path / "r.jsonl"
    path.write_bytes(record(1) + b"[" * 5000 + b"\n")
    with pytest.warns(UserWarning, match="ignoring a torn last line"):
        assert [r["problem_id"] for r in read_jsonl_records(path)] == ["1"]
    with pytest.warns(UserWarning):
        assert set_aside_torn_tail(path) == 5001
    path.write_bytes(record(1) + b"[" * 5000 + b"\n" + record(2))
    with pytest.raises(ResultsFileError, match=r"r\.jsonl:2: a line of more than 1000 bytes"):
        read_jsonl_records(path)
