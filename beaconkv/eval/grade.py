"""The verdict on one response, :class:`Grade`: what every grader returns and the runner records.

It stands alone so that the math and multiple choice graders (:mod:`beaconkv.eval.grading`), the
code grader (:mod:`beaconkv.eval.code_grading`) and the dispatcher above them
(:mod:`beaconkv.eval.response_grading`) share it without importing one another.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Grade"]


@dataclass(frozen=True)
class Grade:
    """The verdict on one response.

    Attributes:
        answer: The extracted answer (boxed content, letter, or program), ``None`` if none found.
        correct: Whether it matches the reference.
        detail: Short reason, e.g. ``"no \\boxed{} answer"`` or ``"test 3/12: wrong answer"``.
        containment: For a graded program, the sandbox containment its tests ran under
            (``"namespaces+cgroup"``, ``"namespaces+rlimit"`` or ``"rlimits-only"``, see
            :mod:`beaconkv.eval.sandbox`); ``None`` when no code ran.
    """

    answer: str | None
    correct: bool
    detail: str = ""
    containment: str | None = None
    error: str | None = None
