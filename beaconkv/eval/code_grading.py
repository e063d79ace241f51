"""Grade LiveCodeBench-style answers by running the generated program against its tests.

The program is the last fenced code block of the response (```` ```python ```` preferred). Each test
runs in its own sandboxed subprocess (:func:`beaconkv.eval.sandbox.run_python`), in order, stopping at
the first failure, as LiveCodeBench does; the answer is correct when every test passes.

* ``stdin`` tests: the program reads the test input on stdin; its stdout must equal the expected
  output line by line (:func:`~beaconkv.eval.output_matching.outputs_match`: integers exactly,
  numbers written as floats within 1e-6).
* ``functional`` tests (LeetCode): the program defines ``class Solution`` with method ``fn_name``
  (or a top-level function of that name); each input line is one JSON argument; the return value
  must equal the expected JSON value
  (:func:`~beaconkv.eval.output_matching.json_values_match`; tuples compare as lists).

The functional harness sends the return value back on a channel the program cannot forge by
printing: a frame that starts with a random token made for this run (sent on the harness's stdin,
never in argv, the environment or a file) and carries the payload's length, written on a duplicate
of stdout taken before the program runs, while the program's own stdout goes to ``/dev/null``. A
program that prints a fake frame, exits before returning (``os._exit``), or prints more from an
``atexit`` hook is graded by what its function returned, or as a runtime error when it returned
nothing. (Python offers no isolation inside one interpreter: a program that searches the harness's
own frames for the token could still forge a frame; no program writes that by accident.)

Grading a response never raises on what the program does: every outcome is a :class:`Grade`
(wrong answer, runtime error, timeout, memory, output limit, or the containment failure named in
``Grade.error``).

Like LiveCodeBench, a header of common imports (``typing``, ``collections``, ``math``, ...) is
executed before the program.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Sequence

from .benchmarks import CodeTest
from .grade import Grade
from .output_matching import json_values_match, outputs_match, parse_json_value
from .sandbox import SandboxLimits, SandboxResult, SandboxUnavailable, run_python

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

# Runs inside the sandbox: python -I harness.py MODE FN_NAME. Functional mode reads the run's token
# as the first line of stdin, the arguments (one JSON value a line) after it.
HARNESS = r'''
import builtins, json, os, sys


def _main():
    if hasattr(sys, "set_int_max_str_digits"):
        sys.set_int_max_str_digits(0)  # arguments and results may be integers of any length
    mode, fn_name = sys.argv[1], sys.argv[2]
    with open("header.py", encoding="utf-8") as f:
        header = f.read()
    with open("solution.py", encoding="utf-8") as f:
        source = f.read()
    namespace = {"__name__": "__main__" if mode == "stdin" else "solution", "__builtins__": builtins}
    if mode == "stdin":
        exec(compile(header, "header.py", "exec"), namespace)
        exec(compile(source, "solution.py", "exec"), namespace)
        return
    token, _, body = sys.stdin.read().partition("\n")
    args = [json.loads(line) for line in body.split("\n") if line.strip()]
    del body
    result_fd = os.dup(1)  # the result's channel; the program's stdout goes nowhere
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.close(null)
    exec(compile(header, "header.py", "exec"), namespace)
    exec(compile(source, "solution.py", "exec"), namespace)
    if "Solution" in namespace and hasattr(namespace["Solution"], fn_name):
        target = getattr(namespace["Solution"](), fn_name)
    elif callable(namespace.get(fn_name)):
        target = namespace[fn_name]
    else:
        raise NameError(f"no Solution.{fn_name} and no function {fn_name} defined")
    payload = json.dumps(target(*args), default=repr).encode("ascii")
    frame = memoryview(b"\n" + token.encode("ascii") + str(len(payload)).encode("ascii") + b":" + payload)
    while frame:
        frame = frame[os.write(result_fd, frame):]


_main()
'''

#: A returned value's JSON may be this many times longer than the expected one's (plus
#: :data:`_RESULT_SLACK_BYTES`) before it is judged wrong unparsed: spacing and float digits make a
#: correct value a few times longer at most, and parsing a huge one would cost the grader memory.
_RESULT_SIZE_FACTOR = 16
_RESULT_SLACK_BYTES = 1 << 20

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


def _last_line(text: str) -> str:
    """The last non-blank line of ``text``, at most 200 characters, found without splitting it all."""
    text = text.rstrip()
    return text[text.rfind("\n") + 1 :][:200]


def _returned_value(stdout: str, token: str, want_text: str) -> tuple[str | None, str]:
    """The JSON text of the value the harness framed with ``token``, or ``None`` and the reason."""
    marker = "\n" + token
    at = stdout.find(marker)
    if at < 0:
        return None, "runtime error: no return value (the program ended before its function returned)"
    head = at + len(marker)
    colon = stdout.find(":", head, head + 24)
    if colon < 0 or not stdout[head:colon].isdigit():
        return None, "runtime error: the return value's frame is unreadable"
    size = int(stdout[head:colon])
    if size > _RESULT_SIZE_FACTOR * len(want_text) + _RESULT_SLACK_BYTES:
        return None, f"wrong answer (a returned value of {size} bytes for an expected one of {len(want_text)})"
    payload = stdout[colon + 1 : colon + 1 + size]
    if len(payload) < size:
        return None, "runtime error: the return value was cut short"
    return payload, ""


def _functional_verdict(stdout: str, token: str, want_text: str) -> tuple[bool, str]:
    """Compare the returned value framed in ``stdout`` with the expected JSON text."""
    payload, reason = _returned_value(stdout, token, want_text)
    if payload is None:
        return False, reason
    try:
        got = parse_json_value(payload)
    except RecursionError:
        return False, "wrong answer (the returned value nests too deep to compare)"
    except ValueError as exc:  # the harness wrote it with json.dumps: only a forged frame fails here
        return False, f"runtime error: the return value is not JSON ({exc})"
    try:
        want = parse_json_value(want_text)
    except (ValueError, RecursionError):
        want = want_text  # an expected output that is not JSON compares as a string
    ok = json_values_match(got, want)
    return ok, "" if ok else "wrong answer"


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
        ``(passed, reason, sandbox_result)``; ``reason`` is ``""``, ``"wrong answer"`` (possibly
        with why), ``"timeout"``, ``"memory"``, ``"output-limit"`` or ``"runtime error: <what>"``
        (the last line of stderr, or what is wrong with the returned value).

    Raises:
        ValueError: If a functional test has no ``fn_name``.
        SandboxUnavailable: The containment ``limits`` ask for cannot start here.
        RuntimeError: The namespace sandbox's helper failed to start (a host problem, not the
            program's).
    """
    if test.kind == "functional" and not fn_name:
        raise ValueError("a functional test needs fn_name (LiveCodeBench metadata 'func_name')")
    files = {"harness.py": HARNESS, "header.py": IMPORT_HEADER, "solution.py": code}
    token = secrets.token_hex(16) if test.kind == "functional" else ""
    stdin = f"{token}\n{test.input}" if token else test.input
    result = run_python(files, "harness.py", [test.kind, fn_name or "-"], stdin=stdin, limits=limits)
    if result.status != "ok":
        if result.status == "error":
            last = _last_line(result.stderr) or f"exit status {result.returncode}"
            return False, f"runtime error: {last}", result
        return False, result.status, result
    if test.kind == "stdin":
        ok = outputs_match(result.stdout, test.output)
        return ok, "" if ok else "wrong answer", result
    ok, reason = _functional_verdict(result.stdout, token, test.output)
    return ok, reason, result


def grade_code(
    response: str,
    tests: Sequence[CodeTest],
    *,
    fn_name: str | None = None,
    limits: SandboxLimits | None = None,
) -> Grade:
    """Grade a code response: correct when the extracted program passes every test.

    Never raises on what the program does. When the sandbox itself cannot run a test (its
    containment unavailable, its helper failing to start), the grade is wrong with ``error`` naming
    the failure: the response was not judged, and the run's summary counts it apart.

    Args:
        response: The model's output.
        tests: The problem's tests (public and private).
        fn_name: The function functional tests call.
        limits: Sandbox limits per test.

    Returns:
        The :class:`Grade`; ``answer`` is the extracted program, ``detail`` names the first
        failing test and why, ``containment`` the sandbox's containment.
    """
    code = extract_code(response)
    if code is None:
        return Grade(None, False, "no fenced code block")
    if not tests:
        return Grade(code, False, "the problem has no tests")
    containment = None
    for index, test in enumerate(tests, start=1):
        try:
            ok, reason, result = run_test(code, test, fn_name=fn_name, limits=limits)
        except (SandboxUnavailable, RuntimeError, ValueError, OSError) as exc:
            error = f"{type(exc).__name__}: {exc}"
            return Grade(code, False, f"test {index}/{len(tests)}: not graded ({error})", containment, error=error)
        containment = result.containment
        if not ok:
            return Grade(code, False, f"test {index}/{len(tests)}: {reason}", containment)
    return Grade(code, True, f"passed {len(tests)} tests", containment)
