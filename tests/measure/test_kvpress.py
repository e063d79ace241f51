"""The kvpress comparator: budget translation, the job and its results through a fake kvpress interpreter, the
driver's protocol run for real on a tiny model with presses that stand in for kvpress's, and (marked ``long``,
where ``make kvpress-venv`` built it) kvpress 0.5.5 itself on the embedded model."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from beaconkv.measure.accuracy import kvpress_driver as driver
from beaconkv.measure.accuracy.kvpress import (
    DRIVER,
    PRESSES,
    KvpressCase,
    KvpressError,
    KvpressResult,
    KvpressUnavailable,
    build_job,
    default_python,
    kvpress_ratio,
    kvpress_versions,
    parse_results,
    run_kvpress,
    tokens_kept_of_prompt,
    unsupported_reason,
)
from beaconkv.policies import FullKV
from beaconkv.policies.config import PolicyConfigError
from beaconkv.policies.registry import make_policy
from beaconkv.session import Session


# ---------------------------------------------------------------------------------------- budgets
def test_ratio_examples() -> None:
    assert kvpress_ratio(256, 1024) == 0.75
    assert kvpress_ratio(10, 10) == 0.0
    assert kvpress_ratio(1, 1) == 0.0


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 200_000).flatmap(lambda n: st.tuples(st.integers(1, n), st.just(n))))
def test_ratio_makes_kvpress_keep_exactly_n_keep(pair) -> None:
    n_keep, context_len = pair
    ratio = kvpress_ratio(n_keep, context_len)
    assert 0.0 <= ratio < 1.0
    # kvpress's compute_n_kept (ScorerPress, AdaKV) and StreamingLLM's int(k_len * (1 - ratio)), after the JSON trip
    ratio = json.loads(json.dumps(ratio))
    assert max(1, int(context_len * (1 - ratio))) == n_keep
    assert abs(ratio - (1 - n_keep / context_len)) < 1e-12


@pytest.mark.parametrize("n_keep,context_len", [(0, 10), (11, 10), (1, 0), (2.0, 10), (True, 10)])
def test_ratio_refuses_counts_outside_the_context(n_keep, context_len) -> None:
    with pytest.raises(KvpressError, match="n_keep|context_len"):
        kvpress_ratio(n_keep, context_len)


def test_tokens_kept_of_prompt_follows_the_policys_schedule() -> None:
    snap = make_policy("snapkv", budget=128, n_prefix=0)  # AtBudget, ratio 7/8: at 128 evictable, down to 112
    assert tokens_kept_of_prompt(snap, 500) == 112
    assert tokens_kept_of_prompt(snap, 128) == 112
    assert tokens_kept_of_prompt(snap, 127) == 127  # under the budget: nothing evicted
    prefixed = make_policy("snapkv", budget=128, n_prefix=100)
    assert tokens_kept_of_prompt(prefixed, 500) == 212  # the protected prefix stays
    assert tokens_kept_of_prompt(prefixed, 220) == 220
    assert tokens_kept_of_prompt(make_policy("snapkv", budget=128), 500) == 500  # n_prefix=None: all protected
    assert tokens_kept_of_prompt(FullKV(), 500) == 500
    assert kvpress_ratio(tokens_kept_of_prompt(snap, 500), 500) == pytest.approx(1 - 112 / 500)
    with pytest.raises(PolicyConfigError, match="n_prefix=100 is longer than a prompt of 50"):
        tokens_kept_of_prompt(prefixed, 50)
    with pytest.raises(KvpressError, match="context_len=0"):
        tokens_kept_of_prompt(snap, 0)


@pytest.mark.parametrize("name,budget,n_prefix,prompt", [("snapkv", 32, 0, 70), ("knorm", 32, 10, 70),
                                                           ("snapkv", 32, 0, 20), ("streaming", 48, 4, 90)])
def test_tokens_kept_of_prompt_is_what_a_real_prefill_keeps(llama, name, budget, n_prefix, prompt) -> None:
    """The count matches the cache of a real session after its prefill (the real path, beaconkv's decoder)."""
    policy = make_policy(name, budget=budget, n_prefix=n_prefix, n_recent=4)
    session = Session.for_prompts(llama, policy, [prompt], 1)
    session.prefill([list(range(3, 3 + prompt))])
    held = (session.cache[0].positions() >= 0).sum(-1)  # (batch, kv_heads): valid slots of layer 0
    assert held.eq(tokens_kept_of_prompt(policy, prompt)).all(), held


def test_unsupported_reasons_name_what_kvpress_cannot_express() -> None:
    assert unsupported_reason("knorm", "prefill", context_len=500) is None
    assert unsupported_reason("tova", "decode", decode={"compression_interval": 16, "target_size": 128}) is None
    assert "batch=4" in unsupported_reason("knorm", "decode", batch=4)
    reason = unsupported_reason("snapkv", "decode", decode={"compression_interval": 16, "target_size": 128})
    assert "window_size=64" in reason and "compression_interval=16" in reason
    assert unsupported_reason("snapkv", "decode", decode={"compression_interval": 16, "target_size": 128},
                              press_kwargs={"window_size": 8}) is None
    assert "not longer than SnapKV's window_size=64" in unsupported_reason("snapkv", "prefill", context_len=64)
    assert "n_sink=4" in unsupported_reason("streaming", "prefill", context_len=4)
    assert "masks pruned keys" in unsupported_reason("adakv-snapkv", "prefill", context_len=500)


# ------------------------------------------------------------------------- the job, a fake kvpress
FAKE_KVPRESS = '''\
import json, os, sys, time
args = sys.argv[1:]
behaviour = os.environ.get("FAKE_KVPRESS", "ok")
seen = {"argv": args, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "PYTHONPATH": os.environ.get("PYTHONPATH")}
if args[-1] == "--versions":
    print(json.dumps({"python": "3.x", "torch": "2.13.0", "transformers": "5.2.0", "kvpress": "0.5.5"}))
    sys.exit(0)
job = json.load(open(args[-2]))
seen["job"] = job
json.dump(seen, open(os.environ["FAKE_KVPRESS_SEEN"], "w"))
if behaviour == "exit":
    print("kvpress exploded: CUDA is not here", file=sys.stderr)
    sys.exit(3)
if behaviour == "sleep":
    time.sleep(60)
if behaviour == "silent":
    sys.exit(0)
lines = []
for case in job["cases"]:
    n = len(case["context_ids"])
    kept = max(1, int(n * (1 - job["compression_ratio"])))
    line = {"id": case["id"], "generated_ids": (case["question_ids"] * 8)[: case["max_new_tokens"]],
            "kv_bytes_after_prefill": kept * 100, "kv_tokens_after_prefill": float(kept),
            "peak_kv_bytes": n * 100, "prefill_s": 0.5, "decode_s": 1, "error": None}
    if case["id"].startswith("bad"):
        line.update(generated_ids=[], kv_bytes_after_prefill=None, kv_tokens_after_prefill=None,
                    peak_kv_bytes=None, prefill_s=None, decode_s=None, error="prefill: AssertionError: too short")
    lines.append(json.dumps(line))
if behaviour == "wrong-id":
    lines[0] = lines[0].replace(job["cases"][0]["id"], "someone-else")
if behaviour == "short":
    lines = lines[:-1]
if behaviour == "garbage":
    lines[-1] = "Traceback (most recent call last):"
if behaviour == "mistyped":
    lines[0] = lines[0].replace('"prefill_s": 0.5', '"prefill_s": "fast"')
open(args[-1], "w").write("\\n".join(lines) + "\\n")
'''


@pytest.fixture
def fake_python(tmp_path, monkeypatch) -> Path:
    """An executable that stands in for kvpress's Python: it records what it was given and answers like the
    driver (the question's ids as the answer, 100 bytes per kept token); FAKE_KVPRESS picks a misbehaviour."""
    exe = tmp_path / "fake-kvpress-python"
    exe.write_text(f"#!{sys.executable}\n{FAKE_KVPRESS}")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("FAKE_KVPRESS_SEEN", str(tmp_path / "seen.json"))
    monkeypatch.setenv("PYTHONPATH", "/somewhere/else")
    return exe


def _seen(tmp_path) -> dict:
    return json.loads((tmp_path / "seen.json").read_text())


CASES = [KvpressCase("passkey-0", (5, 6, 7, 8), (), (9, 10), 3),
         KvpressCase("bad-1", [5, 6], [11, 12], [], 2),
         KvpressCase("passkey-2", (5,) * 10, (13,), (14,), 0)]


def test_run_kvpress_writes_the_job_and_reads_one_result_per_case(fake_python, tmp_path) -> None:
    results = run_kvpress(CASES, press="snapkv", compression_ratio=0.5, mode="prefill", model_dir=tmp_path / "m",
                          python=fake_python, threads=3, press_kwargs={"window_size": 2}, stop_ids=[2])
    seen = _seen(tmp_path)
    assert seen["argv"][:2] == ["-I", str(DRIVER)]  # isolated: the driver's folder must not shadow kvpress
    assert seen["OMP_NUM_THREADS"] == "3" and seen["PYTHONPATH"] is None
    job = seen["job"]
    assert job["model"] == str((tmp_path / "m").resolve())
    assert (job["press"], job["compression_ratio"], job["mode"], job["threads"], job["decode"]) == \
        ("snapkv", 0.5, "prefill", 3, None)
    assert job["press_kwargs"] == {"window_size": 2} and job["stop_ids"] == [2] and job["dtype"] == "float32"
    assert job["cases"][1] == {"id": "bad-1", "context_ids": [5, 6], "decode_ids": [11, 12], "question_ids": [],
                               "max_new_tokens": 2}
    assert job == build_job(CASES, press="snapkv", compression_ratio=0.5, mode="prefill", model_dir=tmp_path / "m",
                            threads=3, press_kwargs={"window_size": 2}, stop_ids=[2])
    assert validate_ok(job)
    assert [r.id for r in results] == ["passkey-0", "bad-1", "passkey-2"]
    assert results[0] == KvpressResult("passkey-0", (9, 10, 9), 200, 400, 0.5, 1.0, None, 2.0)
    assert results[1].error == "prefill: AssertionError: too short" and results[1].generated_ids == ()
    assert results[2].generated_ids == () and results[2].kv_bytes_after_prefill == 500


def validate_ok(job: dict) -> bool:
    """The job run_kvpress writes is one the real driver accepts."""
    return driver.validate_job(job)["cases"] == job["cases"]


def test_run_kvpress_decode_mode_passes_the_decoding_settings(fake_python, tmp_path) -> None:
    run_kvpress(CASES[:1], press="tova", compression_ratio=0.0, mode="decode", model_dir=tmp_path,
                python=fake_python, decode={"compression_interval": 16, "target_size": 256})
    job = _seen(tmp_path)["job"]
    assert job["mode"] == "decode" and job["decode"] == {"compression_interval": 16, "target_size": 256}
    assert validate_ok(job)


@pytest.mark.parametrize("behaviour,match", [
    ("exit", r"status 3(.|\n)*kvpress exploded"),
    ("wrong-id", "is for case 'someone-else', expected 'passkey-0'"),
    ("short", "wrote 2 results for 3 cases"),
    ("garbage", "line 3 is not JSON"),
    ("mistyped", "prefill_s='fast' is not a float"),
    ("silent", "wrote no results file"),
])
def test_a_driver_that_fails_is_a_clear_error(fake_python, tmp_path, monkeypatch, behaviour, match) -> None:
    monkeypatch.setenv("FAKE_KVPRESS", behaviour)
    with pytest.raises(KvpressError, match=match):
        run_kvpress(CASES, press="knorm", compression_ratio=0.25, mode="prefill", model_dir=tmp_path,
                    python=fake_python)


def test_a_driver_past_its_timeout_is_killed(fake_python, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FAKE_KVPRESS", "sleep")
    with pytest.raises(KvpressError, match=r"timeout_s=1 s .*0 of 3 cases done"):
        run_kvpress(CASES, press="knorm", compression_ratio=0.25, mode="prefill", model_dir=tmp_path,
                    python=fake_python, timeout_s=1)


def test_versions_come_from_kvpress_python(fake_python) -> None:
    assert kvpress_versions(fake_python)["kvpress"] == "0.5.5"


def test_missing_kvpress_venv_names_the_make_target(tmp_path, monkeypatch) -> None:
    with pytest.raises(KvpressUnavailable, match="make kvpress-venv"):
        run_kvpress(CASES, press="snapkv", compression_ratio=0.5, mode="prefill", model_dir=tmp_path,
                    python=tmp_path / "no-venv" / "bin" / "python")
    monkeypatch.setenv("BEACONKV_KVPRESS_PYTHON", str(tmp_path / "elsewhere" / "python"))
    assert default_python() == tmp_path / "elsewhere" / "python"
    with pytest.raises(KvpressUnavailable, match=r"\$BEACONKV_KVPRESS_PYTHON.*make kvpress-venv"):
        kvpress_versions()
    monkeypatch.delenv("BEACONKV_KVPRESS_PYTHON")
    assert default_python().parts[-3:] == (".venv-kvpress", "bin", "python")


@pytest.mark.parametrize("kwargs,match", [
    (dict(press="h2o"), "press='h2o' is not a kvpress comparator"),
    (dict(compression_ratio=1.0), r"compression_ratio=1.0 must be in \[0, 1\)"),
    (dict(mode="chunked"), "mode='chunked'"),
    (dict(decode={"compression_interval": 4, "target_size": 8}), "with mode='prefill'"),
    (dict(mode="decode"), "with mode='decode'.*compression_ratio=0"),
    (dict(mode="decode", compression_ratio=0.0), "needs decode="),
    (dict(mode="decode", compression_ratio=0.0, decode={"compression_interval": 4, "target_size": 8, "every": 2}),
     "not DecodingPress settings"),
    (dict(press="none"), "press='none'"),
    (dict(threads=0), "threads=0"),
])
def test_bad_settings_are_refused_before_anything_runs(tmp_path, kwargs, match) -> None:
    args = dict(press="snapkv", compression_ratio=0.5, mode="prefill", model_dir=tmp_path,
                python=tmp_path / "not-needed")
    with pytest.raises(KvpressError, match=match):
        run_kvpress(CASES, **{**args, **kwargs})


def test_press_none_needs_no_decode_settings(fake_python, tmp_path) -> None:
    """kvpress's model with no press, in mode decode: nothing to schedule, so no DecodingPress settings."""
    run_kvpress(CASES[:1], press="none", compression_ratio=0.0, mode="decode", model_dir=tmp_path, python=fake_python)
    job = _seen(tmp_path)["job"]
    assert job["mode"] == "decode" and job["decode"] is None and validate_ok(job)


def test_cases_are_checked_when_made() -> None:
    with pytest.raises(KvpressError, match="context_ids is empty"):
        KvpressCase("c", ())
    with pytest.raises(KvpressError, match="question_ids must hold token ids"):
        KvpressCase("c", (1,), (), (-1,))
    with pytest.raises(KvpressError, match="appears twice"):
        build_job([KvpressCase("c", (1,)), KvpressCase("c", (2,))], press="none", compression_ratio=0,
                  mode="prefill", model_dir=Path("."))


def test_parse_results_accepts_integral_seconds_and_missing_token_counts() -> None:
    line = {"id": "a", "generated_ids": [1], "kv_bytes_after_prefill": 8, "peak_kv_bytes": 9, "prefill_s": 1,
            "decode_s": None, "error": None}
    (r,) = parse_results(json.dumps(line) + "\n\n", [KvpressCase("a", (1,))])
    assert r == KvpressResult("a", (1,), 8, 9, 1.0, None, None, None)
    with pytest.raises(KvpressError, match="lacks error"):
        parse_results(json.dumps({k: v for k, v in line.items() if k != "error"}), [KvpressCase("a", (1,))])


# ------------------------------------------------------------ the driver's protocol, for real, no kvpress
@pytest.mark.parametrize("job,match", [
    ([], "JSON object"),
    ({"model": "m", "press": "snapkv", "compression_ratio": 0.5, "mode": "prefill"}, "no 'cases'"),
    ({"model": "m", "press": "h2o", "compression_ratio": 0.5, "mode": "prefill", "cases": []}, "press='h2o'"),
    ({"model": "m", "press": "knorm", "compression_ratio": 0.5, "mode": "decode", "cases": []}, "pass compression"),
    ({"model": "m", "press": "knorm", "compression_ratio": 0, "mode": "decode", "cases": [],
      "decode": {"compression_interval": 0, "target_size": 8}}, "compression_interval=0 must be an int >= 1"),
    ({"model": "m", "press": "knorm", "compression_ratio": 0.5, "mode": "prefill", "cases": [{"id": 3}]}, "cases"),
    ({"model": "m", "press": "knorm", "compression_ratio": 0.5, "mode": "prefill",
      "cases": [{"id": "a"}, {"id": "a"}]}, "appears twice"),
    ({"model": "m", "press": "none", "compression_ratio": 0, "mode": "prefill", "cases": [],
      "press_kwargs": {"window_size": 3}}, "no press to set"),
])
def test_driver_refuses_a_bad_job(job, match) -> None:
    with pytest.raises(driver.JobError, match=match):
        driver.validate_job(job)


@pytest.fixture(scope="module")
def tiny_llama(tiny_models):
    """The tiny random Llama checkpoint and the driver's model of it (transformers, sdpa, fp32)."""
    path = tiny_models["llama"][0]
    return path, driver.load_model(str(path), "float32")


def _greedy_reference(model, ids: list[int], n: int) -> list[int]:
    """Greedy tokens from full forwards with no cache: the answer with nothing compressed."""
    ids, out = list(ids), []
    with torch.inference_mode():
        for _ in range(n):
            token = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            out.append(token)
            ids.append(token)
    return out


def _token_layer_bytes(model) -> int:
    """Bytes of one token's keys and values in one layer (fp32)."""
    c = model.config
    return 2 * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 4


def _kv_bytes_of(model, tokens: int) -> int:
    """Bytes of ``tokens`` tokens in every layer."""
    return model.config.num_hidden_layers * tokens * _token_layer_bytes(model)


def test_driver_without_a_press_matches_full_greedy_decoding(tiny_llama, tmp_path) -> None:
    """The real driver, run as kvpress's would be (a subprocess, isolated), here with beaconkv's Python and
    press 'none' (which needs no kvpress): question-agnostic, teacher-forced decode steps, the question-aware
    variant (empty question) and stop ids all give the uncompressed greedy answer."""
    path, model = tiny_llama
    context, decode, question = list(range(3, 40)), [50, 51, 52, 53, 54], [60, 61, 62]
    cases = [KvpressCase("agnostic", context, (), question, 6),
             KvpressCase("teacher-forced", context, decode, question, 6),
             KvpressCase("aware", context + question, (), (), 6),
             KvpressCase("nothing", context, (), (), 0)]
    expected_agnostic = _greedy_reference(model, context + question, 6)
    stop = expected_agnostic[2]
    results = run_kvpress(cases, press="none", compression_ratio=0.0, mode="prefill", model_dir=path,
                          python=Path(sys.executable), stop_ids=[stop])
    assert all(r.error is None for r in results), [r.error for r in results]
    cut = expected_agnostic.index(stop) + 1
    assert list(results[0].generated_ids) == expected_agnostic[:cut]
    forced = _greedy_reference(model, context + decode + question, 6)
    assert list(results[1].generated_ids) == forced[: forced.index(stop) + 1 if stop in forced else 6]
    assert list(results[2].generated_ids) == expected_agnostic[:cut]
    assert results[3].generated_ids == ()
    assert results[0].kv_bytes_after_prefill == _kv_bytes_of(model, len(context))
    assert results[0].kv_tokens_after_prefill == len(context)
    # the peak is the cache before the last generated token's forward is skipped: context + question + answer - 1
    assert results[0].peak_kv_bytes == _kv_bytes_of(model, len(context) + len(question) + cut - 1)
    assert results[1].peak_kv_bytes >= _kv_bytes_of(model, len(context) + len(decode) + len(question))
    assert all(r.prefill_s > 0 and r.decode_s >= 0 for r in results)


def test_driver_needs_kvpress_only_for_a_press(tiny_llama, tmp_path) -> None:
    path, _ = tiny_llama
    probe = subprocess.run([sys.executable, "-I", "-c", "import kvpress"], capture_output=True)
    if probe.returncode == 0:  # pragma: no cover - beaconkv's environment never has kvpress
        pytest.fail("kvpress is importable in beaconkv's environment; this test checks the message without it")
    with pytest.raises(KvpressError, match=r"needs kvpress(.|\n)*make kvpress-venv"):
        run_kvpress(CASES[:1], press="knorm", compression_ratio=0.5, mode="prefill", model_dir=path,
                    python=Path(sys.executable))


class KeepLast:
    """Stands in for a kvpress press (its protocol: ``with press(model):`` registers forward hooks on the
    attention modules and rewrites the cache layer in the hook): keeps the last ``n`` tokens of each layer
    when a forward of more than one token ends (the prefill), optionally masks AdaKV-style, or raises."""

    def __init__(self, n: int, *, raise_on: int | None = None, mask: int = 0, at_decode: bool = False) -> None:
        self.n, self.raise_on, self.mask, self.at_decode = n, raise_on, mask, at_decode
        self.calls = 0

    def _hook(self, module, args, kwargs, output):
        q_len = kwargs["hidden_states"].shape[1]
        if (q_len == 1) != self.at_decode:
            return output
        self.calls += 1
        if self.raise_on is not None and self.calls == self.raise_on:
            raise AssertionError("Query length 1 should be greater than the window size 64")
        cache = kwargs["cache"] if "cache" in kwargs else kwargs["past_key_values"]  # transformers >= 5.25: cache
        layer = cache.layers[module.layer_idx]
        if layer.keys.shape[2] > self.n:
            layer.keys, layer.values = layer.keys[:, :, -self.n:], layer.values[:, :, -self.n:]
        if self.mask:
            heads = torch.zeros(self.mask, dtype=torch.long)
            module.masked_key_indices = (heads, heads, torch.arange(self.mask))
        return output

    @contextlib.contextmanager
    def __call__(self, model):
        handles = [layer.self_attn.register_forward_hook(self._hook, with_kwargs=True)
                   for layer in model.model.layers]
        try:
            yield
        finally:
            for h in handles:
                h.remove()


def _run(model, press, mode, case) -> dict:
    meter = driver.KVMeter(model)
    try:
        return driver.run_case(model, press, mode, case, meter)
    finally:
        for h in meter.handles:
            h.remove()


def test_driver_feeds_true_positions_to_a_compressed_cache(tiny_llama) -> None:
    """After a prefill press drops tokens, every later token is placed at its position in the sequence, not at
    the cache's length; the bytes after the prefill are the kept tokens', the peak the whole context's."""
    _, model = tiny_llama
    seen = []
    handle = model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["position_ids"][0].tolist()),
                                             with_kwargs=True)
    case = {"id": "c", "context_ids": list(range(3, 33)), "decode_ids": [40, 41], "question_ids": [50, 51, 52],
            "max_new_tokens": 3}
    try:
        r = _run(model, KeepLast(8), "prefill", case)
    finally:
        handle.remove()
    assert r["error"] is None
    assert seen == [list(range(30)), [30], [31], [32, 33, 34], [35], [36]]
    assert r["kv_bytes_after_prefill"] == _kv_bytes_of(model, 8) and r["kv_tokens_after_prefill"] == 8
    # the peak is sampled before the press cuts a layer: at the last layer of the prefill, the earlier layers
    # hold 8 tokens and it holds all 30; later the cache holds at most 8 + 2 + 3 + 2 tokens per layer
    n_layers = model.config.num_hidden_layers
    token_layers = max(8 * (n_layers - 1) + 30, (8 + 2 + 3 + 2) * n_layers)
    assert r["peak_kv_bytes"] == token_layers * _token_layer_bytes(model)


def test_a_failing_case_is_its_own_error_and_the_next_case_runs(tiny_llama) -> None:
    _, model = tiny_llama
    base = {"context_ids": list(range(3, 23)), "decode_ids": [], "question_ids": [30], "max_new_tokens": 4}
    press = KeepLast(6, raise_on=1)
    meter = driver.KVMeter(model)
    try:
        bad = driver.run_case(model, press, "prefill", {"id": "bad", **base}, meter)
        good = driver.run_case(model, press, "prefill", {"id": "good", **base}, meter)
        oov = driver.run_case(model, press, "prefill", {**base, "id": "oov", "question_ids": [10_000]}, meter)
        reference = driver.run_case(model, KeepLast(6), "prefill", {"id": "ref", **base}, meter)
    finally:
        for h in meter.handles:
            h.remove()
    assert bad["error"] == "prefill: AssertionError: Query length 1 should be greater than the window size 64"
    assert bad["generated_ids"] == [] and bad["kv_bytes_after_prefill"] is None
    assert good["error"] is None and good["generated_ids"] == reference["generated_ids"]
    assert oov["error"].startswith("checking the case: JobError: case 'oov': question_ids holds 10000")
    # the press's hooks were removed after the failure: a plain run is uncompressed
    plain = _run(model, None, "prefill", {"id": "plain", **base})
    assert plain["kv_bytes_after_prefill"] == _kv_bytes_of(model, 20)


def test_decode_mode_leaves_the_prefill_whole_and_compresses_the_decode_steps(tiny_llama) -> None:
    _, model = tiny_llama
    case = {"id": "d", "context_ids": list(range(3, 23)), "decode_ids": [30, 31, 32], "question_ids": [],
            "max_new_tokens": 2}
    press = KeepLast(10, at_decode=True)
    r = _run(model, press, "decode", case)
    assert r["error"] is None
    assert r["kv_bytes_after_prefill"] == _kv_bytes_of(model, 20)
    assert press.calls == model.config.num_hidden_layers * 4  # 3 decode steps + 1 answer token forwarded
    # sampled before the press cuts a layer: the first decode step's layer 0 holds 21 tokens, the rest 20
    assert r["peak_kv_bytes"] == (20 * model.config.num_hidden_layers + 1) * _token_layer_bytes(model)


def test_adakv_style_masks_count_as_invisible_tokens(tiny_llama) -> None:
    _, model = tiny_llama
    case = {"id": "a", "context_ids": list(range(3, 23)), "decode_ids": [], "question_ids": [], "max_new_tokens": 1}
    r = _run(model, KeepLast(100, mask=4), "prefill", case)
    heads = model.config.num_key_value_heads
    assert r["kv_bytes_after_prefill"] == _kv_bytes_of(model, 20)  # masking keeps every key stored
    assert r["kv_tokens_after_prefill"] == pytest.approx((heads * 20 - 4) / heads)
    for layer in model.model.layers:
        layer.self_attn.masked_key_indices = None


# ------------------------------------------------------------------------- kvpress 0.5.5 itself (long)
KVPRESS_PYTHON = default_python()
needs_kvpress = pytest.mark.skipif(not KVPRESS_PYTHON.exists(), reason="kvpress venv not built (make kvpress-venv)")


@pytest.mark.long
@needs_kvpress
def test_kvpress_end_to_end_on_the_embedded_model() -> None:
    """kvpress 0.5.5 in its own environment on the embedded SmolLM2-135M: with no press its greedy answer is
    transformers' in beaconkv's environment; each prefill press keeps exactly the count kvpress_ratio asked
    for (AdaKV masks instead, keeping every key stored); decode-time presses run or say why they cannot."""
    import transformers

    import beaconkv

    assert kvpress_versions()["kvpress"] == "0.5.5"
    # run by path as a person would (no -I), the script's folder, which holds beaconkv's kvpress.py, must not
    # shadow the kvpress package
    plain = subprocess.run([str(KVPRESS_PYTHON), str(DRIVER), "--versions"], capture_output=True, text=True,
                           timeout=300, check=True)
    kvpress_file = Path(json.loads(plain.stdout.splitlines()[-1])["kvpress_file"])
    assert kvpress_file.parts[-3:] == ("site-packages", "kvpress", "__init__.py"), kvpress_file
    path = beaconkv.embedded_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    filler = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. " * 6
    context = tok.encode(filler + "The pass key is 71432. Remember it. 71432 is the pass key. " + filler)
    question = tok.encode(" What is the pass key? The pass key is")
    cases = [KvpressCase("passkey", context, (), question, 6),
             KvpressCase("passkey-aware", context + question, (), (), 6)]
    (none, none_aware) = run_kvpress(cases, press="none", compression_ratio=0.0, mode="prefill", model_dir=path,
                                     timeout_s=600)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert list(none.generated_ids) == _greedy_reference(hf, context + question, 6)
    assert none_aware.generated_ids == none.generated_ids
    assert "71432" in tok.decode(none.generated_ids)
    n_keep = len(context) // 4
    ratio = kvpress_ratio(n_keep, len(context))
    full = none.kv_bytes_after_prefill
    for press in [p for p in PRESSES if p != "none"]:
        (r, aware) = run_kvpress(cases, press=press, compression_ratio=ratio, mode="prefill", model_dir=path,
                                 timeout_s=600)
        assert r.error is None and aware.error is None, (press, r.error, aware.error)
        assert len(r.generated_ids) == 6
        assert r.kv_tokens_after_prefill == pytest.approx(n_keep, abs=1e-9), press
        expected_bytes = full if press == "adakv-snapkv" else full * n_keep // len(context)
        assert r.kv_bytes_after_prefill == expected_bytes, press
        assert r.peak_kv_bytes > r.kv_bytes_after_prefill
    decode = {"compression_interval": 16, "target_size": n_keep}
    teacher_forced = [KvpressCase("d", context[:-48], context[-48:], question, 4)]
    for press, kwargs in (("knorm", {}), ("streaming", {}), ("tova", {}), ("snapkv", {}), ("snapkv", {"window_size": 8})):
        (r,) = run_kvpress(teacher_forced, press=press, compression_ratio=0.0, mode="decode", model_dir=path,
                           decode=decode, press_kwargs=kwargs, timeout_s=600)
        # what unsupported_reason predicts is what kvpress does
        reason = unsupported_reason(press, "decode", decode=decode, press_kwargs=kwargs)
        if reason is not None:  # SnapKVPress scores from the states buffered since the last compression (16)
            assert r.error is not None and "window size 64" in r.error, (press, r.error)
        else:
            assert r.error is None, (press, kwargs, r.error)
            per_token = full // len(context)
            assert r.kv_bytes_after_prefill == (len(context) - 48) * per_token  # no prefill compression
            # the peak is the 16th decode step's layer 0 before the first compression (the others hold 15 more
            # tokens than the prefill): had nothing been compressed then, the cache would have grown past it
            layer_token = per_token // hf.config.num_hidden_layers
            assert r.peak_kv_bytes == (len(context) - 48 + 15) * per_token + layer_token, (press, kwargs)
