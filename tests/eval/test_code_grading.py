"""LiveCodeBench-style grading: programs run in the sandbox against their tests."""

from __future__ import annotations

import time

import pytest

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
