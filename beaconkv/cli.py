"""The ``beaconkv`` command line: ``generate``, ``demo``, and the measuring tools.

Each tool subcommand (``fidelity``, ``analyze``, ``bench``, ``eval``) lives with its module, which
provides ``add_*_arguments(parser)`` and ``run_*(args)``; this file only wires them up.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time

DEMO_PROMPT = (
    "A farmer has 17 sheep. All but 9 run away. How many sheep does the farmer have left? "
    "Think step by step, then give the final answer."
)

# subcommand -> (module, add-arguments function, run function, help)
_TOOLS = {
    "fidelity": ("beaconkv.measure.fidelity", "add_fidelity_arguments", "run_fidelity",
                 "teacher-forced fidelity of policies vs FullKV on reasoning traces"),
    "analyze": ("beaconkv.measure.analysis", "add_analyze_arguments", "run_analyze",
                "thought-revisiting analysis of a trace (plots + summary)"),
    "bench": ("beaconkv.measure.speed", "add_bench_arguments", "run_bench",
              "decode speed, bandwidth and memory benchmark"),
    "eval": ("beaconkv.eval.cli", "add_eval_arguments", "run_eval_from_args",
             "reasoning benchmarks (AIME24, MATH-500, GPQA, LiveCodeBench): pass@1 per policy and budget"),
}


def _policy_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", default="full", help="full, beacon, initial_recent, snapkv, rpc, rkv, h2o, streaming")
    p.add_argument("--budget", type=int, default=None, help="evictable tokens kept per sequence and KV head")
    p.add_argument("--n-recent", type=int, default=None, help="recent tokens always kept (default 16)")
    p.add_argument("--n-beacon", type=int, default=None, help="beacons per query head (BeaconKV)")


def _build_policy(args: argparse.Namespace):
    from .policies import make_policy

    kw = {}
    if args.n_recent is not None:
        kw["n_recent"] = args.n_recent
    if args.n_beacon is not None:
        kw["n_beacon"] = args.n_beacon
    return make_policy(args.policy, budget=args.budget, **kw)


def _generation_arguments(p: argparse.ArgumentParser, default_tokens: int) -> None:
    p.add_argument("--model", default=None, help="checkpoint directory or hub id (default: the embedded SmolLM2-135M)")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-new-tokens", type=int, default=default_tokens)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--raw", action="store_true", help="do not wrap the prompt in the chat template")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    _policy_arguments(p)


def _run_generation(args: argparse.Namespace, prompts: list[str]) -> int:
    import beaconkv

    path = args.model or beaconkv.embedded_model_path()
    t0 = time.perf_counter()
    model = beaconkv.load_model(path, dtype=args.dtype, device=args.device)
    tok = beaconkv.load_tokenizer(path)
    print(f"loaded {path} ({model.config.model_type}, {args.dtype}) in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    policy = _build_policy(args)
    single = len(prompts) == 1

    def stream(i: int, token: int, text: str) -> None:
        if single:
            print(text, end="", flush=True)

    out = beaconkv.generate(
        model, tok, prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed, policy=policy, chat=not args.raw, stream=stream,
        eos_token_ids=[] if args.ignore_eos else None,
    )
    if single:
        print()
    else:
        for i, text in enumerate(out.texts):
            print(f"--- [{i}] ---\n{text}")
    s = out.stats
    print(
        f"\n[{policy!r}] prompt tokens {s.prompt_tokens}, new tokens {s.new_tokens}, finish {out.finish_reasons}\n"
        f"cache capacity {s.cache_capacity} slots ({s.cache_bytes / 2**20:.1f} MiB), peak {s.peak_cache_tokens} tokens, "
        f"evictions {s.evictions}\n"
        f"prefill {s.prefill_s:.2f}s, total {s.wall_time_s:.2f}s, decode {s.tokens_per_s:.1f} tokens/s, "
        f"eviction {s.eviction_s:.2f}s ({100 * s.eviction_s / s.wall_time_s:.1f}% of the total)",
        file=sys.stderr if not getattr(args, "stats_to_stdout", False) else sys.stdout,
    )
    return 0


def build_parser(load: set[str] | None = None) -> argparse.ArgumentParser:
    """The argument parser of the ``beaconkv`` command.

    Args:
        load: Tool subcommands whose modules are imported to declare their flags (default: all);
            the others get a bare parser, so ``beaconkv generate`` doesn't import plotting code.
    """
    parser = argparse.ArgumentParser(prog="beaconkv", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text for one or more prompts")
    g.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    _generation_arguments(g, 256)
    d = sub.add_parser("demo", help="answer a short reasoning prompt with the embedded model")
    _generation_arguments(d, 160)
    d.set_defaults(stats_to_stdout=True)
    for name, (module, add, _, help_) in _TOOLS.items():
        p = sub.add_parser(name, help=help_)
        if load is not None and name not in load:
            continue
        try:
            getattr(importlib.import_module(module), add)(p)
        except (ImportError, AttributeError) as err:  # an optional dependency of that tool is missing
            p.set_defaults(_unavailable=f"{name} is unavailable: {err}")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``beaconkv`` console script."""
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(load={a for a in argv[:1] if a in _TOOLS}).parse_args(argv)
    if getattr(args, "_unavailable", None):
        print(args._unavailable, file=sys.stderr)
        return 2
    if args.command == "generate":
        return _run_generation(args, args.prompt)
    if args.command == "demo":
        return _run_generation(args, [DEMO_PROMPT])
    module, _, run, _ = _TOOLS[args.command]
    return int(getattr(importlib.import_module(module), run)(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
