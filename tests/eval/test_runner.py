"""The evaluation loop with a fake engine: records, resume, continuous batching, sharding + merge, summary, CLI."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from beaconkv.eval import runner, sandbox
from beaconkv.eval.backend import GenerationBackend
from beaconkv.eval.benchmarks import CodeTest, Problem
from beaconkv.eval.cli import add_eval_arguments, config_from_args, run_eval_from_args
from beaconkv.eval.config import EvalConfig
from beaconkv.eval.distributed import DistContext
from beaconkv.eval.errors import ResultsConflictError
from beaconkv.eval.runner import plan_samples, run_eval
from beaconkv.eval.sandbox import SandboxUnavailable
from beaconkv.eval.seeds import derive_seed
from beaconkv.eval.summary import summarize
from beaconkv.policies import BeaconKV

from .fakes import PROBLEMS, FakeEngines, Tok, read, strip_timing


def config(out: Path, **kw) -> EvalConfig:
    base = dict(
        model="fake", benchmark="aime24", policy="full", samples=3, max_new_tokens=4,
        out_dir=out, progress=False, save_token_ids=True,
    )  # fmt: skip
    base.update(kw)
    return EvalConfig(**base)


def test_plan_samples_do_not_depend_on_ranks() -> None:
    planned = plan_samples(PROBLEMS, samples=5)
    assert [(s.index, s.problem.id, s.sample_idx) for s in planned[3:7]] == [
        (3, "60", 3), (4, "60", 4), (5, "61", 0), (6, "61", 1)
    ]  # fmt: skip
    assert len(planned) == 15 and [s.index for s in planned] == list(range(15))
    assert planned[6].seed(7) == derive_seed("sample", 7, "61", 1)


def test_records_and_summary(tmp_path: Path) -> None:
    gen = FakeEngines()
    report = run_eval(config(tmp_path), backend=GenerationBackend(Tok(), gen), problems=PROBLEMS)
    records = read(report.results_file)
    assert report.results_file.name == "aime24__full.jsonl"
    assert [(r["problem_id"], r["sample_idx"]) for r in records] == [
        (pid, i) for pid in ("9", "60", "61") for i in range(3)
    ]  # sorted by problem id numerically
    first = records[0]
    for field in ("answer", "correct", "new_tokens", "peak_cache_tokens", "evictions", "seconds", "seed", "text"):
        assert field in first
    assert first["budget"] is None and first["finish_reason"] == "length" and len(first["token_ids"]) == 4
    # every sample is one request of ONE engine of max_batch slots, with its own seed
    (engine,) = gen.engines
    assert engine["max_batch"] == 8 and engine["max_new_tokens"] == 4 and engine["setup"].compile is False
    assert engine["prompt_capacity"] == max(r["prompt_tokens"] for r in records)
    assert len(gen.calls) == 9 and sorted(c["seed"] for c in gen.calls) == sorted(r["seed"] for r in records)
    assert all(r["seed"] == derive_seed("sample", 0, r["problem_id"], r["sample_idx"]) for r in records)
    assert (first["evictions"], first["peak_cache_tokens"], first["cache_capacity"]) == (1, 40, 64)
    assert first["seconds"] > 0 and "batch_size" not in first
    assert all(c["policy"] is None for c in gen.calls)
    expected = 100 * sum(r["correct"] for r in records) / 9
    (row,) = report.rows
    assert row.pass_at_1 == pytest.approx(expected)
    assert (row.problems, row.samples, row.truncated) == (3, 9, 1.0)
    assert "| aime24 | full | - | 3 | 9 |" in report.table
    assert (tmp_path / "summary.md").read_text().strip() == report.table
    assert json.loads((tmp_path / "summary.json").read_text())[0]["samples"] == 9


def test_resume_after_a_crash_skips_finished_samples(tmp_path: Path) -> None:
    full = run_eval(config(tmp_path / "a"), backend=GenerationBackend(Tok(), FakeEngines()), problems=PROBLEMS)
    crashing = FakeEngines(fail_after=4)
    with pytest.raises(KeyboardInterrupt):
        run_eval(config(tmp_path / "b"), backend=GenerationBackend(Tok(), crashing), problems=PROBLEMS)
    assert len(read(tmp_path / "b" / "aime24__full.rank0.jsonl")) == 4
    resumed_gen = FakeEngines()
    report = run_eval(config(tmp_path / "b"), backend=GenerationBackend(Tok(), resumed_gen), problems=PROBLEMS)
    assert (report.generated, report.skipped) == (5, 4) and len(resumed_gen.calls) == 5
    assert not (tmp_path / "b" / "aime24__full.rank0.jsonl").exists()
    assert strip_timing(read(report.results_file)) == strip_timing(read(full.results_file))
    again = FakeEngines()
    report = run_eval(config(tmp_path / "b"), backend=GenerationBackend(Tok(), again), problems=PROBLEMS)
    assert (report.generated, report.skipped, len(again.calls)) == (0, 9, 0)


def test_finished_run_does_not_load_the_model(tmp_path: Path, monkeypatch) -> None:
    run_eval(config(tmp_path), backend=GenerationBackend(Tok(), FakeEngines()), problems=PROBLEMS)

    def no_load(*args, **kwargs):
        raise AssertionError("model loaded although every sample is done")

    monkeypatch.setattr(runner, "load_backend", no_load)
    assert run_eval(config(tmp_path), problems=PROBLEMS).generated == 0


def test_other_settings_are_refused(tmp_path: Path) -> None:
    backend = GenerationBackend(Tok(), FakeEngines())
    run_eval(config(tmp_path), backend=backend, problems=PROBLEMS[:1])
    with pytest.raises(ResultsConflictError, match="temperature"):
        run_eval(config(tmp_path, temperature=1.0), backend=backend, problems=PROBLEMS[:1])


@pytest.mark.parametrize("max_batch", [1, 2])
def test_sharded_run_equals_single_run(tmp_path: Path, monkeypatch, max_batch: int) -> None:
    single = run_eval(
        config(tmp_path / "single", max_batch=max_batch),
        backend=GenerationBackend(Tok(), FakeEngines()),
        problems=PROBLEMS,
    )
    monkeypatch.setattr(runner, "barrier", lambda ctx: None)
    seen_calls = []
    for rank in (1, 0):  # rank 1 finishes first; rank 0 merges
        monkeypatch.setattr(runner, "init_distributed", lambda device, timeout_min, r=rank: DistContext(r, 2))
        gen = FakeEngines()
        report = run_eval(
            config(tmp_path / "sharded", max_batch=max_batch),
            backend=GenerationBackend(Tok(), gen),
            problems=PROBLEMS,
        )
        seen_calls.append(len(gen.calls))
    assert sum(seen_calls) == len(plan_samples(PROBLEMS, 3)) == 9
    assert report.rank == 0 and report.rows
    assert list((tmp_path / "sharded").glob("*.rank*.jsonl")) == []
    assert strip_timing(read(report.results_file)) == strip_timing(read(single.results_file))


LONG_AND_SHORT = (40, 3, 5, 2)  # new tokens of samples 0..3 of problem 60: sample 0 is a long chain of thought


def long_and_short(**kw) -> FakeEngines:
    """A fake whose samples of problem 60 (base seed 0) end after LONG_AND_SHORT tokens."""
    return FakeEngines(lengths={derive_seed("sample", 0, "60", i): n for i, n in enumerate(LONG_AND_SHORT)}, **kw)


def sample_of(seed: int) -> int:
    return next(i for i in range(4) if derive_seed("sample", 0, "60", i) == seed)


def test_a_long_sample_does_not_hold_back_the_others(tmp_path: Path) -> None:
    cfg = config(tmp_path, samples=4, max_batch=2, max_new_tokens=40)
    gen = long_and_short()
    report = run_eval(cfg, backend=GenerationBackend(Tok(), gen), problems=PROBLEMS[:1])
    # samples 1, 2, 3 flow through the second slot while sample 0 holds the first
    assert [sample_of(c["seed"]) for c in gen.calls] == [1, 2, 3, 0]
    assert gen.peak_running == 2 and len(gen.engines) == 1
    records = read(report.results_file)
    assert [(r["sample_idx"], r["new_tokens"]) for r in records] == list(enumerate(LONG_AND_SHORT))
    assert [r["finish_reason"] for r in records] == ["length", "stop", "stop", "stop"]


def test_finished_samples_are_on_disk_while_a_long_one_runs(tmp_path: Path) -> None:
    cfg = config(tmp_path, samples=4, max_batch=2, max_new_tokens=40)
    part = tmp_path / "aime24__full.rank0.jsonl"
    on_disk: list[list[int]] = []  # the part file's sample indices at every step

    def watch(engine) -> None:
        on_disk.append([r["sample_idx"] for r in read(part)] if part.stat().st_size else [])
        if len(on_disk[-1]) == 3:  # kill the run while sample 0 is still generating
            running = [sample_of(r.request.seed) for r in engine.slots if r is not None]
            assert running == [0] and engine.slots[0].produced < LONG_AND_SHORT[0] // 2
            raise KeyboardInterrupt("simulated kill")

    with pytest.raises(KeyboardInterrupt):
        run_eval(cfg, backend=GenerationBackend(Tok(), long_and_short(on_step=watch)), problems=PROBLEMS[:1])
    # each record is on disk by the next step after its sample finished (at steps 3, 8 and 10), in
    # completion order, while sample 0 keeps its slot
    assert on_disk == [[]] * 3 + [[1]] * 5 + [[1, 2]] * 2 + [[1, 2, 3]]
    assert [r["sample_idx"] for r in read(part)] == [1, 2, 3]
    resumed = long_and_short()
    report = run_eval(cfg, backend=GenerationBackend(Tok(), resumed), problems=PROBLEMS[:1])
    assert (report.generated, report.skipped) == (1, 3) and [sample_of(c["seed"]) for c in resumed.calls] == [0]
    uninterrupted = run_eval(
        config(tmp_path / "whole", samples=4, max_batch=2, max_new_tokens=40),
        backend=GenerationBackend(Tok(), long_and_short()),
        problems=PROBLEMS[:1],
    )
    assert strip_timing(read(report.results_file)) == strip_timing(read(uninterrupted.results_file))


def test_policy_and_tag_name_the_results_file(tmp_path: Path, monkeypatch) -> None:
    made = []

    def fake_make_policy(name, budget, **kwargs):
        made.append((name, budget, kwargs))
        return object()

    monkeypatch.setattr("beaconkv.eval.config.make_policy", fake_make_policy)
    cfg = config(tmp_path, policy="beacon", budget=256, tag="mean", policy_kwargs={"aggregation": "mean"})
    gen = FakeEngines()
    report = run_eval(cfg, backend=GenerationBackend(Tok(), gen), problems=PROBLEMS[:1])
    assert report.results_file.name == "aime24__beacon-mean__b256.jsonl"
    # a policy holds settings only: made once, before anything is loaded, and shared by every slot
    assert made == [("beacon", 256, {"aggregation": "mean"})]
    assert len(gen.calls) == 3 and len({id(c["policy"]) for c in gen.calls}) == 1
    assert gen.calls[0]["policy"] is not None
    assert read(report.results_file)[0]["budget"] == 256


def test_the_real_policy_object_serves_every_call(tmp_path: Path) -> None:
    gen = FakeEngines()
    cfg = config(tmp_path, policy="beacon", budget=64, policy_kwargs={"n_recent": 8})
    run_eval(cfg, backend=GenerationBackend(Tok(), gen), problems=PROBLEMS[:1])
    policies = {id(c["policy"]) for c in gen.calls}
    assert len(gen.calls) == 3 and len(policies) == 1
    policy = gen.calls[0]["policy"]
    assert isinstance(policy, BeaconKV) and policy.budget == 64 and policy.n_recent == 8


def test_summary_pass_at_1_is_the_mean_over_problems() -> None:
    recs = [
        {"benchmark": "b", "policy": "p", "budget": 1, "problem_id": "1", "correct": c, "new_tokens": 1,
         "peak_cache_tokens": 1, "evictions": 0, "finish_reason": "stop", "seconds": 1.0}
        for c in (True, False)
    ] + [
        {"benchmark": "b", "policy": "p", "budget": 1, "problem_id": "2", "correct": True, "new_tokens": 1,
         "peak_cache_tokens": 1, "evictions": 0, "finish_reason": "stop", "seconds": 1.0}
    ]  # fmt: skip
    (row,) = summarize(recs)
    assert row.pass_at_1 == pytest.approx(75.0)


def test_cli_arguments_build_the_config(tmp_path: Path, monkeypatch, project_data: Path, capsys) -> None:
    parser = add_eval_arguments(argparse.ArgumentParser())
    args = parser.parse_args(
        [
            "--model", "fake", "--benchmark", "aime24", "--data", str(project_data / "aime24.jsonl"),
            "--policy", "beacon", "--samples", "2", "--max-new-tokens", "3", "--limit", "2",
            "--out", str(tmp_path), "--policy-arg", "n_beacon=8", "--policy-arg", "aggregation=max",
            "--field", "choices=A,B", "--no-progress",
        ]
    )  # fmt: skip
    cfg = config_from_args(args)
    assert (cfg.temperature, cfg.top_p, cfg.samples, cfg.limit) == (0.6, 0.95, 2, 2)
    assert cfg.policy_kwargs == {"n_beacon": 8, "aggregation": "max"}
    assert cfg.field_map == {"choices": ["A", "B"]}
    args.policy, args.policy_arg, args.field = "full", [], []  # FullKV takes no n_beacon: an error with it
    monkeypatch.setattr(runner, "load_backend", lambda *a, **k: GenerationBackend(Tok(), FakeEngines()))
    assert run_eval_from_args(args) == 0
    out = capsys.readouterr().out
    assert "| aime24 | full | - | 2 | 4 |" in out
    assert len(read(tmp_path / "aime24__full.jsonl")) == 4


CODE_PROBLEMS = [Problem("livecodebench", "q1", "Read a and b, print a + b.",
                         tests=(CodeTest("1 2\n", "3\n"), CodeTest("5 5\n", "10\n")))]


def test_code_records_and_the_summary_state_the_sandbox_containment(tmp_path: Path) -> None:
    cfg = config(tmp_path, benchmark="livecodebench", samples=4, sandbox="rlimits")
    report = run_eval(cfg, backend=GenerationBackend(Tok(), FakeEngines()), problems=CODE_PROBLEMS)
    records = read(report.results_file)
    assert [r["correct"] for r in records] == [r["seed"] % 2 == 0 for r in records]  # the programs really ran
    assert {r["containment"] for r in records} == {"rlimits-only"}
    (row,) = report.rows
    assert row.containment == "rlimits-only" and "| rlimits-only |" in report.table
    math = run_eval(config(tmp_path / "math"), backend=GenerationBackend(Tok(), FakeEngines()), problems=PROBLEMS)
    assert {r["containment"] for r in read(math.results_file)} == {None} and math.rows[0].containment == ""


def test_a_code_run_refuses_before_generating_where_the_sandbox_cannot_start(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(sandbox.runner, "_namespace_probe", lambda: (False, "unshare: Operation not permitted"))
    gen = FakeEngines()
    with pytest.raises(SandboxUnavailable, match="Operation not permitted.*--sandbox rlimits"):
        run_eval(config(tmp_path, benchmark="livecodebench"), backend=GenerationBackend(Tok(), gen),
                 problems=CODE_PROBLEMS)
    assert gen.engines == [] and not (tmp_path / "livecodebench__full.jsonl").exists()
    with pytest.raises(ValueError, match="sandbox='docker'.*--sandbox with one of namespaces, rlimits"):
        config(tmp_path, sandbox="docker")


def test_one_sample_whose_grader_fails_is_recorded_and_the_run_goes_on(tmp_path: Path, monkeypatch, capsys) -> None:
    # a grader that raises on one response (as grade_code did on a forged result mark): the run
    # records that sample's error, grades the others, and a rerun finds every sample done
    from beaconkv.eval import response_grading

    real = response_grading._grade
    failed: list[str] = []

    def flaky(problem, reference, response, sandbox_limits):
        if problem.id == "61" and not failed:
            failed.append(problem.id)
            raise json.JSONDecodeError("Expecting value", "", 0)
        return real(problem, reference, response, sandbox_limits)

    monkeypatch.setattr(response_grading, "_grade", flaky)
    report = run_eval(config(tmp_path), backend=GenerationBackend(Tok(), FakeEngines()), problems=PROBLEMS)
    records = read(report.results_file)
    assert len(records) == 9
    broken = [r for r in records if r["grade_error"]]
    assert len(broken) == 1 and broken[0]["problem_id"] == "61" and broken[0]["correct"] is False
    assert broken[0]["grade_error"] == "JSONDecodeError: Expecting value: line 1 column 1 (char 0)"
    assert all(r["grade_error"] is None for r in records if r is not broken[0])
    assert report.rows[0].grader_errors == 1 and report.table.splitlines()[-1].endswith("| 1 |")
    again = run_eval(config(tmp_path), backend=GenerationBackend(Tok(), FakeEngines()), problems=PROBLEMS)
    assert (again.generated, again.skipped) == (0, 9)
