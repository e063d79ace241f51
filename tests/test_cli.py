"""The command line: generate (embedded model by default, policies) and demo end to end, options, one-line errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

import beaconkv
from beaconkv import cli
from beaconkv.arguments import policy_from_args, thread_hint
from beaconkv.cli import main
from beaconkv.measure import demo


def test_generate_with_embedded_model_and_policy(capsys):
    rc = main(["generate", "--prompt", "What is the capital of France?", "--max-new-tokens", "6",
               "--policy", "beacon", "--budget", "128"])
    out = capsys.readouterr()
    assert rc == 0
    assert "BeaconKV(budget=128" in out.err and "new tokens [6]" in out.err
    assert out.out.strip()  # streamed text


def test_generate_batch_of_prompts(tiny_models, capsys):
    rc = main(["generate", "--prompt", "one", "--prompt", "a longer second prompt", "--max-new-tokens", "3"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "--- [0] ---" in out and "--- [1] ---" in out


# ----------------------------------------------------------------------------------------- helpers
@pytest.fixture
def restore_threads():
    """``--threads`` sets torch's global thread count: put it back after the test."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _one_line_error(rc: int, err: str, command: str, *fragments: str) -> str:
    """Exit 2 and exactly one ``beaconkv <command>: error:`` line on stderr holding every fragment."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, err
    assert len(lines) == 1, f"expected one line, got:\n{err}"
    assert lines[0].startswith(f"beaconkv {command}: error: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
    return lines[0]


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test if ``generate``/``demo`` would load a model or a tokenizer (or even locate one)."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the settings were checked")

    for module in (cli, demo):
        for name in ("load_model", "load_tokenizer", "model_path"):
            monkeypatch.setattr(module, name, refuse)


# -------------------------------------------------------------------------------------------- demo
@pytest.mark.parametrize("policy,label", [("beacon", "BeaconKV(budget=16)"), ("snapkv", "SnapKV(budget=16)")])
def test_demo_prints_fullkv_and_the_policy_side_by_side(policy, label, capsys):
    rc = main(["demo", "--no-compile", "--max-new-tokens", "24", "--policy", policy, "--budget", "16",
               "--n-recent", "2"])
    out = capsys.readouterr().out
    assert rc == 0
    header = next(line for line in out.splitlines() if "FullKV" in line and label in line)
    assert header.index("FullKV") < header.index(label)
    rows = {line.split("  ")[0]: line.split()[-2:] for line in out.splitlines() if "  " in line}
    full_evictions, beacon_evictions = map(int, rows["evictions"])
    assert full_evictions == 0 and beacon_evictions > 0
    assert "KV cache memory" in rows and "MiB" in out and "decode tokens/s (eager)" in out
    assert "tokens same as FullKV" in out and "final answers match" in out
    assert "not a reasoner" in out  # the small model's answers are not sold as correct


def test_demo_defaults_evict_many_times_and_compile():
    args = cli.build_parser().parse_args(["demo"])
    assert (args.policy, args.budget, args.n_recent) == ("beacon", None, None)  # the shared defaults: beacon, auto
    assert args.compile and args.ignore_eos and args.max_new_tokens >= 300
    policy = policy_from_args(args, demo.DEMO_DEFAULTS["budget"])  # budget - floor(7/8 budget) >= n_recent
    assert (type(policy).__name__, policy.budget, policy.n_recent) == ("BeaconKV", 64, 8)
    assert (args.max_new_tokens - 1) // (policy.budget - policy.budget * 7 // 8) >= 30  # evictions, at least


def test_demo_compiled_announces_the_compile_and_remembers_its_time(tiny_checkpoint, capsys, monkeypatch, tmp_path,
                                                                    restore_threads):
    monkeypatch.setenv("BEACONKV_CACHE", str(tmp_path))
    monkeypatch.setattr(demo, "_inductor_cache_state", lambda: "cold")
    argv = ["demo", "--model", str(tiny_checkpoint), "--prompt", "a b c d e f", "--raw", "--threads", "1",
            "--compile-backend", "aot_eager", "--max-new-tokens", "24", "--budget", "16", "--n-recent", "2"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert re.search(r"compiling the decode step \(once, ~\d+ s\)…", captured.err), captured.err
    assert "decode tokens/s (compiled, aot_eager)" in captured.out
    assert re.search(r"\[decode step compiled in \d+ s\]", captured.err), captured.err
    compile_row = re.search(r"compile seconds \(once\) +(\d+\.\d) +(\d+\.\d)", captured.out)
    assert compile_row and all(float(x) > 0 for x in compile_row.groups()), captured.out  # apart from tokens/s
    times = json.loads((tmp_path / "demo-compile-times.json").read_text())
    assert any(k.startswith("decode ") for k in times) and all(v >= 0 for v in times.values())
    estimate = demo.compile_estimate(cli.build_parser().parse_args(argv), "decode")
    assert estimate in times.values()  # the next run announces the time measured here
    # FullKV's larger cache compiles another graph: a RecompileWarning, summarised in one line, never raw
    assert "Warning:" not in captured.err and "warnings.warn" not in captured.err, captured.err
    notes = [line for line in captured.err.splitlines() if line.startswith("note: ")]
    assert len(notes) == 1 and "RecompileWarning" in notes[0], captured.err
    assert "beaconkv: compiling" not in captured.err  # the demo announces its compiles itself


def test_the_demo_summarises_warnings_in_one_line():
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.warn("another graph of decode_and_sample\nsecond line", UserWarning)
        warnings.warn("x", DeprecationWarning)
        warnings.warn("y", UserWarning)
    line = demo.warnings_summary(caught)
    assert line == "note: 2 UserWarning, 1 DeprecationWarning while it ran (first: another graph of decode_and_sample)"
    assert demo.warnings_summary([]) is None


def test_old_demo_names_in_cli_warn_and_still_work():
    with pytest.warns(DeprecationWarning, match="beaconkv.measure.demo.final_answer"):
        assert cli.final_answer("The answer is 7.") == "7"
    with pytest.raises(AttributeError):
        cli.no_such_name  # noqa: B018


def test_final_answer_and_token_agreement():
    assert demo.final_answer("so 17 - 8 = 9.\nThe final answer is 9.") == "9"
    assert demo.final_answer("The answer is \\boxed{42}.") == "42"
    assert demo.final_answer("1. First we count 17 sheep", finished=False) is None
    assert demo.final_answer("We get 1,234 sheep") == "1234"
    assert demo.token_agreement([1, 2, 3, 4], [1, 2, 3, 4]) == (1.0, None)
    assert demo.token_agreement([1, 2, 3, 4], [1, 2, 9, 4]) == (0.75, 2)


# --------------------------------------------------------------------------------- generate options
def test_generate_threads_and_compile_parse_and_work(tiny_checkpoint, capsys, restore_threads):
    rc = main(["generate", "--model", str(tiny_checkpoint), "--prompt", "a b c", "--raw", "--max-new-tokens", "4",
               "--ignore-eos", "--threads", "1", "--compile", "--compile-backend", "aot_eager"])
    err = capsys.readouterr().err
    assert rc == 0 and torch.get_num_threads() == 1
    assert "new tokens [4]" in err and "compiled, aot_eager, compile time not counted" in err
    assert float(re.search(r"compile (\d+\.\d+)s", err).group(1)) > 0, err


def test_every_compile_says_so_once_with_its_seconds(tiny_checkpoint, capsys, restore_threads):
    rc = main(["generate", "--model", str(tiny_checkpoint), "--prompt", "a b c", "--raw", "--max-new-tokens", "3",
               "--ignore-eos", "--threads", "1", "--compile", "--compile-backend", "aot_eager",
               "--policy", "full"])
    err = capsys.readouterr().err
    started = re.findall(r"^beaconkv: compiling (.+)…$", err, flags=re.MULTILINE)
    ended = re.findall(r"^beaconkv: compiled (.+) in (\d+\.\d) s$", err, flags=re.MULTILINE)
    assert rc == 0 and started and [what for what, _ in ended] == started, err
    assert any(what.startswith("the decode step (") for what in started), err


def test_tokens_per_s_is_never_nan():
    assert demo.rate_text(float("nan"), " tokens/s") == "too short to time"
    assert demo.rate_text(0.0) == "too short to time" and demo.rate_text(float("inf")) == "too short to time"
    assert demo.rate_text(12.345, " tokens/s") == "12.3 tokens/s"


def test_one_new_token_prints_no_nan(tiny_checkpoint, capsys, restore_threads):
    assert main(["generate", "--model", str(tiny_checkpoint), "--prompt", "a b", "--raw", "--max-new-tokens", "1",
                 "--threads", "1"]) == 0
    err = capsys.readouterr().err
    assert "new tokens [1]" in err and "nan" not in err.lower(), err


def test_the_thread_hint_names_the_free_cores():
    hint = thread_hint(8, cores=2, load=1.2)
    assert hint is not None and "--threads 1" in hint and "8 threads" in hint and "\n" not in hint
    assert thread_hint(4, cores=8, load=2.0) is None  # six cores free
    assert thread_hint(1, cores=2, load=7.0) is None  # one thread always fits
    assert "--threads 3" in thread_hint(4, cores=4, load=0.6)


def test_generate_compile_is_off_by_default():
    args = cli.build_parser().parse_args(["generate", "--prompt", "x"])
    assert args.compile is False and args.threads is None and args.ignore_eos is False


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"beaconkv {beaconkv.__version__}"


# ------------------------------------------------------------------------------------ user errors
@pytest.mark.parametrize("command", ["generate", "demo"])
def test_unknown_policy_fails_before_loading(command, capsys, no_model):
    rc = main([command, "--prompt", "x", "--policy", "beacn"])
    _one_line_error(rc, capsys.readouterr().err, command, "policy='beacn' is unknown", "did you mean 'beacon'")


def test_budget_too_small_for_n_recent_fails_before_loading(capsys, no_model):
    rc = main(["generate", "--prompt", "x", "--policy", "beacon", "--budget", "64", "--n-recent", "16"])
    _one_line_error(rc, capsys.readouterr().err, "generate", "budget=64", "n_recent=16", "budget >= 128",
                    "smaller n_recent")


@pytest.mark.parametrize("option,value,fragment", [
    ("--temperature", "nan", "temperature=nan"), ("--temperature", "inf", "temperature=inf"),
    ("--temperature", "-0.5", "temperature=-0.5"), ("--top-p", "nan", "top_p=nan"), ("--top-k", "-1", "top_k=-1"),
])
def test_bad_sampling_fails_before_loading(option, value, fragment, capsys, no_model):
    rc = main(["generate", "--prompt", "x", option, value])
    _one_line_error(rc, capsys.readouterr().err, "generate", fragment)


@pytest.mark.parametrize("command", ["generate", "demo"])
def test_float8_dtype_fails_before_loading(command, capsys, no_model):
    rc = main([command, "--prompt", "x", "--dtype", "float8"])
    _one_line_error(rc, capsys.readouterr().err, command, "'float8'", "float32, bfloat16 or float16")


def test_missing_model_path(capsys, tmp_path):
    missing = tmp_path / "no-such-checkpoint"
    rc = main(["generate", "--prompt", "x", "--model", str(missing)])
    _one_line_error(rc, capsys.readouterr().err, "generate", str(missing), "does not exist", "config.json")


def test_offline_hub_id_is_one_line_without_traceback(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    proc = subprocess.run([sys.executable, "-m", "beaconkv.cli", "generate", "--model", "someone/nonexistent-model",
                           "--prompt", "x"], env=env, capture_output=True, text=True, timeout=120)
    assert "Traceback" not in proc.stderr
    _one_line_error(proc.returncode, proc.stderr, "generate", "'someone/nonexistent-model'", "HF_HUB_OFFLINE")


def test_broken_config_json_names_the_file(capsys, tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": 64,')
    rc = main(["generate", "--prompt", "x", "--model", str(tmp_path)])
    _one_line_error(rc, capsys.readouterr().err, "generate", str(tmp_path / "config.json"), "not valid JSON")


def test_argparse_errors_are_one_line_too(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--max-new-tokens", "3"])  # --prompt is required
    _one_line_error(exit_.value.code, capsys.readouterr().err, "generate", "--prompt", "--help")


@pytest.mark.parametrize("command,extra", [
    ("generate", ["--prompt", "x"]), ("demo", []), ("fidelity", ["--num-traces", "1"]), ("analyze", []),
    ("bench", ["--quick"]), ("eval", ["--benchmark", "aime24", "--limit", "1"]),
])
def test_every_command_reports_a_missing_model_in_one_line(command, extra, capsys, tmp_path):
    out = tmp_path / "out"
    missing = tmp_path / "no-such-checkpoint"
    argv = [command, "--model", str(missing), *extra]
    if command in ("fidelity", "bench", "eval", "analyze"):
        argv += ["--out", str(out)]
    rc = main(argv)
    _one_line_error(rc, capsys.readouterr().err, command, str(missing))
    assert not out.exists(), "an --out folder was left behind"


def test_generate_prefill_chunk_bounds_the_cache(tiny_checkpoint, capsys, restore_threads):
    prompt = " ".join("abcdefghijklmnopqrstuvwxyz"[i % 26] for i in range(90))
    argv = ["generate", "--model", str(tiny_checkpoint), "--prompt", prompt, "--raw", "--max-new-tokens", "4",
            "--ignore-eos", "--threads", "1", "--budget", "32", "--n-recent", "4", "--policy-arg", "n_prefix=2"]
    assert main(argv) == 0
    whole = int(re.search(r"cache capacity (\d+) slots", capsys.readouterr().err).group(1))
    assert main([*argv, "--prefill-chunk", "16"]) == 0
    err = capsys.readouterr().err
    chunked = int(re.search(r"cache capacity (\d+) slots", err).group(1))
    assert whole >= 90 and chunked <= 2 + 32 + 16, (whole, chunked)
    assert re.search(r"evictions \[[1-9]", err)
    with pytest.raises(SystemExit):
        main([*argv, "--prefill-chunk", "0"])
