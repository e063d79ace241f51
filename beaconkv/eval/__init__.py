"""Benchmark evaluation: loaders, prompts, graders, a code sandbox and a resumable, sharded runner.

Typical use is the command line (``beaconkv eval``, ``python -m beaconkv.eval``, or
``torchrun -m beaconkv.eval``); the same run from Python (AIME24 is read from the project's
``data/`` folder)::

    from beaconkv.eval import EvalConfig, run_eval
    report = run_eval(EvalConfig(model="embedded", benchmark="aime24", policy="beacon",
                                 budget=1024, samples=8, out_dir="results"))
    print(report.table)

The modules, from the ground up: :mod:`~beaconkv.eval.errors`; :mod:`~beaconkv.eval.benchmarks`
(the registry and the :class:`Problem` record), :mod:`~beaconkv.eval.answers` (answer extraction),
:mod:`~beaconkv.eval.grade`, :mod:`~beaconkv.eval.seeds`, :mod:`~beaconkv.eval.sandbox`;
:mod:`~beaconkv.eval.datasets` (loaders), :mod:`~beaconkv.eval.prompts`,
:mod:`~beaconkv.eval.grading` (math, multiple choice), :mod:`~beaconkv.eval.code_grading`;
:mod:`~beaconkv.eval.response_grading` (picks the grader); :mod:`~beaconkv.eval.results`,
:mod:`~beaconkv.eval.summary`, :mod:`~beaconkv.eval.distributed`, :mod:`~beaconkv.eval.config`,
:mod:`~beaconkv.eval.backend`; :mod:`~beaconkv.eval.runner`; :mod:`~beaconkv.eval.cli`.
"""

from .answers import extract_choice_letter, extract_last_boxed
from .backend import GenerationBackend, load_backend
from .benchmarks import (
    BENCHMARKS,
    BenchmarkSpec,
    CodeTest,
    Problem,
    get_benchmark,
)
from .cli import add_eval_arguments, config_from_args, run_eval_from_args
from .code_grading import extract_code, grade_code
from .config import EvalConfig
from .datasets import load_benchmark, read_records
from .errors import (
    DatasetAccessError,
    DatasetFormatError,
    EvalError,
    MissingFieldError,
    ResultsConflictError,
    UnknownBenchmarkError,
)
from .grade import Grade
from .grading import grade_choice, grade_math, math_answers_equal
from .prompts import BuiltPrompt, build_prompt, render_chat
from .response_grading import grade_response
from .results import set_aside_torn_tail
from .runner import EvalReport, run_eval
from .sandbox import SandboxLimits, SandboxResult, run_python
from .summary import (
    SummaryRow,
    format_summary_table,
    summarize,
    write_summary,
)

__all__ = [
    "BENCHMARKS",
    "BenchmarkSpec",
    "BuiltPrompt",
    "CodeTest",
    "DatasetAccessError",
    "DatasetFormatError",
    "EvalConfig",
    "EvalError",
    "EvalReport",
    "GenerationBackend",
    "Grade",
    "MissingFieldError",
    "Problem",
    "ResultsConflictError",
    "SandboxLimits",
    "SandboxResult",
    "SummaryRow",
    "UnknownBenchmarkError",
    "add_eval_arguments",
    "build_prompt",
    "config_from_args",
    "extract_choice_letter",
    "extract_code",
    "extract_last_boxed",
    "format_summary_table",
    "get_benchmark",
    "grade_choice",
    "grade_code",
    "grade_math",
    "grade_response",
    "load_backend",
    "load_benchmark",
    "math_answers_equal",
    "read_records",
    "render_chat",
    "run_eval",
    "run_eval_from_args",
    "run_python",
    "set_aside_torn_tail",
    "summarize",
    "write_summary",
]
