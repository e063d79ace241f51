"""Synthetic long-context tasks whose answer a KV policy can destroy: deterministic, generated here.

RULER-style tasks (Hsieh et al., 2024: needle-in-a-haystack variants, variable tracking), sized for a
small model that cannot reason but can copy a fact it still attends to. Every case is made from a seed
with :class:`random.Random` only, so a case is the same on every machine and every run. Each case is
text in three parts, tokenised separately so every protocol and every comparator gets the same token
ids:

* ``context``: filler sentences with the facts (needles) inserted at a depth;
* ``decode``: text the model is teacher-forced through *as decode steps* after the prompt (only the
  needle-in-the-decode task has one): the situation of a long chain of thought, where decode-time
  eviction runs between the fact and the moment it is needed;
* ``question``: the continuation prompt that the answer completes.

The answer is graded by :func:`grade`: every expected string must appear in the model's greedy
continuation (RULER's ``string_match_all``).

Tasks (:data:`TASKS`):

* ``passkey``: one 5-digit pass key in the filler;
* ``multikey``: four "special magic numbers" for four different keys; the question asks one;
* ``multivalue``: four magic numbers of one key; the answer must hold all four;
* ``vartrack``: ``VAR X = 12345`` then a chain of two assignments among distractor chains; the answer
  must name the three variables holding the value;
* ``decode_needle``: the pass key in a short prompt, then 1-4K tokens of filler as decode steps, then the
  question.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["TASKS", "Case", "TokenizedCase", "grade", "make_cases", "tokenize_case"]

#: The filler: plain sentences a small model reads without surprise (RULER's "noise" haystack, extended).
FILLER = (
    "The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.",
    "The river runs to the sea.", "A bird sings in the tree.", "The road is long and quiet.",
    "Bread is baked in the morning.", "The clock on the wall ticks.", "Snow falls in the winter.",
    "The cat sleeps by the fire.", "Leaves turn red in the autumn.", "The train leaves at noon.",
    "Children play in the park.", "The lamp lights the room.",
)

#: Keys of the magic-number tasks: ordinary words.
KEYS = (
    "apple", "river", "candle", "garden", "mirror", "pencil", "window", "silver", "forest", "harbor", "lantern",
    "meadow", "pepper", "rocket", "saddle", "tunnel", "violet", "walnut", "anchor", "basket", "cotton", "dragon",
    "feather", "glacier", "hammer", "island", "jacket", "kettle", "ladder", "marble",
)


@dataclass(frozen=True)
class Case:
    """One case of a task, as text.

    Attributes:
        task: The task name.
        index: The case's index in its cell (decides its seed and depth).
        length: The context length asked for, in tokens (the filler is sized to it).
        depth: Where the needles sit in the context, as a fraction (0: start, 1: end).
        context: The prompt before the question.
        decode: Text fed as teacher-forced decode steps after the context ("" for most tasks).
        question: The continuation prompt the answer completes.
        answers: Strings that must all appear in the continuation.
        max_new_tokens: Greedy tokens to generate.
    """

    task: str
    index: int
    length: int
    depth: float
    context: str
    decode: str
    question: str
    answers: tuple[str, ...]
    max_new_tokens: int


@dataclass(frozen=True)
class TokenizedCase:
    """A :class:`Case` as token ids (the context first, no chat template: a raw continuation).

    Attributes:
        case: The text case.
        context_ids: The context's ids (with the tokenizer's BOS, if it adds one).
        decode_ids: The teacher-forced decode ids (exactly the cell's decode length).
        question_ids: The question's ids (no BOS).
    """

    case: Case
    context_ids: tuple[int, ...]
    decode_ids: tuple[int, ...]
    question_ids: tuple[int, ...]


def _digits(rng: random.Random, n: int) -> str:
    return str(rng.randint(10 ** (n - 1), 10**n - 1))


def _var_name(rng: random.Random, used: set[str]) -> str:
    while True:
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(3))
        if name not in used:
            used.add(name)
            return name


class _Filler:
    """Filler sentences sized in tokens (each sentence tokenised once)."""

    def __init__(self, count: Callable[[str], int]) -> None:
        self.sizes = {s: count(" " + s) for s in FILLER}

    def sentences(self, rng: random.Random, tokens: int) -> list[str]:
        out, total = [], 0
        while total < tokens:
            s = rng.choice(FILLER)
            out.append(s)
            total += self.sizes[s]
        return out


def _haystack(filler: _Filler, rng: random.Random, tokens: int, depth: float, needles: Sequence[str]) -> str:
    """Filler of about ``tokens`` tokens with ``needles`` inserted together at ``depth``."""
    sentences = filler.sentences(rng, tokens)
    at = round(depth * len(sentences))
    return " ".join([*sentences[:at], *needles, *sentences[at:]])


def _passkey(filler, rng, length, depth):
    key = _digits(rng, 5)
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    context = "There is an important pass key hidden in the text below. Find it and memorize it. " + _haystack(
        filler, rng, length, depth, [needle])
    return context, "", " What is the pass key? The pass key is", (key,), 10


def _multikey(filler, rng, length, depth):
    keys = rng.sample(KEYS, 4)
    values = [_digits(rng, 7) for _ in keys]
    needles = [f"One of the special magic numbers for {k} is: {v}." for k, v in zip(keys, values)]
    rng.shuffle(needles)
    asked = rng.randrange(len(keys))
    k = keys[asked]
    context = "Some special magic numbers are hidden in the text below. Memorize them. " + _haystack(
        filler, rng, length, depth, needles)
    question = (f" What is the special magic number for {k} mentioned in the text? The special magic number for "
                f"{k} mentioned in the text is")
    return context, "", question, (values[asked],), 12


def _multivalue(filler, rng, length, depth):
    k = rng.choice(KEYS)
    values = [_digits(rng, 7) for _ in range(4)]
    needles = [f"One of the special magic numbers for {k} is: {v}." for v in values]
    context = "Some special magic numbers are hidden in the text below. Memorize them. " + _haystack(
        filler, rng, length, depth, needles)
    question = (f" What are all the special magic numbers for {k} mentioned in the text? The special magic "
                f"numbers for {k} mentioned in the text are")
    return context, "", question, tuple(values), 40


def _vartrack(filler, rng, length, depth):
    used: set[str] = set()
    value = _digits(rng, 5)
    chain = [_var_name(rng, used) for _ in range(3)]
    distractor_value = _digits(rng, 5)
    other = [_var_name(rng, used) for _ in range(3)]
    lines = [f"VAR {chain[0]} = {value}.", f"VAR {chain[1]} = VAR {chain[0]}.", f"VAR {chain[2]} = VAR {chain[1]}."]
    lines += [f"VAR {other[0]} = {distractor_value}.", f"VAR {other[1]} = VAR {other[0]}.",
              f"VAR {other[2]} = VAR {other[1]}."]
    context = "Memorize and track the chain of variable assignments hidden in the text below. " + _haystack(
        filler, rng, length, depth, lines)
    question = (f" Find all variables that are assigned the value {value} in the text above. Answer: According to "
                f"the chain of variable assignment in the text above, 3 variables are assigned the value {value}, "
                "they are: VAR")
    return context, "", question, tuple(chain), 24


def _decode_needle(filler, rng, length, depth):
    key = _digits(rng, 5)
    context = (f"There is an important pass key. The pass key is {key}. Remember it. {key} is the pass key. "
               "Now read on.")
    decode = " " + " ".join(filler.sentences(rng, length + 64))  # trimmed to the cell's exact length in tokens
    return context, decode, " What is the pass key? The pass key is", (key,), 10


TASKS: dict[str, Callable] = {
    "passkey": _passkey,
    "multikey": _multikey,
    "multivalue": _multivalue,
    "vartrack": _vartrack,
    "decode_needle": _decode_needle,
}
"""Task name -> maker ``(filler, rng, length, depth) -> (context, decode, question, answers, max_new_tokens)``;
for ``decode_needle``, ``length`` is the decode steps between the fact and the question."""


def make_cases(task: str, length: int, n: int, count: Callable[[str], int], seed: int = 0) -> list[Case]:
    """The ``n`` cases of one (task, length) cell: depths evenly spread over (0, 1), each case its own seed.

    Args:
        task: A name of :data:`TASKS`.
        length: Context tokens (``decode_needle``: decode steps) the filler is sized to.
        n: Cases.
        count: Counts the tokens of a text (the tokenizer's, without special tokens).
        seed: The suite's seed.

    Returns:
        The cases.

    Raises:
        ValueError: An unknown task or a non-positive size.
    """
    if task not in TASKS:
        raise ValueError(f"task={task!r} is unknown; choose from {', '.join(TASKS)}")
    if length < 1 or n < 1:
        raise ValueError(f"length={length} and n={n} must be >= 1")
    filler = _Filler(count)
    cases = []
    for i in range(n):
        rng = random.Random(f"{seed}:{task}:{length}:{i}")
        depth = (i % 10 + 0.5) / 10  # ten depths, 0.05 .. 0.95
        context, decode, question, answers, new = TASKS[task](filler, rng, length, depth)
        cases.append(Case(task, i, length, depth, context, decode, question, answers, new))
    return cases


def tokenize_case(case: Case, encode: Callable[[str], list[int]], encode_context: Callable[[str], list[int]],
                  decode_length: int = 0) -> TokenizedCase:
    """A case's token ids.

    Args:
        case: The case.
        encode: Text -> ids without special tokens (decode and question).
        encode_context: Text -> ids of a prompt (the tokenizer's BOS where it adds one).
        decode_length: Decode ids kept (the cell's decode steps; 0 for tasks without a decode part).

    Returns:
        The :class:`TokenizedCase`.

    Raises:
        ValueError: The decode text is shorter than ``decode_length`` tokens.
    """
    decode_ids = tuple(encode(case.decode))[:decode_length] if decode_length else ()
    if len(decode_ids) < decode_length:
        raise ValueError(f"case {case.index} of {case.task}: {len(decode_ids)} decode tokens < {decode_length}")
    return TokenizedCase(case, tuple(encode_context(case.context)), decode_ids, tuple(encode(case.question)))


def grade(output: str, answers: Sequence[str]) -> bool:
    """Whether every expected string appears in the output (RULER's ``string_match_all``).

    Args:
        output: The model's continuation.
        answers: The expected strings.

    Returns:
        ``True`` when all appear.
    """
    return all(a in output for a in answers)
