"""Prompts per benchmark kind, rendered through the model's chat template.

Following the DeepSeek-R1 usage notes, every instruction goes into the single user message (no
system prompt):

* math: the problem, then ``Please reason step by step, and put your final answer within \\boxed{}.``
* multiple choice (GPQA): the simple-evals template; the four options are shuffled with a random
  generator seeded from (seed, problem id), so every sample of a problem and every rank sees the
  same order, and the answer is a letter on a final ``Answer: X`` line.
* code (LiveCodeBench): the official code generation prompt: the question, then the starter code
  to complete or the instruction to read stdin and write stdout, in a fenced Python block.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Protocol

from .benchmarks import Problem, get_benchmark
from .seeds import derive_seed

__all__ = [
    "BuiltPrompt",
    "ChatTokenizer",
    "MATH_INSTRUCTION",
    "build_prompt",
    "render_chat",
    "shuffle_choices",
]

MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
"""The instruction added to every math problem: reason step by step, answer in ``\\boxed{}``."""

CHOICE_TEMPLATE = (
    "Answer the following multiple choice question. The last line of your response should be of "
    "the following format: 'Answer: $LETTER' (without quotes) where LETTER is one of {letters}. "
    "Think step by step before answering.\n\n{question}\n\n{options}"
)

CODE_PREAMBLE = (
    "You are an expert Python programmer. You will be given a question (problem specification) "
    "and will generate a correct Python program that matches the specification and passes all "
    "tests."
)
CODE_WITH_STARTER = (
    "You will use the following starter code to write the solution to the problem and enclose "
    "your code within delimiters."
)
CODE_WITHOUT_STARTER = (
    "Read the inputs from stdin solve the problem and write the answer to stdout (do not directly "
    "test on the sample inputs). Enclose your code within delimiters as follows. Ensure that when "
    "the python program runs, it reads the inputs, runs the algorithm and writes output to STDOUT."
)


class ChatTokenizer(Protocol):
    """The part of a tokenizer the prompts need."""

    def apply_chat_template(self, messages: list[dict[str, str]], **kwargs: Any) -> Any:
        """Render messages with the model's chat template."""
        ...


@dataclass(frozen=True)
class BuiltPrompt:
    """A prompt before the chat template, with what the grader needs.

    Attributes:
        messages: Chat messages (``[{"role": "user", "content": ...}]``).
        reference: What the grader compares with: the gold answer (math), the gold letter after
            shuffling (multiple choice), ``None`` (code: the problem's tests are used).
        choice_order: Multiple choice only: the shuffled options as shown, A first.
    """

    messages: list[dict[str, str]]
    reference: str | None
    choice_order: tuple[str, ...] = ()


def shuffle_choices(choices: tuple[str, ...], *, seed: int, problem_id: str) -> tuple[list[str], int]:
    """Shuffle multiple choice options deterministically.

    Args:
        choices: The options, the correct one first.
        seed: Base seed of the run.
        problem_id: The problem's id (each problem gets its own order).

    Returns:
        ``(shuffled options, index of the correct option in them)``.
    """
    order = list(range(len(choices)))
    random.Random(derive_seed("choices", seed, problem_id)).shuffle(order)
    return [choices[i] for i in order], order.index(0)


def build_prompt(problem: Problem, *, seed: int = 0) -> BuiltPrompt:
    """Build the user message of a problem and its grading reference.

    Args:
        problem: The problem.
        seed: Base seed (used to shuffle multiple choice options).

    Returns:
        The :class:`BuiltPrompt`.
    """
    kind = get_benchmark(problem.benchmark).kind
    if kind == "math":
        text = f"{problem.question.strip()}\n{MATH_INSTRUCTION}"
        return BuiltPrompt([{"role": "user", "content": text}], problem.answer)
    if kind == "choice":
        options, gold = shuffle_choices(problem.choices, seed=seed, problem_id=problem.id)
        letters = "ABCDEFGHIJ"[: len(options)]
        text = CHOICE_TEMPLATE.format(
            letters=letters,
            question=problem.question.strip(),
            options="\n".join(f"{letter}) {opt}" for letter, opt in zip(letters, options)),
        )
        return BuiltPrompt([{"role": "user", "content": text}], letters[gold], tuple(options))
    text = f"{CODE_PREAMBLE}\n\n### Question:\n{problem.question.strip()}\n\n"
    if problem.starter_code.strip():
        text += f"### Format: {CODE_WITH_STARTER}\n```python\n{problem.starter_code}\n```\n\n"
    else:
        text += f"### Format: {CODE_WITHOUT_STARTER}\n```python\n# YOUR CODE HERE\n```\n\n"
    text += "### Answer: (use the provided format with backticks)\n\n"
    return BuiltPrompt([{"role": "user", "content": text}], None)


def render_chat(
    tokenizer: ChatTokenizer,
    messages: list[dict[str, str]],
    *,
    enable_thinking: bool | None = None,
) -> str:
    """Render chat messages to the prompt text through the tokenizer's chat template.

    Args:
        tokenizer: Anything with ``apply_chat_template``.
        messages: The chat messages.
        enable_thinking: Passed to the template when not ``None`` (Qwen3: ``False`` disables the
            thinking section).

    Returns:
        The rendered prompt, ending with the assistant turn's opening.
    """
    kwargs: dict[str, Any] = {"add_generation_prompt": True, "tokenize": False}
    if enable_thinking is not None:
        kwargs["enable_thinking"] = enable_thinking
    rendered = tokenizer.apply_chat_template(messages, **kwargs)
    if not isinstance(rendered, str):
        raise TypeError(
            f"apply_chat_template(tokenize=False) returned {type(rendered).__name__}, expected str"
        )
    return rendered
