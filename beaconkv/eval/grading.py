"""Graders for math answers (mathematical equivalence) and multiple choice letters.

Math: the answer is the content of the *last* ``\\boxed{}`` of the response
(:func:`~beaconkv.eval.answers.extract_last_boxed`). It is compared with the gold answer first as
normalised text (so text answers such as ``\\text{Evelyn}`` and ``Evelyn`` match), then through
``math-verify``, which parses both sides to sympy and decides equivalence (fractions, ``\\dfrac``,
roots, intervals, sets, degrees, units, percentages, matrices, equations ``x=5`` vs ``5``). A response
without a complete box is wrong.

Multiple choice (GPQA): the letter found by :func:`~beaconkv.eval.answers.extract_choice_letter`
must equal the gold letter.

Code answers are graded by :mod:`beaconkv.eval.code_grading`;
:func:`beaconkv.eval.response_grading.grade_response` picks the grader by the benchmark kind.
"""

from __future__ import annotations

import re
import threading

from .answers import (
    extract_choice_letter,
    extract_last_boxed,
    strip_text_commands,
)
from .grade import Grade

__all__ = ["grade_choice", "grade_math", "math_answers_equal"]


def _normalize_text(s: str) -> str:
    """Light normalisation for an exact-match shortcut (not an equivalence test)."""
    s = s.strip().strip("$").strip()
    s = strip_text_commands(s)
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\\left|\\right|\\!|\\,|\\;|\\:", "", s)
    s = re.sub(r"\^\s*\{?\\circ\}?", "", s)
    s = re.sub(r"\s+", "", s)
    s = s.rstrip(".")
    return s.lower()


def _parse(expr: str, timeout: int | None) -> list:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    configs = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    return parse(f"${expr}$", extraction_config=configs, parsing_timeout=timeout)


def math_answers_equal(pred: str, gold: str, *, timeout_s: int = 5) -> bool:
    """Decide whether two math answers are mathematically equivalent.

    Text-equal answers (after stripping ``\\text{}``, ``\\left``/``\\right``, ``\\dfrac``, degree marks,
    spaces and case) are equal; otherwise both are parsed by ``math-verify`` and compared with its
    ``verify`` (symbolic and numeric equivalence; sets, intervals, matrices, equations).

    Args:
        pred: The predicted answer (LaTeX or plain), e.g. the boxed content.
        gold: The reference answer.
        timeout_s: Time limit for parsing and for verifying (enforced with ``SIGALRM``, so only in
            the main thread; elsewhere no limit applies).

    Returns:
        ``True`` if equivalent.
    """
    if _normalize_text(pred) == _normalize_text(gold):
        return True
    from math_verify import verify

    timeout = timeout_s if threading.current_thread() is threading.main_thread() else None
    gold_parsed = _parse(gold, timeout)
    pred_parsed = _parse(pred, timeout)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout))


def grade_math(response: str, gold: str) -> Grade:
    """Grade a math response by its last boxed answer.

    Args:
        response: The model's full output (reasoning and answer).
        gold: The reference answer.

    Returns:
        The :class:`~beaconkv.eval.grade.Grade`; ``answer`` is the boxed content (``None`` if
        there is no box).
    """
    answer = extract_last_boxed(response)
    if answer is None:
        return Grade(None, False, "no \\boxed{} answer")
    correct = math_answers_equal(answer, gold)
    return Grade(answer, correct, "" if correct else f"{answer!r} is not equivalent to {gold!r}")


def grade_choice(response: str, gold_letter: str, letters: str = "ABCD") -> Grade:
    """Grade a multiple choice response.

    Args:
        response: The model's output.
        gold_letter: The correct letter after shuffling.
        letters: The valid letters.

    Returns:
        The :class:`~beaconkv.eval.grade.Grade`; ``answer`` is the extracted letter.
    """
    letter = extract_choice_letter(response, letters)
    if letter is None:
        return Grade(None, False, "no answer letter found")
    correct = letter == gold_letter
    return Grade(letter, correct, "" if correct else f"chose {letter}, correct is {gold_letter}")
