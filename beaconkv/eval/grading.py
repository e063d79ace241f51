"""Graders for math answers (last ``\\boxed{}``, mathematical equivalence) and multiple choice letters.

Math: the answer is the content of the *last* ``\\boxed{...}`` (or ``\\fbox{...}``) of the response,
braces matched with nesting. It is compared with the gold answer first as normalised text (so text
answers such as ``\\text{Evelyn}`` and ``Evelyn`` match), then through ``math-verify``, which parses
both sides to sympy and decides equivalence (fractions, ``\\dfrac``, roots, intervals, sets, degrees,
units, percentages, matrices, equations ``x=5`` vs ``5``). A response without a complete box is wrong.

Multiple choice (GPQA): the letter of the last ``Answer: X`` / ``answer is X`` / ``\\boxed{X}``; a final
line holding only a letter is the fallback.

Code answers are graded by :mod:`beaconkv.eval.code_grading`; :func:`grade_response` dispatches on the
benchmark kind.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from beaconkv.eval.datasets import Problem
    from beaconkv.eval.sandbox import SandboxLimits

__all__ = [
    "Grade",
    "extract_choice_letter",
    "extract_last_boxed",
    "grade_choice",
    "grade_math",
    "grade_response",
    "math_answers_equal",
]

_BOX_COMMANDS = ("\\boxed", "\\fbox")


@dataclass(frozen=True)
class Grade:
    """The verdict on one response.

    Attributes:
        answer: The extracted answer (boxed content, letter, or program), ``None`` if none found.
        correct: Whether it matches the reference.
        detail: Short reason, e.g. ``"no \\boxed{} answer"`` or ``"test 3/12: wrong answer"``.
    """

    answer: str | None
    correct: bool
    detail: str = ""


def extract_last_boxed(text: str) -> str | None:
    """Return the content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``.

    Braces nest (``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``); escaped braces ``\\{``/``\\}`` do not
    count. ``\\boxed 5`` (no braces) gives ``5``. If the last box is not closed (a truncated
    response), the result is ``None`` rather than an earlier box: the final answer was not given.

    Args:
        text: A model response.

    Returns:
        The stripped content of the last box, or ``None`` if there is no complete box.
    """
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    cmd_end = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
    i = cmd_end
    n = len(text)
    while i < n and text[i] in " \t":
        i += 1
    if i >= n:
        return None
    if text[i] != "{":
        # `\boxed 5`: the argument runs to the next whitespace, `$` or end.
        m = re.match(r"[^\s$]+", text[i:])
        return m.group(0) if m and i > cmd_end else None
    depth = 0
    j = i
    while j < n:
        c = text[j]
        if c == "\\":
            j += 2  # skip the escaped character, e.g. \{ or \}
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j].strip()
        j += 1
    return None


_TEXT_CMD_RE = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")


def _normalize_text(s: str) -> str:
    """Light normalisation for an exact-match shortcut (not an equivalence test)."""
    s = s.strip().strip("$").strip()
    s = _TEXT_CMD_RE.sub(r"\1", s)
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
        The :class:`Grade`; ``answer`` is the boxed content (``None`` if there is no box).
    """
    answer = extract_last_boxed(response)
    if answer is None:
        return Grade(None, False, "no \\boxed{} answer")
    correct = math_answers_equal(answer, gold)
    return Grade(answer, correct, "" if correct else f"{answer!r} is not equivalent to {gold!r}")


def extract_choice_letter(response: str, letters: str = "ABCD") -> str | None:
    """Extract the chosen letter of a multiple choice response.

    Looks for ``Answer: X`` (also bold, ``$X$``, ``(X)``), ``answer is X`` and ``\\boxed{X}``
    (also ``\\boxed{\\text{(X)}}``) and returns the letter of the match that ends last. If none
    matches, a last non-empty line holding only a letter (``C``, ``(C)``, ``**C**``) is accepted.

    Args:
        response: The model's output.
        letters: The valid letters, e.g. ``"ABCD"``.

    Returns:
        The upper-case letter, or ``None`` if no valid letter is found.
    """
    cls = f"[{re.escape(letters)}]"
    patterns = [
        rf"(?i:answer)\s*(?:\*\*)?\s*[:：]\s*(?:\*\*)?\s*\$?\(?\s*({cls})\s*\)?\$?(?![A-Za-z])",
        rf"(?i:answer\s+is)\s*:?\s*(?:\*\*)?\s*(?:option\s+|choice\s+)?\$?\(?\s*({cls})\s*\)?\$?(?![A-Za-z])",
    ]
    best: tuple[int, str] | None = None
    for pattern in patterns:
        for m in re.finditer(pattern, response):
            if best is None or m.end() > best[0]:
                best = (m.end(), m.group(1))
    box = extract_last_boxed(response)
    if box is not None:
        inner = _TEXT_CMD_RE.sub(r"\1", box).strip().strip("()").strip()
        if len(inner) == 1 and inner in letters:
            end = response.rfind(box) + len(box)
            if best is None or end > best[0]:
                best = (end, inner)
    if best is not None:
        return best[1]
    lines = [line.strip() for line in response.strip().splitlines() if line.strip()]
    if lines:
        m = re.fullmatch(rf"[*_]*\(?({cls})\)?[*_]*\.?", lines[-1])
        if m:
            return m.group(1)
    return None


def grade_choice(response: str, gold_letter: str, letters: str = "ABCD") -> Grade:
    """Grade a multiple choice response.

    Args:
        response: The model's output.
        gold_letter: The correct letter after shuffling.
        letters: The valid letters.

    Returns:
        The :class:`Grade`; ``answer`` is the extracted letter.
    """
    letter = extract_choice_letter(response, letters)
    if letter is None:
        return Grade(None, False, "no answer letter found")
    correct = letter == gold_letter
    return Grade(letter, correct, "" if correct else f"chose {letter}, correct is {gold_letter}")


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
        sandbox_limits: Limits for running code answers (default :class:`SandboxLimits`).

    Returns:
        The :class:`Grade`.
    """
    from beaconkv.eval.datasets import get_benchmark

    kind = get_benchmark(problem.benchmark).kind
    if kind == "math":
        return grade_math(response, reference if reference is not None else problem.answer or "")
    if kind == "choice":
        return grade_choice(response, reference or "", letters="ABCDEFGHIJ"[: len(problem.choices)])
    from beaconkv.eval.code_grading import grade_code

    return grade_code(response, problem.tests, fn_name=problem.fn_name, limits=sandbox_limits)
