"""Grade LiveCodeBench-style answers by running the generated program against its tests.

The program is the last fenced code block of the response (```` ```python ```` preferred). Each test
runs in its own sandboxed subprocess (:func:`beaconkv.eval.sandbox.run_python`), in order, stopping at
the first failure, as LiveCodeBench does; the answer is correct when every test passes.

* ``stdin`` tests: the program reads the test input on stdin; its stdout must equal the expected
  output line by line after stripping trailing whitespace, numbers comparing with a tolerance of
  1e-6 when the text differs.
* ``functional`` tests (LeetCode): the program defines ``class Solution`` with method ``fn_name``
  (or a top-level function of that name); each input line is one JSON argument; the return value
  must equal the JSON-decoded expected output (tuples compare as lists, floats with tolerance).

Like LiveCodeBench, a header of common imports (``typing``, ``collections``, ``math``, ...) is
executed before the program.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from typing import Any

from beaconkv.eval.benchmarks import CodeTest
from beaconkv.eval.grade import Grade
from beaconkv.eval.sandbox import SandboxLimits, SandboxResult, run_python

__all__ = ["extract_code", "grade_code", "outputs_match", "run_test"]

IMPORT_HEADER = """\
import sys, os, math, re, random, string, bisect, heapq, itertools, functools, collections, copy
import operator, statistics, decimal, fractions, json
from typing import *
from collections import *
from itertools import *
from functools import *
from heapq import *
from bisect import *
from math import *
sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 ** 5))
"""

# Runs inside the sandbox: python -I harness.py MODE FN_NAME
HARNESS = r'''
import builtins, io, json, sys

mode, fn_name = sys.argv[1], sys.argv[2]
with open("header.py", encoding="utf-8") as f:
    header = f.read()
with open("solution.py", encoding="utf-8") as f:
    source = f.read()
namespace = {"__name__": "__main__" if mode == "stdin" else "solution", "__builtins__": builtins}
exec(compile(header, "header.py", "exec"), namespace)
if mode == "stdin":
    exec(compile(source, "solution.py", "exec"), namespace)
else:
    args = [json.loads(line) for line in sys.stdin.read().split("\n") if line.strip()]
    real_stdout = sys.stdout
    sys.stdout = io.StringIO()  # the solution may print; only the return value counts
    exec(compile(source, "solution.py", "exec"), namespace)
    if "Solution" in namespace and hasattr(namespace["Solution"], fn_name):
        target = getattr(namespace["Solution"](), fn_name)
    elif callable(namespace.get(fn_name)):
        target = namespace[fn_name]
    else:
        raise NameError(f"no Solution.{fn_name} and no function {fn_name} defined")
    result = target(*args)
    sys.stdout = real_stdout
    sys.stdout.write("\n@@BEACONKV_RESULT@@" + json.dumps(result, default=repr))
'''

_RESULT_MARK = "@@BEACONKV_RESULT@@"

_FENCE_RE = re.compile(r"```([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(response: str) -> str | None:
    """Return the last fenced code block of a response, preferring Python-tagged blocks.

    Text inside a ``<think>...</think>`` section is ignored when the response has text after it.

    Args:
        response: The model's output.

    Returns:
        The code, or ``None`` if the response has no complete fenced block.
    """
    if "</think>" in response:
        tail = response.rsplit("</think>", 1)[1]
        if "```" in tail:
            response = tail
    blocks = _FENCE_RE.findall(response)
    if not blocks:
        return None
    python_blocks = [code for lang, code in blocks if lang.lower() in ("python", "py", "python3")]
    code = (python_blocks or [code for _, code in blocks])[-1]
    return code if code.strip() else None


def _tokens_match(got: str, want: str) -> bool:
    if got == want:
        return True
    try:
        a, b = float(got), float(want)
    except ValueError:
        return False
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6)


def outputs_match(got: str, want: str) -> bool:
    """Compare a program's stdout with the expected output.

    Lines are compared after stripping trailing whitespace (leading and trailing blank lines are
    ignored); within a line that differs, whitespace-separated tokens must be equal or numbers
    within 1e-6 (relative or absolute).

    Args:
        got: Actual stdout.
        want: Expected stdout.

    Returns:
        ``True`` if they match.
    """
    got_lines = [line.rstrip() for line in got.strip().splitlines()]
    want_lines = [line.rstrip() for line in want.strip().splitlines()]
    if len(got_lines) != len(want_lines):
        return False
    for g, w in zip(got_lines, want_lines):
        if g == w:
            continue
        gt, wt = g.split(), w.split()
        if len(gt) != len(wt) or not all(_tokens_match(a, b) for a, b in zip(gt, wt)):
            return False
    return True


def _values_match(got: Any, want: Any) -> bool:
    if isinstance(got, bool) or isinstance(want, bool):
        return got == want
    if isinstance(got, (int, float)) and isinstance(want, (int, float)):
        return math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-6)
    if isinstance(got, list) and isinstance(want, list):
        return len(got) == len(want) and all(_values_match(a, b) for a, b in zip(got, want))
    if isinstance(got, dict) and isinstance(want, dict):
        return got.keys() == want.keys() and all(_values_match(got[k], want[k]) for k in got)
    return got == want


def run_test(
    code: str, test: CodeTest, *, fn_name: str | None = None, limits: SandboxLimits | None = None
) -> tuple[bool, str, SandboxResult]:
    """Run one test of a program in the sandbox.

    Args:
        code: The program.
        test: The test.
        fn_name: The function functional tests call.
        limits: Sandbox limits.

    Returns:
        ``(passed, reason, sandbox_result)``; ``reason`` is ``""``, ``"wrong answer"``,
        ``"timeout"``, ``"memory"``, ``"output-limit"`` or ``"runtime error: <last stderr line>"``.

    Raises:
        ValueError: If a functional test has no ``fn_name``.
    """
    if test.kind == "functional" and not fn_name:
        raise ValueError("a functional test needs fn_name (LiveCodeBench metadata 'func_name')")
    files = {"harness.py": HARNESS, "header.py": IMPORT_HEADER, "solution.py": code}
    result = run_python(
        files, "harness.py", [test.kind, fn_name or "-"], stdin=test.input, limits=limits
    )
    if result.status != "ok":
        if result.status == "error":
            last = (result.stderr.strip().splitlines() or ["exit status " + str(result.returncode)])
            return False, f"runtime error: {last[-1][:200]}", result
        return False, result.status, result
    if test.kind == "stdin":
        ok = outputs_match(result.stdout, test.output)
    else:
        if _RESULT_MARK not in result.stdout:
            return False, "runtime error: no return value", result
        got = json.loads(result.stdout.rsplit(_RESULT_MARK, 1)[1])
        try:
            want = json.loads(test.output)
        except json.JSONDecodeError:
            want = test.output
        ok = _values_match(got, want)
    return ok, "" if ok else "wrong answer", result


def grade_code(
    response: str,
    tests: Sequence[CodeTest],
    *,
    fn_name: str | None = None,
    limits: SandboxLimits | None = None,
) -> Grade:
    """Grade a code response: correct when the extracted program passes every test.

    Args:
        response: The model's output.
        tests: The problem's tests (public and private).
        fn_name: The function functional tests call.
        limits: Sandbox limits per test.

    Returns:
        The :class:`Grade`; ``answer`` is the extracted program, ``detail`` names the first
        failing test and why, ``containment`` the sandbox's containment.

    Raises:
        SandboxUnavailable: The containment ``limits`` ask for (namespaces by default) cannot start
            here; nothing was graded.
    """
    code = extract_code(response)
    if code is None:
        return Grade(None, False, "no fenced code block")
    if not tests:
        return Grade(code, False, "the problem has no tests")
    containment = None
    for index, test in enumerate(tests, start=1):
        ok, reason, result = run_test(code, test, fn_name=fn_name, limits=limits)
        containment = result.containment
        if not ok:
            return Grade(code, False, f"test {index}/{len(tests)}: {reason}", containment)
    return Grade(code, True, f"passed {len(tests)} tests", containment)
