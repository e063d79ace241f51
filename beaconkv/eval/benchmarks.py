"""The benchmark registry and the records every loader produces: :class:`Problem`, :class:`CodeTest`.

A benchmark is a :class:`BenchmarkSpec`: its kind (math, multiple choice, code), a field map saying
which column holds the id, question, answer, choices and tests, the project's own copy of its
problems (AIME24 and MATH-500 ship under ``data/``) and a default file on the Hugging Face hub.
:func:`get_benchmark` finds one by name or alias.

This module only describes benchmarks; reading files is :mod:`beaconkv.eval.datasets`' work, so
the prompts and the graders can know a problem's kind without depending on the loaders.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from .errors import UnknownBenchmarkError

__all__ = [
    "BENCHMARKS",
    "BenchmarkKind",
    "BenchmarkSpec",
    "CodeTest",
    "Problem",
    "get_benchmark",
]

BenchmarkKind = Literal["math", "choice", "code"]
"""What a benchmark asks for: a boxed math answer, a multiple choice letter, or a program."""


@dataclass(frozen=True)
class CodeTest:
    """One test of a code problem.

    Attributes:
        input: The program's stdin (``kind="stdin"``), or one JSON value per line, the arguments of
            the function call (``kind="functional"``).
        output: The expected stdout, or the JSON of the expected return value.
        kind: ``"stdin"`` or ``"functional"``.
    """

    input: str
    output: str
    kind: Literal["stdin", "functional"] = "stdin"


@dataclass(frozen=True)
class Problem:
    """One benchmark problem, independent of the file it came from.

    Attributes:
        benchmark: Registered benchmark name, e.g. ``"aime24"``.
        id: Problem id as a string (the dataset's id column, or the row index if it has none).
        question: The problem statement.
        answer: Gold answer: a LaTeX/plain answer for math, the correct choice's text for multiple
            choice, ``None`` for code.
        choices: Multiple choice only: every option, the correct one first (dataset order).
        starter_code: Code only: the starter code to complete ('' if none).
        tests: Code only: public and private tests.
        fn_name: Code only: the function (method of ``Solution``) that functional tests call.
        metadata: Other columns worth keeping (subject, level, url, ...).
    """

    benchmark: str
    id: str
    question: str
    answer: str | None = None
    choices: tuple[str, ...] = ()
    starter_code: str = ""
    tests: tuple[CodeTest, ...] = ()
    fn_name: str | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class BenchmarkSpec:
    """How to read and prompt one benchmark.

    Attributes:
        name: Canonical name (lower case, underscores).
        kind: ``"math"`` (boxed answer), ``"choice"`` (letter) or ``"code"`` (program + tests).
        fields: Role -> candidate column names; the first column present in a record is used.
            Roles: ``id``, ``question``, ``answer``, ``solution`` (math fallback when no answer
            column: its last ``\\boxed{}``), ``choices`` (multiple choice: every candidate column
            is one option, the correct one first), ``starter_code``, ``public_tests``,
            ``private_tests``, ``metadata`` (code).
        local_file: Name of the project's own copy of the problems, read from
            :func:`beaconkv.paths.benchmark_file` (``<repo>/data/<local_file>.jsonl``) when no
            file and no hub location are given; ``None`` when the project ships none.
        hub_repo: Default hub dataset repository, or ``None`` when the benchmark needs a local file.
        hub_file: File inside ``hub_repo``.
        default_samples: Samples per problem used by the paper (AIME24: 8, others: 4).
        keep: Extra columns copied into :attr:`Problem.metadata`.
        gated: Whether the hub repository requires accepting terms first.
        description: One line for ``--help``.
    """

    name: str
    kind: BenchmarkKind
    fields: Mapping[str, tuple[str, ...]]
    local_file: str | None = None
    hub_repo: str | None = None
    hub_file: str | None = None
    default_samples: int = 4
    keep: tuple[str, ...] = ()
    gated: bool = False
    description: str = ""


_MATH_FIELDS: dict[str, tuple[str, ...]] = {
    "id": ("id", "unique_id", "problem_id", "idx", "ID"),
    "question": ("problem", "question", "Problem", "Question"),
    "answer": ("answer", "Answer", "final_answer", "expected_answer"),
    "solution": ("solution", "Solution"),
}

BENCHMARKS: dict[str, BenchmarkSpec] = {
    spec.name: spec
    for spec in (
        BenchmarkSpec(
            name="aime24",
            kind="math",
            fields=_MATH_FIELDS,
            local_file="aime24",
            hub_repo="HuggingFaceH4/aime_2024",
            hub_file="data/train-00000-of-00001.parquet",
            default_samples=8,
            keep=("url", "year"),
            description="AIME 2024, 30 problems, integer answers (paper: pass@1 over 8 samples).",
        ),
        BenchmarkSpec(
            name="math500",
            kind="math",
            fields=_MATH_FIELDS,
            local_file="math500",
            hub_repo="HuggingFaceH4/MATH-500",
            hub_file="test.jsonl",
            keep=("subject", "level"),
            description="MATH-500 test problems, LaTeX answers.",
        ),
        BenchmarkSpec(
            name="gpqa_diamond",
            kind="choice",
            fields={
                "id": ("Record ID", "id", "record_id"),
                "question": ("Question", "question"),
                "choices": (
                    "Correct Answer",
                    "Incorrect Answer 1",
                    "Incorrect Answer 2",
                    "Incorrect Answer 3",
                ),
            },
            hub_repo="Idavidrein/gpqa",
            hub_file="gpqa_diamond.csv",
            keep=("High-level domain", "Subdomain"),
            gated=True,
            description="GPQA-Diamond, 198 four-way multiple choice questions (gated on the hub).",
        ),
        BenchmarkSpec(
            name="livecodebench",
            kind="code",
            fields={
                "id": ("question_id", "id", "task_id"),
                "question": ("question_content", "question", "problem"),
                "starter_code": ("starter_code",),
                "public_tests": ("public_test_cases",),
                "private_tests": ("private_test_cases",),
                "metadata": ("metadata",),
            },
            hub_repo="livecodebench/code_generation_lite",
            hub_file="test.jsonl",
            keep=("question_title", "platform", "contest_date", "difficulty"),
            description="LiveCodeBench code generation (stdin programs and LeetCode-style functions).",
        ),
        BenchmarkSpec(
            name="math",
            kind="math",
            fields=_MATH_FIELDS,
            description="Any math file with problem/answer columns (needs a local file).",
        ),
    )
}
"""The built-in benchmarks by name (``aime24``, ``math500``, ``gpqa_diamond``, ``livecodebench`` ...)."""

_ALIASES = {
    "aime": "aime24",
    "aime2024": "aime24",
    "aime_2024": "aime24",
    "math_500": "math500",
    "gpqa": "gpqa_diamond",
    "gpqadiamond": "gpqa_diamond",
    "lcb": "livecodebench",
    "live_code_bench": "livecodebench",
    "code_generation_lite": "livecodebench",
}


def get_benchmark(name: str) -> BenchmarkSpec:
    """Return the spec of a benchmark by name or alias (case and ``-``/``_`` insensitive).

    Args:
        name: E.g. ``"aime24"``, ``"MATH-500"``, ``"gpqa"``, ``"lcb"``.

    Returns:
        The registered :class:`BenchmarkSpec`.

    Raises:
        UnknownBenchmarkError: If the name is not registered.
    """
    key = name.strip().lower().replace("-", "_")
    key = _ALIASES.get(key, key)
    if key not in BENCHMARKS:
        known = ", ".join(sorted(BENCHMARKS))
        raise UnknownBenchmarkError(
            f"unknown benchmark {name!r}; choose one of: {known} "
            f"(aliases: {', '.join(sorted(_ALIASES))}). For another math data set use "
            f"--benchmark math --data FILE."
        )
    return BENCHMARKS[key]
