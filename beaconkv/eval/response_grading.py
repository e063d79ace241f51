"""Grade one response by its benchmark's kind: math, multiple choice or code.

:func:`grade_response` is the one grading entry of the runner. It looks up the problem's kind in
the registry (:mod:`beaconkv.eval.benchmarks`) and hands the response to the matching grader:
:func:`~beaconkv.eval.grading.grade_math`, :func:`~beaconkv.eval.grading.grade_choice` or
:func:`~beaconkv.eval.code_grading.grade_code`. It stands above those graders, which know nothing
of each other.

It is also the runner's guarantee that one response cannot stop a run: whatever a grader raises
(a bug, a parser that gives up on a hostile answer, a sandbox that cannot start) becomes a wrong
:class:`~beaconkv.eval.grade.Grade` whose ``error`` names the exception, recorded as that sample's
result, so the run goes on and a resume does not meet the same sample again.
"""

from __future__ import annotations

from .benchmarks import Problem, get_benchmark
from .code_grading import grade_code
from .grade import Grade
from .grading import grade_choice, grade_math
from .sandbox import SandboxLimits

__all__ = ["grade_response"]


def grade_response(
    problem: Problem,
    reference: str | None,
    response: str,
    *,
    sandbox_limits: SandboxLimits | None = None,
) -> Grade:
    """Grade one response according to the kind of its benchmark.

    Args:
        problem: The problem answered.
        reference: The reference from :func:`beaconkv.eval.prompts.build_prompt`: the gold answer
            for math, the gold letter for multiple choice, unused for code.
        response: The model's output.
        sandbox_limits: Limits for running code answers (default
            :class:`~beaconkv.eval.sandbox.SandboxLimits`).

    Returns:
        The :class:`~beaconkv.eval.grade.Grade`; never raises (but ``KeyboardInterrupt`` and
        other non-``Exception`` signals): a grader's failure is a wrong grade with ``error`` set.
    """
    try:
        return _grade(problem, reference, response, sandbox_limits)
    except Exception as exc:  # noqa: BLE001 - one sample's grader failure must not end the run
        error = f"{type(exc).__name__}: {str(exc)[:500]}"
        return Grade(None, False, f"not graded ({error})", error=error)


def _grade(problem: Problem, reference: str | None, response: str, sandbox_limits: SandboxLimits | None) -> Grade:
    kind = get_benchmark(problem.benchmark).kind
    if kind == "math":
        return grade_math(response, reference if reference is not None else problem.answer or "")
    if kind == "choice":
        return grade_choice(response, reference or "", letters="ABCDEFGHIJ"[: len(problem.choices)])
    return grade_code(response, problem.tests, fn_name=problem.fn_name, limits=sandbox_limits)
