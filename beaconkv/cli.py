"""The ``beaconkv`` command line: ``generate``, ``demo``, and the measuring and evaluation tools.

Each tool subcommand (``fidelity``, ``analyze``, ``bench``, ``eval``) lives with its package, which
provides ``add_*_arguments(parser)`` and ``run_*(args)``; this file wires them up. Every subcommand
runs through :func:`beaconkv.command.run_command`: a user error is one line,
``beaconkv <command>: error: ...``, with exit status 2 (``--debug`` shows the traceback).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import torch

from . import __version__
from .arguments import (
    add_kv_storage_argument,
    add_model_arguments,
    model_path,
    positive_int,
)
from .command import add_debug_argument, run_command
from .eval.cli import add_eval_arguments, run_eval_from_args
from .execution import CompileConfig
from .generation import generate
from .measure.analysis import add_analyze_arguments, run_analyze
from .measure.fidelity.cli import add_fidelity_arguments, run_fidelity
from .measure.speed.cli import add_bench_arguments, run_bench
from .models.loading import load_model
from .policies.base import EvictionPolicy
from .policies.registry import make_policy, policy_names
from .sampling import SamplingParams
from .tokenizer import load_tokenizer

DEMO_PROMPT = (
    "A farmer has 17 sheep. All but 9 run away. How many sheep does the farmer have left? "
    "Think step by step, then give the final answer."
)

#: subcommand -> (add-arguments function, run function, help)
TOOLS: dict[str, tuple[Callable[[argparse.ArgumentParser], object], Callable[[argparse.Namespace], int], str]] = {
    "fidelity": (add_fidelity_arguments, run_fidelity,
                 "teacher-forced fidelity of policies vs FullKV on reasoning traces"),
    "analyze": (add_analyze_arguments, run_analyze, "thought-revisiting analysis of a trace (plots + summary)"),
    "bench": (add_bench_arguments, run_bench, "decode speed, bandwidth and memory benchmark"),
    "eval": (add_eval_arguments, run_eval_from_args,
             "reasoning benchmarks (AIME24, MATH-500, GPQA, LiveCodeBench): pass@1 per policy and budget"),
}


def add_policy_arguments(p: argparse.ArgumentParser) -> None:
    """``--policy``, ``--budget``, ``--n-recent``, ``--n-beacon``: the policy of a generation."""
    p.add_argument("--policy", default="full", help=f"registry name: {', '.join(policy_names())} (default full)")
    p.add_argument("--budget", type=int, default=None, help="evictable tokens kept per sequence and KV head")
    p.add_argument("--n-recent", type=int, default=None, help="recent tokens always kept (default 16)")
    p.add_argument("--n-beacon", type=int, default=None, help="beacons per query head (BeaconKV)")


def policy_from_args(args: argparse.Namespace) -> EvictionPolicy:
    """The policy named by ``--policy`` and its options (validated before any model loads)."""
    kw = {k: v for k, v in (("n_recent", args.n_recent), ("n_beacon", args.n_beacon)) if v is not None}
    return make_policy(args.policy, budget=args.budget, **kw)


def _generation_arguments(p: argparse.ArgumentParser, default_tokens: int) -> None:
    add_model_arguments(p)
    p.add_argument("--max-new-tokens", type=positive_int, default=default_tokens)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--raw", action="store_true", help="do not wrap the prompt in the chat template")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--compile", action="store_true", help="compile the decode step and the policy's work")
    add_kv_storage_argument(p)
    add_policy_arguments(p)


def run_generation(args: argparse.Namespace, prompts: list[str]) -> int:
    """``beaconkv generate`` / ``demo``: validate the settings, load, generate, stream and print the stats."""
    policy = policy_from_args(args)
    SamplingParams(args.temperature, args.top_p, args.top_k)  # bad sampling settings fail before loading
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    path = model_path(args.model)
    t0 = time.perf_counter()
    model = load_model(path, dtype=args.dtype, device=args.device)
    tok = load_tokenizer(path)
    print(f"loaded {path} ({model.config.model_type}, {args.dtype}) in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    single = len(prompts) == 1

    def stream(i: int, token: int, text: str) -> None:
        if single:
            print(text, end="", flush=True)

    out = generate(
        model, tok, prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed, policy=policy, chat=not args.raw, stream=stream,
        eos_token_ids=[] if args.ignore_eos else None, kv_storage=args.kv_storage,
        compile=CompileConfig() if args.compile else False,
    )
    if single:
        print()
    else:
        for i, text in enumerate(out.texts):
            print(f"--- [{i}] ---\n{text}")
    s = out.stats
    print(
        f"\n[{policy!r}] prompt tokens {s.prompt_tokens}, new tokens {s.new_tokens}, finish {out.finish_reasons}\n"
        f"cache capacity {s.cache_capacity} slots ({s.cache_bytes / 2**20:.1f} MiB, {args.kv_storage}), "
        f"peak {s.peak_cache_tokens} tokens, evictions {s.evictions}\n"
        f"prefill {s.prefill_s:.2f}s, total {s.wall_time_s:.2f}s, decode {s.tokens_per_s:.1f} tokens/s, "
        f"eviction {s.eviction_s:.2f}s ({100 * s.eviction_s / s.wall_time_s:.1f}% of the total)",
        file=sys.stderr if not getattr(args, "stats_to_stdout", False) else sys.stdout,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``beaconkv`` command."""
    parser = argparse.ArgumentParser(prog="beaconkv", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"beaconkv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text for one or more prompts")
    g.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    _generation_arguments(g, 256)
    g.set_defaults(_run=lambda a: run_generation(a, a.prompt))
    d = sub.add_parser("demo", help="answer a short reasoning prompt with the embedded model")
    _generation_arguments(d, 160)
    d.set_defaults(stats_to_stdout=True, _run=lambda a: run_generation(a, [DEMO_PROMPT]))
    for name, (add, run, help_) in TOOLS.items():
        p = sub.add_parser(name, help=help_)
        add(p)
        p.set_defaults(_run=run)
    for p in sub.choices.values():
        add_debug_argument(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``beaconkv`` console script."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    return run_command(args.command, args._run, args)


if __name__ == "__main__":
    sys.exit(main())
