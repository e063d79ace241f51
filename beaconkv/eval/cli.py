"""Command line of the evaluation, shared by ``beaconkv eval``, ``python -m beaconkv.eval`` and torchrun.

``torchrun --nproc-per-node N -m beaconkv.eval ...`` shards the run over N processes.

:func:`add_eval_arguments` fills any ``argparse`` parser (the ``beaconkv`` CLI mounts it as the
``eval`` subcommand); :func:`run_eval_from_args` turns the parsed namespace into an
:class:`~beaconkv.eval.config.EvalConfig`, runs it and prints the summary table on rank 0. Wrong
input is raised, not printed: :func:`beaconkv.command.run_command`, which runs every subcommand,
reports it as one line ``beaconkv eval: error: ...`` with exit status 2.
"""

from __future__ import annotations

import argparse
import sys

from ..arguments import (
    add_backend_argument,
    add_device_argument,
    add_dtype_argument,
    add_kv_storage_argument,
    add_max_batch_argument,
    add_model_argument,
    add_policy_arguments,
    add_prefill_chunk_argument,
    add_top_k_argument,
    key_value,
    policy_settings,
)
from ..distributed.cli import add_tensor_parallel_argument
from .benchmarks import BENCHMARKS
from .config import SANDBOX_CHOICES, EvalConfig
from .runner import EvalReport, run_eval

__all__ = ["add_eval_arguments", "config_from_args", "run_eval_from_args"]

_EPILOG = """\
examples:
  beaconkv eval --model deepseek-ai/DeepSeek-R1-Distill-Qwen-7B --benchmark aime24 \\
      --policy beacon --budget 1024 --samples 8 --max-new-tokens 32768 --out results/
  torchrun --nproc-per-node 8 -m beaconkv.eval --model ... --benchmark math500 --out results/
  python -m beaconkv.eval --model embedded --benchmark aime24 --limit 2 \\
      --max-new-tokens 64 --policy full
  beaconkv eval --backend hf --model path/to/any-decoder --benchmark math500 --out results/

AIME24 and MATH-500 are read from the project's data/ folder unless --data FILE or a hub
location (--hub-repo, --hub-file, --hub-revision) names another source; the other
benchmarks come from the hub (or --data FILE).

All samples of a run flow through one engine of --max-batch cache slots (continuous
batching); each is written to the results as soon as it finishes. Re-running the same command
skips finished samples; results go to <out>/<benchmark>__<policy>__b<budget>.jsonl and the
table to <out>/summary.md.

--backend hf runs the model in Hugging Face transformers (any decoder; one sample at a
time) with the same policy options; it takes neither --compile nor --kv-storage int8.
"""


def add_eval_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the evaluation's options to ``parser``.

    Args:
        parser: A parser (or subparser).

    Returns:
        The same parser.
    """
    parser.description = parser.description or (
        "Evaluate a reasoning model with a compressed KV cache on a benchmark."
    )
    parser.epilog = _EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    names = ", ".join(f"{n} ({s.description})" for n, s in BENCHMARKS.items())
    data = parser.add_argument_group("model and data")
    add_model_argument(data)
    add_backend_argument(data)
    data.add_argument("--benchmark", required=True, help=f"one of: {names}")
    data.add_argument(
        "--data",
        help="local .jsonl/.json/.csv/.parquet file; default: the project's data/<benchmark>.jsonl "
        "(aime24, math500), else the benchmark's hub file",
    )
    data.add_argument("--hub-repo", help="hub dataset repository overriding the default")
    data.add_argument("--hub-file", help="file in the hub repository overriding the default")
    data.add_argument("--hub-revision", help="branch, tag or commit of the hub repository")
    data.add_argument(
        "--field",
        action="append",
        type=key_value,
        default=[],
        metavar="ROLE=COLUMN",
        help="map a role (id, question, answer, solution, choices, starter_code, public_tests, "
        "private_tests, metadata) to a column; choices take CORRECT,WRONG1,...",
    )
    data.add_argument("--limit", type=int, help="only the first N problems (N >= 1)")

    policy = parser.add_argument_group("KV cache policy")
    add_policy_arguments(policy)
    policy.add_argument("--tag", help="label of a policy variant in file names and the table")
    add_kv_storage_argument(policy)
    add_prefill_chunk_argument(policy)

    gen = parser.add_argument_group("sampling (defaults: the paper's)")
    gen.add_argument(
        "--samples", type=int, help="samples per problem (default: 8 for AIME24, 4 for others)"
    )
    gen.add_argument("--max-new-tokens", type=int, default=32768)
    gen.add_argument("--temperature", type=float, default=0.6)
    gen.add_argument("--top-p", type=float, default=0.95)
    add_top_k_argument(gen)
    gen.add_argument("--seed", type=int, default=0, help="base seed of the per-sample seeds")
    gen.add_argument(
        "--enable-thinking",
        choices=("auto", "true", "false"),
        default="auto",
        help="chat template switch (Qwen3); auto leaves the template's default",
    )

    run = parser.add_argument_group("run")
    run.add_argument("--out", default="results", help="results folder (default: results)")
    add_device_argument(run)
    add_max_batch_argument(run)  # results do not depend on it: every sample has its own seed
    run.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="compile the decode step and the policy's work with torch.compile (default: off)",
    )
    add_dtype_argument(run)
    run.add_argument("--save-token-ids", action="store_true", help="store generated token ids")
    run.add_argument("--code-timeout", type=float, default=6.0, help="seconds per code test")
    run.add_argument("--code-memory-mb", type=int, default=1024, help="memory per code test")
    run.add_argument("--sandbox", choices=SANDBOX_CHOICES, default="namespaces",
                     help="containment of generated programs: namespaces (default; the run refuses to start "
                          "where they cannot) or rlimits (an explicit opt-in: no file-system, process or signal "
                          "containment)")
    run.add_argument("--no-progress", action="store_true", help="hide progress bars")
    add_tensor_parallel_argument(run)
    run.add_argument(
        "--dist-timeout-min",
        type=float,
        default=24 * 60,
        help="timeout of the final barrier between ranks, minutes (default: 1440)",
    )
    return parser


def config_from_args(args: argparse.Namespace) -> EvalConfig:
    """Build the run's configuration from parsed arguments.

    Args:
        args: Namespace from a parser filled by :func:`add_eval_arguments`.

    Returns:
        The :class:`EvalConfig`.

    Raises:
        PolicyConfigError: An unknown policy or spec, ``--budget`` with ``--policy full``, or a
            parameter set twice (see :func:`beaconkv.arguments.policy_settings`).
        ValueError: A value :class:`EvalConfig` refuses, such as ``--compile`` or ``--kv-storage int8``
            with ``--backend hf``.
    """
    field_map: dict[str, str | list[str]] = {}
    for role, column in args.field:
        field_map[role] = column.split(",") if role == "choices" else column
    policy = policy_settings(args)
    return EvalConfig(
        model=args.model or "embedded",
        benchmark=args.benchmark,
        data=args.data,
        hub_repo=args.hub_repo,
        hub_file=args.hub_file,
        hub_revision=args.hub_revision,
        field_map=field_map,
        limit=args.limit,
        policy=policy.name,
        budget=policy.budget,
        policy_kwargs=policy.kwargs,
        tag=args.tag,
        samples=args.samples,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        out_dir=args.out,
        dtype=args.dtype,
        device=args.device,
        kv_storage=args.kv_storage,
        prefill_chunk=args.prefill_chunk,
        compile=args.compile,
        backend=args.backend,
        max_batch=args.max_batch,
        enable_thinking={"auto": None, "true": True, "false": False}[args.enable_thinking],
        save_token_ids=args.save_token_ids,
        code_timeout_s=args.code_timeout,
        code_memory_mb=args.code_memory_mb,
        sandbox=args.sandbox,
        progress=not args.no_progress,
        dist_timeout_min=args.dist_timeout_min,
        tensor_parallel_size=args.tensor_parallel_size,
    )


def run_eval_from_args(args: argparse.Namespace) -> int:
    """Run the evaluation described by parsed arguments and print the summary (rank 0).

    Wrong input is raised, never printed here: run through :func:`beaconkv.command.run_command`
    (as ``beaconkv eval`` and ``python -m beaconkv.eval`` do), it becomes one line
    ``beaconkv eval: error: <message>`` and exit status 2.

    Args:
        args: Namespace from a parser filled by :func:`add_eval_arguments`.

    Returns:
        The process exit status, 0.

    Raises:
        ValueError: A value out of range or unknown (``--limit``, ``--dtype``, ``--budget`` ...),
            an unknown benchmark, an unusable data file, or results made with other settings
            (the :class:`~beaconkv.eval.errors.EvalError` family).
        PolicyConfigError: Unknown policy or policy argument.
        FileNotFoundError: The data file or the model checkpoint does not exist.
    """
    config = config_from_args(args)
    report: EvalReport = run_eval(config)
    if report.rank == 0:
        who = "" if report.world_size == 1 else f"rank 0 of {report.world_size}: "
        print(
            f"{who}{report.generated} samples generated, {report.skipped} already done; "
            f"results: {report.results_file}",
            file=sys.stderr,
        )
        print(report.table)
        errors = sum(row.grader_errors for row in report.rows)
        if errors:
            print(
                f"warning: {errors} sample(s) could not be graded (their records' grade_error says why; "
                "they count as wrong above): fix the cause, delete those records and run again",
                file=sys.stderr,
            )
    return 0
