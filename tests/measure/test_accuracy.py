"""The accuracy suite: deterministic tasks, grading, intervals, cells, the runner's protocols, resume, report, CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from beaconkv.measure.accuracy import suite as suite_module
from beaconkv.measure.accuracy.cli import QUICK, add_accuracy_arguments, config_from_args
from beaconkv.measure.accuracy.report import markdown_report, plot_accuracy
from beaconkv.measure.accuracy.runner import kv_bytes_per_slot, run_cases
from beaconkv.measure.accuracy.suite import AccuracyError, SuiteConfig, cells_of, run_suite, summarize, wilson
from beaconkv.measure.accuracy.tasks import TASKS, grade, make_cases, tokenize_case
from beaconkv.policies import make_policy

pytestmark = pytest.mark.usefixtures("one_thread")


def words(text: str) -> int:
    return len(text.split())


def test_cases_are_deterministic_sized_and_hold_their_answers() -> None:
    for task in TASKS:
        a, b = make_cases(task, 300, 12, words, seed=7), make_cases(task, 300, 12, words, seed=7)
        assert a == b
        assert make_cases(task, 300, 12, words, seed=8) != a
        assert [c.depth for c in a[:10]] == pytest.approx([(i + 0.5) / 10 for i in range(10)])
        for case in a:
            if task == "decode_needle":
                assert case.answers[0] in case.context and words(case.decode) >= 300
            else:
                assert all(answer in case.context for answer in case.answers)
                assert 300 <= words(case.context) <= 360  # the filler is sized in (here: word) tokens
    with pytest.raises(ValueError, match="unknown"):
        make_cases("haystack", 100, 1, words)


def test_a_needle_sits_at_its_depth() -> None:
    for case in make_cases("passkey", 2000, 10, words):
        at = case.context.index(f"The pass key is {case.answers[0]}") / len(case.context)
        assert abs(at - case.depth) < 0.06, (at, case.depth)


def test_tokenize_keeps_the_decode_length_exactly() -> None:
    case = make_cases("decode_needle", 50, 1, words)[0]
    ids = tokenize_case(case, lambda s: list(range(len(s.split()))), lambda s: [1, *range(len(s.split()))], 50)
    assert len(ids.decode_ids) == 50 and ids.context_ids[0] == 1
    with pytest.raises(ValueError, match="decode tokens < 500"):
        tokenize_case(case, lambda s: list(range(len(s.split()))), lambda s: [1], 500)


def test_grade_needs_every_answer() -> None:
    assert grade(" 12345. The pass key", ["12345"])
    assert not grade(" 1234. The pass key", ["12345"])
    assert grade(": 1, 22, 333", ["333", "1", "22"]) and not grade(": 1, 22", ["333", "1", "22"])


def test_wilson_interval() -> None:
    lo, hi = wilson(10, 10)
    assert hi == 1.0 and 0.69 < lo < 0.73  # the textbook value: 0.722
    lo, hi = wilson(0, 50)
    assert lo == 0.0 and 0.06 < hi < 0.08
    lo, hi = wilson(25, 50)
    assert lo < 0.5 < hi and hi - 0.5 == pytest.approx(0.5 - lo)
    assert all(math.isnan(x) for x in wilson(0, 0))


def test_cells_translate_compressions_into_budgets() -> None:
    cfg = SuiteConfig(tasks=("passkey", "decode_needle"), lengths=(1024,), decode_lengths=(512,), compressions=(4, 8),
                      policies=("full", "snapkv"), compare=("snapkv", "none"))
    cells = cells_of(cfg)
    keys = {(c.engine, c.task, c.protocol, c.policy, c.budget) for c in cells}
    assert ("beaconkv", "passkey", "aware", "snapkv", 256) in keys and ("beaconkv", "passkey", "agnostic", "snapkv", 128) in keys
    assert ("beaconkv", "decode_needle", "decode", "snapkv", round((512 + 48) / 4)) in keys
    assert ("kvpress", "passkey", "aware", "none", None) in keys and ("kvpress", "passkey", "aware", "snapkv", 256) in keys
    assert sum(c.policy == "full" for c in cells) == 3  # once per task/length/protocol
    with pytest.raises(AccuracyError, match="compressions"):
        SuiteConfig(compressions=(1,))
    with pytest.raises(AccuracyError, match="unknown tasks"):
        SuiteConfig(tasks=("nope",))


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    import beaconkv

    return beaconkv.load_model(tiny_checkpoint), beaconkv.load_tokenizer(tiny_checkpoint)


def tiny_cases(tok, task: str, length: int, n: int = 4):
    cases = make_cases(task, length, n, lambda s: len(tok.encode(s)))
    decode = length if task == "decode_needle" else 0
    return [tokenize_case(c, tok.encode, tok.encode_prompt, decode) for c in cases]


@pytest.mark.parametrize("protocol", ["aware", "agnostic"])
def test_the_runner_bounds_memory_and_reports_every_case(tiny, protocol: str) -> None:
    model, tok = tiny
    cases = tiny_cases(tok, "passkey", 200)
    full = run_cases(model, tok.decode, None, cases, protocol, batch=3)
    policy = make_policy("snapkv", budget=48, n_prefix=4, n_recent=4)
    small = run_cases(model, tok.decode, policy, cases, protocol, batch=3)
    chunked = run_cases(model, tok.decode, policy, cases, protocol, batch=3, prefill_chunk=32)
    assert [o.index for o in full] == [0, 1, 2, 3]
    per_slot = kv_bytes_per_slot(model)
    for f, s, c, case in zip(full, small, chunked, cases):
        assert f.slots == f.prompt_tokens + (0 if protocol == "aware" else len(case.question_ids)) + 10
        assert f.evictions == 0 and s.evictions >= 1 and c.evictions >= 3
        assert s.slots >= s.prompt_tokens  # the whole prompt is held during a whole prefill
        assert c.slots <= 4 + 48 + 32 + (0 if protocol == "aware" else len(case.question_ids))
        assert c.kv_bytes == c.slots * per_slot
        assert f.prefill_s > 0 and f.decode_s > 0


def test_the_decode_protocol_teacher_forces_the_decode(tiny) -> None:
    model, tok = tiny
    cases = tiny_cases(tok, "decode_needle", 120, n=2)
    policy = make_policy("streaming", budget=40, n_prefix=4, n_recent=4)
    out = run_cases(model, tok.decode, policy, cases, "decode", batch=2)
    assert all(o.evictions >= 10 for o in out)  # the decode steps evicted every ~5 tokens
    assert all(o.slots <= 4 + 40 + len(c.question_ids) for o, c in zip(out, cases))
    with pytest.raises(ValueError, match="protocol='sideways'"):
        run_cases(model, tok.decode, policy, cases, "sideways")


def test_the_suite_resumes_refuses_other_settings_and_reports(tiny_checkpoint, tmp_path: Path) -> None:
    cfg = SuiteConfig(tasks=("passkey",), lengths=(120,), compressions=(4,), policies=("full", "streaming"),
                      protocols=("agnostic",), cases=2, batch=2, model=str(tiny_checkpoint))
    first = list(run_suite(cfg, tmp_path, progress=False))
    assert [r["cell"]["policy"] for r in first] == ["full", "streaming"]
    assert list(run_suite(cfg, tmp_path, progress=False)) == []  # resumed: nothing left
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    (tmp_path / "results.jsonl").write_text(lines[0] + "\n" + lines[1][:40])  # a torn last cell runs again
    with pytest.warns(UserWarning, match="torn last line"):
        again = list(run_suite(cfg, tmp_path, progress=False))
    assert [r["cell"]["policy"] for r in again] == ["streaming"]
    with pytest.raises(AccuracyError, match="other settings"):
        list(run_suite(SuiteConfig(**{**cfg.__dict__, "cases": 3}), tmp_path, progress=False))
    rows = summarize(list(suite_module.load_records(tmp_path).values()))
    assert {r["policy"] for r in rows} == {"full", "streaming"} and all(r["n"] == 2 for r in rows)
    text = markdown_report(rows)
    assert "### passkey, agnostic" in text and "| FullKV |" in text and "| streaming |" in text
    assert plot_accuracy(rows, tmp_path / "a.png").stat().st_size > 1000
    alone = markdown_report([r for r in rows if r["policy"] == "full"])  # a FullKV-only cell: its column shown
    assert "| policy | 120 / 1x |" in alone and "| FullKV | " + _pct_of(rows, "full") + " |" in alone


def _pct_of(rows, policy):
    row = next(r for r in rows if r["policy"] == policy)
    return f"{100 * row['accuracy']:.0f} [{100 * row['lo']:.0f}-{100 * row['hi']:.0f}]"


def test_cli_options_make_the_config() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_accuracy_arguments(parser)
    cfg = config_from_args(parser.parse_args(["--quick", "--cases", "3", "--compare", "kvpress:snapkv,none",
                                              "--prefill-chunk", "256"]))
    assert cfg.tasks == QUICK["tasks"] and cfg.cases == 3 and cfg.compare == ("snapkv", "none")
    assert cfg.prefill_chunk == 256 and json.dumps(cfg.settings())
    with pytest.raises(ValueError, match="kvpress:PRESS"):
        config_from_args(parser.parse_args(["--compare", "snapkv"]))
    with pytest.raises(ValueError, match="unknown kvpress presses"):
        config_from_args(parser.parse_args(["--compare", "kvpress:h2o"]))


@pytest.mark.long
def test_the_quick_suite_runs_from_the_command_line(tmp_path: Path, capsys) -> None:
    # the embedded model; make test-long runs it (a few minutes on two cores)
    from beaconkv.cli import main

    assert main(["accuracy", "--quick", "--out", str(tmp_path), "--no-progress", "--threads", "2"]) == 0
    out = capsys.readouterr().out
    assert "### passkey, aware" in out and "### decode_needle, decode" in out
    rows = json.loads((tmp_path / "summary.json").read_text())
    full = [r for r in rows if r["policy"] == "full"]
    assert len(full) == 3 and all(r["accuracy"] >= 0.9 for r in full), full  # FullKV answers these
    assert (tmp_path / "accuracy.png").exists()


def test_kvpress_settings_translate_a_cell_to_the_same_kept_count() -> None:
    from beaconkv.measure.accuracy.compare import kvpress_settings
    from beaconkv.measure.accuracy.suite import Cell
    from beaconkv.measure.accuracy.tasks import Case, TokenizedCase

    case = TokenizedCase(Case("passkey", 0, 1000, 0.5, "", "", "", ("1",), 10), tuple(range(1000)), (), tuple(range(12)))
    reference = make_policy("beacon", budget=256, n_prefix=4)
    aware = kvpress_settings(Cell("kvpress", "passkey", 1000, "aware", "snapkv", 256, 4.0), reference, case)
    assert aware["mode"] == "prefill" and int(1012 * (1 - aware["compression_ratio"])) == 4 + 224
    agnostic = kvpress_settings(Cell("kvpress", "passkey", 1000, "agnostic", "snapkv", 256, 4.0), reference, case)
    assert int(1000 * (1 - agnostic["compression_ratio"])) == 4 + 224
    decoding = TokenizedCase(case.case, tuple(range(40)), tuple(range(500)), tuple(range(12)))
    dec = kvpress_settings(Cell("kvpress", "decode_needle", 500, "decode", "snapkv", 256, 4.0), reference, decoding)
    assert dec["decode"] == {"compression_interval": 32, "target_size": 4 + 224}
    assert dec["press_kwargs"] == {"window_size": 31}  # kvpress needs its window inside the interval
    none = kvpress_settings(Cell("kvpress", "decode_needle", 500, "decode", "none", None, None), None, decoding)
    assert none["decode"] is None and none["compression_ratio"] == 0.0
