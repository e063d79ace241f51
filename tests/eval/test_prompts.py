"""Prompts: instructions per benchmark kind, the chat template, the seeded GPQA shuffle."""

from __future__ import annotations

from beaconkv.eval.benchmarks import CodeTest, Problem
from beaconkv.eval.grading import grade_choice
from beaconkv.eval.prompts import (
    MATH_INSTRUCTION,
    build_prompt,
    render_chat,
    shuffle_choices,
)

GPQA = Problem(
    "gpqa_diamond", "rec7", "Which particle?", answer="muon", choices=("muon", "pion", "kaon", "tau")
)


def test_math_prompt_through_the_chat_template(fake_tokenizer) -> None:
    problem = Problem("aime24", "60", "Find $x$.", answer="204")
    built = build_prompt(problem)
    assert built.reference == "204"
    assert built.messages == [{"role": "user", "content": f"Find $x$.\n{MATH_INSTRUCTION}"}]
    text = render_chat(fake_tokenizer, built.messages)
    assert text.endswith("<|im_start|>assistant\n") and "\\boxed{}" in text
    assert fake_tokenizer.calls[-1] == {"add_generation_prompt": True, "tokenize": False}
    render_chat(fake_tokenizer, built.messages, enable_thinking=False)
    assert fake_tokenizer.calls[-1]["enable_thinking"] is False


def test_gpqa_shuffle_is_seeded_and_the_reference_follows_it() -> None:
    built = build_prompt(GPQA, seed=0)
    again = build_prompt(GPQA, seed=0)
    assert built == again
    letter = built.reference
    assert built.choice_order["ABCD".index(letter)] == "muon"
    content = built.messages[0]["content"]
    assert f"{letter}) muon" in content and "'Answer: $LETTER'" in content
    assert grade_choice(f"...\nAnswer: {letter}", letter).correct
    orders = {tuple(shuffle_choices(GPQA.choices, seed=s, problem_id="rec7")[0]) for s in range(20)}
    assert len(orders) > 1  # the seed matters
    for s in range(20):
        options, gold = shuffle_choices(GPQA.choices, seed=s, problem_id="rec7")
        assert sorted(options) == sorted(GPQA.choices) and options[gold] == "muon"


def test_livecodebench_prompt_with_and_without_starter_code() -> None:
    tests = (CodeTest("1\n", "1\n"),)
    with_starter = Problem(
        "livecodebench", "q1", "Return x.", starter_code="class Solution:\n    def f(self, x):\n", tests=tests
    )
    content = build_prompt(with_starter).messages[0]["content"]
    assert "### Question:\nReturn x." in content
    assert "```python\nclass Solution:\n    def f(self, x):\n" in content
    assert "starter code" in content
    plain = Problem("livecodebench", "q2", "Read x, print x.", tests=tests)
    content = build_prompt(plain).messages[0]["content"]
    assert "stdin" in content and "# YOUR CODE HERE" in content
    assert build_prompt(plain).reference is None
