"""The ``beaconkv`` command line: ``generate``, ``demo``, and the measuring and evaluation tools.

Each tool subcommand (``fidelity``, ``analyze``, ``lengths``, ``bench``, ``eval``) lives with its package, which
provides ``add_*_arguments(parser)`` and ``run_*(args)``; this file wires them up, and holds
``generate`` itself; ``demo``, the first thing a new user runs, is :mod:`beaconkv.measure.demo` (BeaconKV at
a budget that evicts many times, compiled, then FullKV, side by side). Every compile prints one line on
stderr when it starts and one with its seconds when it ends (:func:`show_compiles`). The options
several subcommands take (``--model``, ``--device``, ``--dtype``, the policy options, ...) are
defined once, in :mod:`beaconkv.arguments`, so they mean the same everywhere. Every subcommand runs
through :func:`beaconkv.command.run_command`: a user error is one line,
``beaconkv <command>: error: ...``, with exit status 2 (``--debug`` shows the traceback).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

from . import __version__
from .arguments import (
    add_backend_argument,
    add_kernels_argument,
    add_kv_storage_argument,
    add_prefill_chunk_argument,
    add_model_arguments,
    add_n_beacon_argument,
    add_policy_arguments,
    add_threads_argument,
    add_top_k_argument,
    check_generation_settings,
    compile_setting,
    model_path,
    placement,
    positive_int,
    print_thread_hint,
)
from .command import CommandParser, add_debug_argument, run_command
from .distributed.cli import add_tensor_parallel_argument
from .distributed.cli import start_run as start_tensor_parallel_run
from .eval.cli import add_eval_arguments, run_eval_from_args
from .execution.compiled import compile_logger
from .generation import generate
from .measure import demo
from .measure.accuracy.cli import add_accuracy_arguments, run_accuracy
from .measure.analysis import add_analyze_arguments, run_analyze
from .measure.demo import DEMO_DEFAULTS, DEMO_PROMPT, rate_text, run_demo
from .measure.fidelity.cli import add_fidelity_arguments, run_fidelity
from .measure.lengths import add_lengths_arguments, run_lengths
from .measure.memory import add_memory_arguments, run_memory
from .measure.speed.cli import add_bench_arguments, run_bench
from .models.loading import load_model
from .policies.base import EvictionPolicy
from .serve.cli import add_serve_arguments, run_serve
from .tokenizer import load_tokenizer

MOVED_TO_DEMO = ("DEMO_COMPILE_ESTIMATE_S", "DemoRun", "compile_estimate", "final_answer", "token_agreement")
"""Names of the demo that moved to :mod:`beaconkv.measure.demo`; ``beaconkv.cli.<name>`` still finds them for one
release, with a DeprecationWarning."""


def __getattr__(name: str) -> Any:
    if name in MOVED_TO_DEMO:
        warnings.warn(f"beaconkv.cli.{name} moved to beaconkv.measure.demo.{name}; import it from there (the old "
                      "name goes in the next release).", DeprecationWarning, stacklevel=2)
        return getattr(demo, name)
    raise AttributeError(f"module 'beaconkv.cli' has no attribute {name!r}")


class _Stderr(logging.Handler):
    """Writes a record's message on the ``sys.stderr`` of the moment (a test may have replaced it)."""

    def emit(self, record: logging.LogRecord) -> None:
        print(self.format(record), file=sys.stderr, flush=True)


def show_compiles() -> None:
    """Shows every compile's lines (:data:`~beaconkv.execution.compile_log.compile_logger`) on stderr as
    ``beaconkv: compiling the decode step (decode_and_sample)…`` and ``beaconkv: compiled ... in N s`` (once)."""
    if not any(isinstance(h, _Stderr) for h in compile_logger.handlers):
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("beaconkv: %(message)s"))
        compile_logger.addHandler(handler)
        compile_logger.setLevel(logging.INFO)
        compile_logger.propagate = False


#: subcommand -> (add-arguments function, run function, help)
TOOLS: dict[str, tuple[Callable[[argparse.ArgumentParser], object], Callable[[argparse.Namespace], int], str]] = {
    "fidelity": (add_fidelity_arguments, run_fidelity,
                 "teacher-forced fidelity of policies vs FullKV on reasoning traces"),
    "analyze": (add_analyze_arguments, run_analyze, "thought-revisiting analysis of a trace (plots + summary)"),
    "lengths": (add_lengths_arguments, run_lengths,
                "the length effect: how long each policy and budget writes to end of sequence, vs FullKV"),
    "bench": (add_bench_arguments, run_bench, "decode speed, bandwidth and memory benchmark"),
    "memory": (add_memory_arguments, run_memory,
               "the memory each policy needs and the largest batch that fits a device, from the config alone"),
    "accuracy": (add_accuracy_arguments, run_accuracy,
                 "long-context accuracy under compression: passkey, needles, variable tracking, the needle in "
                 "the decode; kvpress side by side"),
    "eval": (add_eval_arguments, run_eval_from_args,
             "reasoning benchmarks (AIME24, MATH-500, GPQA, LiveCodeBench): pass@1 per policy and budget"),
    "serve": (add_serve_arguments, run_serve,
              "OpenAI-compatible HTTP server over the continuous-batching engine (streaming, metrics)"),
}


def _generation_arguments(p: argparse.ArgumentParser, default_tokens: int, *, demo: bool = False) -> None:
    """The options ``generate`` and ``demo`` share; ``demo`` changes the defaults (see :data:`DEMO_DEFAULTS`)."""
    add_model_arguments(p)
    p.add_argument("--max-new-tokens", type=positive_int, default=default_tokens,
                   help=f"most new tokens per prompt (default {default_tokens})")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1] (default 1 = off)")
    add_top_k_argument(p)
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--raw", action="store_true", help="do not wrap the prompt in the chat template")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=demo,
                   help="always generate --max-new-tokens tokens, past end-of-sequence"
                        + (" (default: on, so that the cache fills and evicts)" if demo else " (default: off)"))
    add_threads_argument(p)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=demo,
                   help="compile the decode step and the policy's work with torch.compile"
                        + (" (default: on; --no-compile decodes eagerly)" if demo else " (default: off)"))
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend of --compile (default inductor; aot_eager traces without generating "
                        "code: it checks that a model compiles, at eager speed)")
    add_kv_storage_argument(p)
    add_kernels_argument(p)
    add_prefill_chunk_argument(p)
    add_policy_arguments(p)
    add_n_beacon_argument(p)


def run_generation(args: argparse.Namespace, prompts: list[str]) -> int:
    """``beaconkv generate``: validate the settings, load, generate, stream and print the stats."""
    policy = check_generation_settings(args)  # bad settings fail before anything loads
    if getattr(args, "backend", "native") == "hf":
        return run_hf_generation(args, prompts, policy)
    path = model_path(args.model)
    t0 = time.perf_counter()
    run = start_tensor_parallel_run(args, path)  # None unless --tensor-parallel-size > 1 (this process: rank 0)
    model = run.model if run is not None else load_model(path, dtype=args.dtype, device=args.device)
    tok = load_tokenizer(path)
    print(f"loaded {path} ({model.config.model_type}, {placement(args)}"
          + (f", tensor parallel {run.size}: {model.shard_plan.describe()}" if run is not None else "")
          + f") in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    print_thread_hint()
    single = len(prompts) == 1

    def stream(i: int, token: int, text: str) -> None:
        if single:
            print(text, end="", flush=True)

    with run if run is not None else contextlib.nullcontext():
        out = generate(
            model, tok, prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
            top_k=args.top_k, seed=args.seed, policy=policy, chat=not args.raw, stream=stream,
            eos_token_ids=[] if args.ignore_eos else None, kv_storage=args.kv_storage, compile=compile_setting(args),
            kernels=args.kernels, prefill_chunk=args.prefill_chunk,
        )
    if single:
        print()
    else:
        for i, text in enumerate(out.texts):
            print(f"--- [{i}] ---\n{text}")
    s = out.stats
    print(
        f"\n[{policy!r}] prompt tokens {s.prompt_tokens}, new tokens {s.new_tokens}, finish {out.finish_reasons}\n"
        f"cache capacity {s.cache_capacity} slots ({s.cache_bytes / 2**20:.1f} MiB, {args.kv_storage}"
        + (" per rank" if run is not None else "") + "), "
        f"peak {s.peak_cache_tokens} tokens, evictions {s.evictions}\n"
        f"prefill {s.prefill_s:.2f}s, "
        + (f"compile {s.compile_s:.2f}s, " if s.compiled else "")
        + f"total {s.wall_time_s:.2f}s, decode {rate_text(s.tokens_per_s, ' tokens/s')} "
        f"({f'compiled, {args.compile_backend}, compile time not counted' if s.compiled else 'eager'}), "
        f"eviction {s.eviction_s:.2f}s ({100 * s.eviction_s / s.wall_time_s:.1f}% of the total)",
        file=sys.stderr if not getattr(args, "stats_to_stdout", False) else sys.stdout,
    )
    return 0


def run_hf_generation(args: argparse.Namespace, prompts: list[str], policy: EvictionPolicy) -> int:
    """``beaconkv generate --backend hf``: the model in transformers, its cache a :class:`~beaconkv.hf.PolicyCache`."""
    from .hf.generation import check_hf_options, generate_hf, load_hf_model

    check_hf_options(args.compile, args.kv_storage, args.kernels)
    path = model_path(args.model)
    t0 = time.perf_counter()
    model = load_hf_model(path, dtype=args.dtype, device=args.device)
    tok = load_tokenizer(path)
    print(f"loaded {path} in transformers ({type(model).__name__}, {model.config._attn_implementation}, "
          f"{placement(args)}) in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    print_thread_hint()
    out = generate_hf(model, tok, prompts, policy=policy, max_new_tokens=args.max_new_tokens,
                      temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                      chat=not args.raw, eos_token_ids=[] if args.ignore_eos else None,
                      prefill_chunk=args.prefill_chunk)
    for i, text in enumerate(out.texts or []):
        print(text if len(prompts) == 1 else f"--- [{i}] ---\n{text}")
    s = out.stats
    print(
        f"\n[{policy!r}, transformers] prompt tokens {s.prompt_tokens}, new tokens {s.new_tokens}, "
        f"finish {out.finish_reasons}\n"
        f"cache capacity {s.cache_capacity} slots ({s.cache_bytes / 2**20:.1f} MiB, the policy's layers), "
        f"peak {s.peak_cache_tokens} tokens, evictions {s.evictions}\n"
        f"total {s.wall_time_s:.2f}s, {rate_text(s.tokens_per_s, ' tokens/s')} (prefill included, eager)",
        file=sys.stderr if not getattr(args, "stats_to_stdout", False) else sys.stdout,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``beaconkv`` command."""
    parser = CommandParser(prog="beaconkv", description=__doc__.splitlines()[0].replace("``", ""))
    parser.add_argument("--version", action="version", version=f"beaconkv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text for one or more prompts")
    g.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    _generation_arguments(g, 256)
    add_backend_argument(g)
    add_tensor_parallel_argument(g)
    g.set_defaults(_run=lambda a: run_generation(a, a.prompt))
    d = sub.add_parser("demo", help="BeaconKV vs FullKV on a reasoning prompt: memory, evictions, speed, agreement",
                       description="Answers a reasoning prompt with BeaconKV at a budget that evicts many times "
                                   f"(--budget defaults to {DEMO_DEFAULTS['budget']} here, --n-recent auto to 8; "
                                   "compiled), then with FullKV, and prints both side by side.")
    d.add_argument("--prompt", default=DEMO_PROMPT, help="the question (default: a short word problem)")
    _generation_arguments(d, DEMO_DEFAULTS["max_new_tokens"], demo=True)
    d.set_defaults(_run=run_demo)
    for name, (add, run, help_) in TOOLS.items():
        p = sub.add_parser(name, help=help_)
        add(p)
        p.set_defaults(_run=run)
    for p in sub.choices.values():
        add_debug_argument(p)
        p.set_defaults(_parser=p)  # main() reports an unknown option as this subcommand's error
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``beaconkv`` console script."""
    args, unknown = build_parser().parse_known_args(sys.argv[1:] if argv is None else argv)
    if unknown:
        args._parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    show_compiles()
    return run_command(args.command, args._run, args)


if __name__ == "__main__":
    sys.exit(main())
