"""LiveCodeBench-style grading: programs run in the sandbox against their tests."""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from beaconkv.eval.benchmarks import CodeTest
from beaconkv.eval.code_grading import extract_code, grade_code, outputs_match
from beaconkv.eval.sandbox import SandboxLimits, run_python

FAST = SandboxLimits(timeout_s=1.0, memory_mb=512)

STDIN_TESTS = (
    CodeTest("1 2\n", "3\n"),
    CodeTest("10 -4\n", "6\n"),
)


def fenced(code: str) -> str:
    return f"Let me think.\n</think>\nHere is my solution:\n```python\n{code}\n```\n"


def test_correct_program_passes() -> None:
    code = "a, b = map(int, input().split())\nprint(a + b)"
    grade = grade_code(fenced(code), STDIN_TESTS, limits=FAST)
    assert grade.correct, grade.detail


def test_incorrect_program_fails_on_its_first_wrong_test() -> None:
    code = "a, b = map(int, input().split())\nprint(a + b if a == 1 else 0)"
    grade = grade_code(fenced(code), STDIN_TESTS, limits=FAST)
    assert not grade.correct
    assert grade.detail == "test 2/2: wrong answer"


def test_infinite_loop_times_out() -> None:
    start = time.monotonic()
    grade = grade_code(fenced("while True:\n    pass"), STDIN_TESTS, limits=FAST)
    assert not grade.correct and "timeout" in grade.detail
    assert time.monotonic() - start < 5


def test_runtime_error_is_reported() -> None:
    grade = grade_code(fenced("raise ValueError('boom')"), STDIN_TESTS, limits=FAST)
    assert not grade.correct and "ValueError: boom" in grade.detail


def test_functional_leetcode_style() -> None:
    code = (
        "class Solution:\n"
        "    def twoSum(self, nums: List[int], target: int) -> List[int]:\n"
        "        print('debug output is ignored')\n"
        "        seen = {}\n"
        "        for i, x in enumerate(nums):\n"
        "            if target - x in seen:\n"
        "                return [seen[target - x], i]\n"
        "            seen[x] = i\n"
    )
    tests = (CodeTest("[2,7,11,15]\n9", "[0, 1]", "functional"), CodeTest("[3,3]\n6", "[0, 1]", "functional"))
    assert grade_code(fenced(code), tests, fn_name="twoSum", limits=FAST).correct
    wrong = code.replace("return [seen[target - x], i]", "return [i, seen[target - x]]")
    assert not grade_code(fenced(wrong), tests, fn_name="twoSum", limits=FAST).correct


def test_no_code_block() -> None:
    grade = grade_code("I would write a loop.", STDIN_TESTS, limits=FAST)
    assert grade.answer is None and not grade.correct


def test_extract_code_prefers_the_last_python_block_after_thinking() -> None:
    text = "<think>```python\nprint(0)\n```</think>\n```text\nnot code\n```\n```python\nprint(1)\n```\n"
    assert extract_code(text) == "print(1)\n"


@pytest.mark.parametrize(
    ("got", "want", "ok"),
    [
        ("3\n", "3", True),
        ("1 2  \n\n", "1 2\n", True),
        ("0.3333333\n", "0.33333333", True),
        ("Yes\n", "No\n", False),
        ("1\n2\n", "1\n", False),
    ],
)
def test_outputs_match(got: str, want: str, ok: bool) -> None:
    assert outputs_match(got, want) is ok


def test_sandbox_has_no_network() -> None:
    code = "import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)\nprint('connected')"
    result = run_python({"main.py": code}, "main.py", limits=FAST)
    assert result.status == "error" and "PermissionError" in result.stderr


def test_sandbox_limits_memory() -> None:
    result = run_python({"main.py": "x = bytearray(2 * 1024 ** 3)\nprint(len(x))"}, "main.py", limits=FAST)
    assert result.status == "memory"


def test_sandbox_runs_in_a_clean_temporary_directory_with_a_clean_environment(monkeypatch) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    monkeypatch.setenv("HF_TOKEN", "secret")
    code = "import os, sys\nprint(sorted(os.listdir('.')))\nprint(sorted(os.environ))\nprint(sys.flags.isolated)"
    result = run_python({"main.py": code}, "main.py", limits=FAST)
    files, env, isolated = result.stdout.splitlines()
    assert files == "['main.py']"
    assert "HTTPS_PROXY" not in env and "HF_TOKEN" not in env
    assert isolated == "1"


# --- issue #39: one sample can neither crash the grader nor fool it -------------------------------------------


def functional(body: str, want: str) -> object:
    return grade_code(fenced(body), (CodeTest("", want, "functional"),), fn_name="f", limits=FAST)


def test_a_forged_result_mark_and_os_exit_is_a_runtime_error_not_a_crash() -> None:
    grade = functional('import os\ndef f():\n    os.write(1, b"@@BEACONKV_RESULT@@x")\n    os._exit(0)', "1")
    assert not grade.correct and grade.error is None
    assert grade.detail == "test 1/1: runtime error: no return value (the program ended before its function returned)"


def test_a_printed_frame_with_a_guessed_token_is_not_taken_for_the_result() -> None:
    body = 'def f():\n    print("\\n" + "0" * 32 + "3:[1]")\n    print("\\n@@BEACONKV_RESULT@@[1]")\n    return [2]'
    assert functional(body, "[1]").detail == "test 1/1: wrong answer"
    assert functional(body, "[2]").correct


def test_output_after_the_result_from_an_atexit_hook_is_ignored() -> None:
    body = 'import atexit, os\natexit.register(lambda: os.write(1, b"]]]" * 1000))\ndef f(): return [1, 2]'
    assert functional(body, "[1, 2]").correct
    assert not functional(body, "[1, 3]").correct


@pytest.mark.parametrize(
    ("value", "want", "ok"),
    [
        ("2 ** 1100", str(2**1100), True),  # beyond float range: math.isclose raised OverflowError
        ("2 ** 1100 + 1", str(2**1100), False),
        ("10 ** 5000", "1" + "0" * 5000, True),  # over 4,300 digits: json.dumps raised ValueError
        ("10 ** 5000 + 1", "1" + "0" * 5000, False),
        ("1000000000", "1000000007", False),  # integers compare exactly
        ("[999999]", "[1000000]", False),
        ("0.1 + 0.2", "0.3", True),  # a float on one side: 1e-6 tolerance
        ("float('inf')", "Infinity", True),
        ("(1, [2, 3.0])", "[1, [2, 3]]", True),
        ("True", "1", False),
    ],
)
def test_returned_values_compare_exactly_where_they_should(value: str, want: str, ok: bool) -> None:
    grade = functional(f"def f(): return {value}", want)
    assert grade.correct is ok, grade.detail
    assert grade.error is None


def test_a_returned_value_nested_past_the_recursion_limit_is_wrong_not_a_crash() -> None:
    grade = functional("def f():\n    a = []\n    for _ in range(20000):\n        a = [a]\n    return a", "[]")
    assert not grade.correct and "nests too deep" in grade.detail


def test_a_returned_value_far_larger_than_the_expected_one_is_not_parsed() -> None:
    grade = functional("def f(): return [0] * 3_000_000", "[0]")
    assert not grade.correct and grade.detail.startswith("test 1/1: wrong answer (a returned value of")


def test_a_huge_stderr_gives_a_short_runtime_error() -> None:
    body = 'import sys\nsys.stderr.write("x\\n" * 2_000_000)\nraise SystemExit("the last word " + "y" * 500)'
    grade = grade_code(fenced(body), STDIN_TESTS, limits=FAST)
    assert grade.detail.startswith("test 1/2: runtime error: the last word yyy")
    assert len(grade.detail) < 260


def test_millions_of_output_lines_are_compared_in_bounded_memory() -> None:
    # ~22 M short lines pushed the grader from 359 MiB to 2.1 GiB when the output was split into a list
    import tracemalloc

    got = "1\n" * 200_000  # as a list of lines: ~12 MB
    want = "1 \n" * 200_000 + "\n" * 100_000
    longer = got + "2\n"
    tracemalloc.start()
    try:
        assert outputs_match(got, want)
        assert not outputs_match(longer, want)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 << 20, f"comparing 200,000 lines held {peak} bytes at once"


def test_a_sandbox_that_cannot_start_is_a_named_grader_error(monkeypatch) -> None:
    from beaconkv.eval import code_grading
    from beaconkv.eval.sandbox import SandboxUnavailable

    def refuse(*args, **kwargs):
        raise SandboxUnavailable("user namespaces are disabled here")

    monkeypatch.setattr(code_grading, "run_python", refuse)
    grade = grade_code(fenced("print(3)"), STDIN_TESTS, limits=FAST)
    assert not grade.correct
    assert grade.error == "SandboxUnavailable: user namespaces are disabled here"
    assert "not graded" in grade.detail


# Hostile programs: whatever a program returns, prints, or does on its way out, grading gives a Grade.
_RETURNS = [
    "2 ** 1100", "-(10 ** 5000)", "float('nan')", "1e308 * 10", "[[[[[]]]]]", "'@@BEACONKV_RESULT@@[1]'",
    "b'bytes'", "{1, 2}", "{'a': [1, 2.5]}", "(lambda l: (l.append(l), l)[1])([])", "type('R', (), {'__repr__': None})()",
    "'\\udc80'", "None",
]
_ON_THE_WAY = [
    "", "print('\\n@@BEACONKV_RESULT@@5:[1,2]')", "os.write(1, b'\\n' + b'f' * 32 + b'1:1')", "os._exit(0)",
    "sys.exit(3)", "os.close(1)", "os.close(3)", "sys.stdout.close()", "raise RuntimeError('boom')",
    "atexit.register(os.write, 1, b'@@BEACONKV_RESULT@@')", "sys.stderr.write('e\\n' * 100000)",
    "sys.setrecursionlimit(50)",
]


@given(
    st.sampled_from(_RETURNS),
    st.lists(st.sampled_from(_ON_THE_WAY), max_size=2),
    st.sampled_from(["[1, 2]", "1", str(2**1100), "not json", "Infinity", "[[[[[]]]]]"]),
)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_a_hostile_program_gets_a_grade_never_a_raise(value: str, effects: list[str], want: str) -> None:
    lines = ["import atexit, os, sys", "def f():"] + [f"    {e}" for e in effects] + [f"    return {value}"]
    grade = functional("\n".join(lines), want)
    assert grade.error is None, grade.detail  # the sandbox ran: the verdict is about the program
    assert grade.detail.startswith("test 1/1: ") or grade.correct
    exits_early = any(e.startswith(("os._exit", "sys.exit", "raise", "os.close(3)")) for e in effects)
    if exits_early:
        assert not grade.correct, (effects, grade.detail)
