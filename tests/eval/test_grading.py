"""Math and multiple choice graders: a table of known pairs, box extraction, GPQA letters, real traces."""

from __future__ import annotations

import json

import pytest

from beaconkv.eval.answers import extract_choice_letter, extract_last_boxed
from beaconkv.eval.grading import grade_choice, grade_math, math_answers_equal

B = r"\boxed"

# (response, gold, correct)
MATH_PAIRS = [
    # integers and decimals
    (f"so {B}{{204}}", "204", True),
    (f"{B}{{204.0}}", "204", True),
    (f"{B}{{203}}", "204", False),
    (f"{B}{{25}}", "025", True),
    (f"{B}{{10^{{3}}}}", "1000", True),
    (f"{B}{{1{{,}}000}}", "1000", True),
    # fractions, \dfrac vs \frac
    (f"{B}{{\\frac{{1}}{{2}}}}", r"\frac12", True),
    (f"{B}{{\\dfrac{{1}}{{2}}}}", r"\frac{1}{2}", True),
    (f"{B}{{\\tfrac{{3}}{{4}}}}", "3/4", True),
    (f"{B}{{0.5}}", r"\frac{1}{2}", True),
    (f"{B}{{\\frac{{9}}{{2}}}}", "4.5", True),
    (f"{B}{{-\\frac{{2}}{{3}}}}", "-2/3", True),
    (f"{B}{{\\frac{{2}}{{3}}}}", r"-\frac{2}{3}", False),
    (f"{B}{{0.333}}", "1/3", False),
    (f"{B}{{\\dfrac{{14}}{{3}}}}", r"\frac{14}{3}", True),
    # roots
    (f"{B}{{2\\sqrt{{2}}}}", r"\sqrt{8}", True),
    (f"{B}{{\\sqrt{{2}}/2}}", r"\frac{\sqrt{2}}{2}", True),
    (f"{B}{{\\frac{{1}}{{\\sqrt{{2}}}}}}", r"\frac{\sqrt2}{2}", True),
    (f"{B}{{\\frac{{\\sqrt{{3}}}}{{2}}}}", r"\frac{\sqrt3}{2}", True),
    (f"{B}{{\\sqrt{{3}}}}", r"\sqrt{2}", False),
    (f"{B}{{9\\sqrt{{3}}}}", r"9\sqrt3", True),
    # intervals and sets
    (f"{B}{{[1, 2)}}", "[1,2)", True),
    (f"{B}{{(1, 2]}}", "[1,2)", False),
    (f"{B}{{(-\\infty, 3) \\cup (5, \\infty)}}", r"(-\infty,3)\cup(5,\infty)", True),
    (f"{B}{{\\{{1,2\\}}}}", r"\{2,1\}", True),
    (f"{B}{{1,2,3}}", "3, 2, 1", True),
    # degrees, units, money, percent
    (f"{B}{{30^\\circ}}", "30", True),
    (f"{B}{{30^{{\\circ}}}}", r"30^\circ", True),
    (f"{B}{{45}}", r"45^\circ", True),
    (f"{B}{{5\\text{{ cm}}}}", "5", True),
    (f"{B}{{12 \\text{{ inches}}}}", r"12\text{ inches}", True),
    (f"{B}{{4 \\text{{ cm}}^2}}", "4", True),
    (f"{B}{{\\$18.90}}", "18.90", True),
    (f"{B}{{50\\%}}", "50", True),
    # expressions, tuples, equations, matrices
    (f"{B}{{x^{{2}}+2x+1}}", "(x+1)^2", True),
    (f"{B}{{x=5}}", "5", True),
    (f"{B}{{(3, \\frac{{\\pi}}{{2}})}}", r"\left( 3, \frac{\pi}{2} \right)", True),
    (f"{B}{{(3, \\pi)}}", r"\left( 3, \frac{\pi}{2} \right)", False),
    (f"{B}{{2\\pi}}", r"\pi \cdot 2", True),
    (f"{B}{{3+2i}}", "2i+3", True),
    (f"{B}{{\\begin{{pmatrix}} 1 \\\\ 2 \\end{{pmatrix}}}}", r"\begin{pmatrix}1\\2\end{pmatrix}", True),
    (f"{B}{{\\infty}}", r"\infty", True),
    # several boxes: the last one counts
    (f"first {B}{{3}}, then corrected: {B}{{5}}", "5", True),
    (f"first {B}{{3}}, then corrected: {B}{{5}}", "3", False),
    (f"{B}{{\\boxed{{7}}}}", "7", True),
    # no box, unclosed box, empty response
    ("the answer is 42", "42", False),
    (f"so the answer is {B}{{42", "42", False),
    ("", "1", False),
    # text answers
    (f"{B}{{\\text{{Evelyn}}}}", r"\text{Evelyn}", True),
    (f"{B}{{Evelyn}}", r"\text{Evelyn}", True),
    (f"{B}{{\\text{{Alice}}}}", r"\text{Bob}", False),
    (f"{B}{{\\text{{(C)}}}}", r"\text{(C)}", True),
    (f"{B}{{\\textbf{{(B)}}}}", r"\text{(B)}", True),
    (f"{B}{{\\text{{odd}}}}", r"\text{even}", False),
    (f"{B}{{\\text{{Monday}}}}", "Monday", True),
    # \boxed without braces, \fbox
    (f"{B} 5$.", "5", True),
    (r"\fbox{12}", "12", True),
]


def test_table_is_large_enough() -> None:
    assert len(MATH_PAIRS) >= 40


@pytest.mark.parametrize(("response", "gold", "expected"), MATH_PAIRS)
def test_grade_math(response: str, gold: str, expected: bool) -> None:
    assert grade_math(response, gold).correct is expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt{3}}{2}"),
        (r"a \boxed{1} b \boxed{ {2} }", "{2}"),
        (r"\boxed{\{1,2\}}", r"\{1,2\}"),
        (r"\boxed {x}", "x"),
        (r"\boxed{\text{a}} then \boxed{", None),
        ("no box", None),
        (r"\boxedx", None),
    ],
)
def test_extract_last_boxed(text: str, expected: str | None) -> None:
    assert extract_last_boxed(text) == expected


def test_grade_reports_the_extracted_answer() -> None:
    grade = grade_math(r"... \boxed{\dfrac{1}{2}}", "0.5")
    assert grade.answer == r"\dfrac{1}{2}" and grade.correct
    missing = grade_math("I give up", "3")
    assert missing.answer is None and "no \\boxed" in missing.detail


def test_math_answers_equal_is_symmetric_on_simple_cases() -> None:
    assert math_answers_equal("0.5", r"\frac{1}{2}") and math_answers_equal(r"\frac{1}{2}", "0.5")


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("Thinking...\nAnswer: C", "C"),
        ("answer: (B)", "B"),
        ("**Answer: D**", "D"),
        ("**Answer:** A", "A"),
        ("Answer: $A$", "A"),
        ("The answer is (B).", "B"),
        ("Therefore the correct answer is **D**.", "D"),
        (r"So the final choice is \boxed{C}", "C"),
        (r"\boxed{\text{(D)}}", "D"),
        ("Answer: A\nWait, let me reconsider.\nAnswer: B", "B"),
        ("Answer: B ... on reflection \\boxed{C}", "C"),
        ("Final Answer: B", "B"),
        ("Long reasoning.\n\n(C)", "C"),
        ("Long reasoning.\n\nC", "C"),
        ("Answer: a tricky question, I think it is", None),
        ("Answer: E", None),
        ("I think (C) looks plausible but am unsure", None),
        ("", None),
    ],
)
def test_extract_choice_letter(response: str, expected: str | None) -> None:
    assert extract_choice_letter(response) == expected


def test_grade_choice() -> None:
    assert grade_choice("Answer: B", "B").correct
    wrong = grade_choice("Answer: A", "B")
    assert not wrong.correct and wrong.answer == "A"
    assert grade_choice("no idea", "B").answer is None


def test_real_r1_traces_grade_as_documented(project_data) -> None:
    """10 real DeepSeek-R1-Distill-Qwen-7B AIME24 traces: 6 right, 3 wrong, 1 truncated (SOURCE.md)."""
    path = project_data / "traces" / "aime24_r1_distill_qwen_7b.jsonl"
    assert path.is_file(), f"{path} is missing: the project ships it under data/traces/"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    verdicts = {str(r["id"]): grade_math(r["output"], r["answer"]) for r in rows}
    right = {pid for pid, g in verdicts.items() if g.correct}
    assert right == {"60", "61", "65", "67", "68", "69"}
    assert verdicts["66"].answer is None  # truncated at max_new_tokens, no box
    assert verdicts["62"].answer == "39"
