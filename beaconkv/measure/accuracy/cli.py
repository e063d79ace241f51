"""``beaconkv accuracy``: the long-context accuracy suite from the command line."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ...arguments import (
    add_model_argument,
    add_policy_arg_argument,
    add_prefill_chunk_argument,
    add_threads_argument,
    int_list,
    policy_args_by_policy,
    positive_int,
    str_list,
)
from .suite import SuiteConfig, cells_of, load_records, run_suite, summarize


__all__ = ["QUICK", "add_accuracy_arguments", "config_from_args", "run_accuracy"]

QUICK = dict(tasks=("passkey", "decode_needle"), lengths=(1024,), decode_lengths=(512,), compressions=(4.0,),
             policies=("full", "beacon", "snapkv", "streaming"), cases=10)
"""``--quick``: the passkey (both protocols) and the needle in the decode at one length and 4x, four
policies, 10 cases a cell (a few minutes on two cores)."""

def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None


def add_accuracy_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the suite's options to ``parser``."""
    d = SuiteConfig()
    parser.add_argument("--quick", action="store_true",
                        help="a small suite: passkey and the needle in the decode, one length, 4x, four policies, "
                             "10 cases (options given as well override it)")
    parser.add_argument("--tasks", type=str_list, default=None,
                        help=f"tasks, comma-separated (default all: {','.join(d.tasks)})")
    parser.add_argument("--lengths", type=int_list, default=None,
                        help=f"context tokens of the prompt-side tasks (default {','.join(map(str, d.lengths))})")
    parser.add_argument("--decode-lengths", type=int_list, default=None,
                        help="decode steps of the needle in the decode (default "
                             f"{','.join(map(str, d.decode_lengths))})")
    parser.add_argument("--compressions", type=_floats, default=None,
                        help="compression ratios: each cell's budget is its tokens / ratio (default 4,8)")
    parser.add_argument("--policies", type=str_list, default=None,
                        help=f"beaconkv policies, registry names (default {','.join(d.policies)}; full = FullKV)")
    add_policy_arg_argument(parser)
    parser.add_argument("--protocols", type=str_list, default=None,
                        help="aware (question in the compressed prompt), agnostic (context compressed before the "
                             "question, kvpress's protocol); default both")
    parser.add_argument("--compare", default=None, metavar="kvpress:PRESS,...",
                        help="kvpress presses on the same cells (make kvpress-venv first), e.g. "
                             "kvpress:snapkv,expected_attention,tova,knorm,streaming,adakv-snapkv,none")
    parser.add_argument("--kvpress-python", default=None, help="kvpress's interpreter (default .venv-kvpress)")
    parser.add_argument("--cases", type=positive_int, default=None, help=f"cases per cell (default {d.cases})")
    parser.add_argument("--n-prefix", type=int, default=d.n_prefix,
                        help=f"protected leading tokens of every policy (default {d.n_prefix}: the prompt is evictable)")
    add_prefill_chunk_argument(parser)
    parser.add_argument("--batch", type=positive_int, default=d.batch, help=f"cases per session (default {d.batch})")
    parser.add_argument("--seed", type=int, default=d.seed, help="the cases' seed (default 0)")
    add_model_argument(parser)
    parser.add_argument("--out", type=Path, default=Path("results/accuracy"),
                        help="output folder: results.jsonl (resumable), summary.md, summary.json, accuracy.png")
    add_threads_argument(parser)
    parser.add_argument("--num-workers", type=positive_int, default=1, metavar="N",
                        help="processes running cells at once, each loading the model (default 1)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--no-plot", action="store_true", help="do not draw accuracy.png")
    parser.add_argument("--list", action="store_true", help="print the cells and exit")


def config_from_args(args: argparse.Namespace) -> SuiteConfig:
    """The :class:`SuiteConfig` the options describe (``--quick`` first, explicit options over it).

    Raises:
        AccuracyError: A bad setting.
        ValueError: ``--compare`` not of the form ``kvpress:PRESS,...``.
        PolicyConfigError: A ``--policy-arg`` no listed policy takes.
    """
    base = dict(QUICK) if args.quick else {}
    for name in ("tasks", "lengths", "decode_lengths", "compressions", "policies", "protocols", "cases"):
        value = getattr(args, name)
        if value is not None:
            base[name] = tuple(value) if isinstance(value, list) else value
    compare: tuple[str, ...] = ()
    if args.compare:
        engine, _, presses = args.compare.partition(":")
        if engine != "kvpress" or not presses:
            raise ValueError(f"--compare {args.compare!r}: write kvpress:PRESS[,PRESS...] (e.g. kvpress:snapkv,knorm)")
        from .kvpress import PRESSES

        compare = tuple(p.strip() for p in presses.split(",") if p.strip())
        unknown = [p for p in compare if p not in PRESSES]
        if unknown:
            raise ValueError(f"--compare: unknown kvpress presses {unknown}; choose from {', '.join(PRESSES)}")
    policies = base.get("policies", SuiteConfig.policies)
    kwargs = {name: sorted(kw.items()) for name, kw in policy_args_by_policy(args, policies).items() if kw}
    return SuiteConfig(**base, n_prefix=args.n_prefix, prefill_chunk=args.prefill_chunk, batch=args.batch,
                       seed=args.seed, model=args.model or "embedded", compare=compare,
                       kvpress_python=args.kvpress_python, policy_kwargs=kwargs)


def run_accuracy(args: argparse.Namespace) -> int:
    """``beaconkv accuracy``: run the missing cells, then write and print the report."""
    from .report import markdown_report, plot_accuracy

    config = config_from_args(args)
    cells = cells_of(config)
    if args.list:
        for cell in cells:
            print(cell.key)
        return 0
    t0 = time.perf_counter()
    for _ in run_suite(config, args.out, num_workers=args.num_workers, threads=args.threads,
                       progress=not args.no_progress):
        pass
    wanted = {c.key for c in cells}
    rows = summarize([r for k, r in load_records(args.out).items() if k in wanted])
    report = markdown_report(rows)
    (args.out / "summary.md").write_text(report + "\n", encoding="utf-8")
    (args.out / "summary.json").write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    if not args.no_plot:
        plot_accuracy(rows, args.out / "accuracy.png")
    print(report)
    print(f"[{len(rows)} cells, {config.cases} cases each; {time.perf_counter() - t0:.0f} s; {args.out}]",
          file=sys.stderr)
    return 0



