"""Benchmark evaluation: loaders, prompts, graders, a code sandbox and a resumable, sharded runner.

Typical use is the command line (``beaconkv eval``, ``python -m beaconkv.eval``, or
``torchrun -m beaconkv.eval``); the same run from Python::

    from beaconkv.eval import EvalConfig, run_eval
    report = run_eval(EvalConfig(model="embedded", benchmark="aime24", data="aime24.jsonl",
                                 policy="beacon", budget=1024, samples=8, out_dir="results"))
    print(report.table)
"""

from beaconkv.eval.cli import add_eval_arguments, config_from_args, run_eval_from_args
from beaconkv.eval.code_grading import extract_code, grade_code
from beaconkv.eval.datasets import (
    BENCHMARKS,
    BenchmarkSpec,
    CodeTest,
    Problem,
    get_benchmark,
    load_benchmark,
    read_records,
)
from beaconkv.eval.errors import (
    DatasetAccessError,
    DatasetFormatError,
    EvalError,
    MissingFieldError,
    ResultsConflictError,
    UnknownBenchmarkError,
)
from beaconkv.eval.grading import (
    Grade,
    extract_choice_letter,
    extract_last_boxed,
    grade_choice,
    grade_math,
    grade_response,
    math_answers_equal,
)
from beaconkv.eval.prompts import BuiltPrompt, build_prompt, render_chat
from beaconkv.eval.runner import EvalConfig, EvalReport, GenerationBackend, run_eval
from beaconkv.eval.sandbox import SandboxLimits, SandboxResult, run_python
from beaconkv.eval.summary import (
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
    "Grade",
    "GenerationBackend",
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
    "load_benchmark",
    "math_answers_equal",
    "read_records",
    "render_chat",
    "run_eval",
    "run_eval_from_args",
    "run_python",
    "summarize",
    "write_summary",
]
