"""``beaconkv fidelity``: the command line of the fidelity study (and the trace options ``analyze`` shares)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from ...arguments import (
    RenamedOption,
    add_backend_argument,
    add_kv_storage_argument,
    add_model_arguments,
    add_n_recent_argument,
    add_policy_arg_argument,
    add_threads_argument,
    int_list,
    int_or_auto,
    model_path,
    policy_args_by_policy,
    str_list,
)
from ...models.decoder import CausalLM
from ...models.loading import load_model
from ...policies.config import PolicyConfigError
from ...policies.registry import policy_names
from ...tokenizer import Tokenizer, load_tokenizer
from .errors import FidelityError
from .metrics import GlobalQueryRule, LengthAwareRule
from .oracle import oracle_runs, record_future_attention
from .report import POLICY_ORDER, markdown_table, plot_fidelity, write_csv
from .study import ablation_runs, beacon_count, measure_fidelity, study_runs
from .traces import (
    Trace,
    forced_tokens,
    generate_traces,
    read_trace_records,
    select_records,
    trace_from_record,
)

#: Budgets of the standard run.
DEFAULT_BUDGETS = (64, 128, 256, 512)


def add_trace_arguments(parser: argparse.ArgumentParser, num_traces: int, tokens: int) -> None:
    """Adds the model, trace-source and query-classification options shared by ``fidelity`` and ``analyze``.

    Args:
        parser: The parser.
        num_traces: Default ``--num-traces``.
        tokens: Default ``--tokens``.
    """
    g = parser.add_argument_group("model and traces")
    add_model_arguments(g, device=False)
    g.add_argument("--traces", type=Path, default=None,
                   help="JSONL file (or directory of them) with problem + output fields (default: the project's data/traces)")
    g.add_argument("--trace-ids", type=str_list, default=None,
                   help="comma-separated record ids (default: the first ones)")
    g.add_argument("--num-traces", type=int, default=num_traces, help=f"records to take (default {num_traces})")
    g.add_argument("--tokens", type=int, default=tokens, help=f"forced decode steps per trace (default {tokens})")
    g.add_argument("--generate", action="store_true",
                   help="force text the model writes itself from the records' problems (FullKV, sampled)")
    g.add_argument("--temperature", type=float, default=0.6, help="sampling temperature of --generate (default 0.6)")
    g.add_argument("--top-p", type=float, default=0.95, help="nucleus mass of --generate (default 0.95)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed of --generate")
    g.add_argument("--raw", action="store_true", help="do not render the problem with the chat template")
    q = parser.add_argument_group("global queries (SPEC §1)")
    q.add_argument("--attention-top-k", type=int, default=150, metavar="K",
                   help="a query's K most-attended keys, whose mean distance classifies it as global or local "
                        "(paper 150; was --top-k)")
    q.add_argument("--top-k", action=RenamedOption, new="--attention-top-k",
                   meaning="the most-attended keys averaged per query, not sampling")
    q.add_argument("--global-threshold", type=float, default=200.0,
                   help="mean distance above which a query is global (paper 200; lower it for short traces)")
    q.add_argument("--la-fraction", type=float, default=0.25,
                   help="length-aware rule: mean top-K distance above this share of the context (default 0.25)")
    q.add_argument("--la-recent", type=int, default=64,
                   help="length-aware rule: the recent window excluded from 'far' (default 64 tokens)")
    q.add_argument("--la-mass", type=float, default=0.5,
                   help="length-aware rule: attention share on far generated tokens (default 0.5)")
    add_threads_argument(parser)
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def load_model_and_traces(args: argparse.Namespace) -> tuple[CausalLM, Tokenizer, list[Trace]]:
    """Loads the model and tokenizer named by ``args`` and the traces to force (see :func:`add_trace_arguments`).

    Raises:
        FidelityError: Bad trace selection, ``--tokens`` or ``--threads``.
    """
    if args.threads is not None:
        if args.threads < 1:
            raise FidelityError(f"--threads={args.threads} must be >= 1.")
        torch.set_num_threads(args.threads)
    if args.tokens < 1:
        raise FidelityError(f"--tokens={args.tokens} must be >= 1.")
    records = select_records(read_trace_records(args.traces), args.trace_ids, args.num_traces)
    path = model_path(args.model)
    if getattr(args, "backend", "native") == "hf":
        from ...hf.generation import load_hf_model

        model = load_hf_model(path, dtype=args.dtype)
    else:
        model = load_model(path, dtype=args.dtype)
    tok = load_tokenizer(path)
    if args.generate:
        traces = generate_traces(model, tok, [r["problem"] for r in records], args.tokens, args.temperature,
                                 args.top_p, args.seed)
    else:
        traces = [trace_from_record(r, tok, chat=not args.raw) for r in records]
    return model, tok, traces


def beacon_count_argument(text: str) -> int | str | None:
    """``--n-beacon``: an int, ``auto`` (None), or ``"<k>x"`` (k times ``n_recent``; an argparse type)."""
    if text.strip().lower().endswith("x"):
        try:
            beacon_count(text, 1)
        except FidelityError as err:
            raise argparse.ArgumentTypeError(str(err)) from err
        return text.strip().lower()
    return int_or_auto(text)


def add_fidelity_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the ``beaconkv fidelity`` options to ``parser``.

    Args:
        parser: A parser (or subparser).

    Returns:
        The same parser.
    """
    parser.description = "Teacher-forced fidelity of KV-cache policies against FullKV on reasoning traces."
    add_trace_arguments(parser, num_traces=3, tokens=768)
    p = parser.add_argument_group("policies")
    p.add_argument("--study", choices=("grid", "ablations"), default="grid",
                   help="grid (default): --policies x --budgets; ablations: the paper's ablations at the first budget "
                        "((16,16), (1,31), (28,4), (0,32), mean aggregation, Naive FPS, K-Means)")
    p.add_argument("--oracle", action="store_true",
                   help="also run a hindsight oracle per budget: it keeps what the FullKV reference's later queries "
                        "attend most (a ceiling for eviction; a first FullKV pass, memory layers x steps x traces "
                        "x kv heads x positions x 4 B)")
    p.add_argument("--policies", type=str_list, default=list(POLICY_ORDER),
                   help=f"comma-separated registry names or classes of your own (module:Class, path/to/file.py:Class) "
                        f"(default: the paper's set, {','.join(POLICY_ORDER)}; all: "
                        f"{','.join(n for n in policy_names() if n != 'full')}); --policy-arg KEY=VALUE goes to each "
                        "that takes KEY")
    p.add_argument("--budgets", type=int_list, default=list(DEFAULT_BUDGETS),
                   help="comma-separated budgets (default 64,128,256,512)")
    add_n_recent_argument(p)
    p.add_argument("--n-beacon", type=beacon_count_argument, default=None,
                   help="beacons of the BeaconKV-like policies: a count, or '<k>x' for k times n_recent at each "
                        "budget (e.g. 8x; default: = n_recent)")
    p.add_argument("--n-prefix", type=int_or_auto, default=None,
                   help="protected prefix tokens (default 'prompt': the whole prompt)")
    o = parser.add_argument_group("output")
    o.add_argument("--out", type=Path, default=Path("results/fidelity"),
                   help="output directory (default results/fidelity)")
    o.add_argument("--exact", action="store_true",
                   help="call model.decode_step per run instead of batching the dense layers (slower; same result)")
    o.add_argument("--no-packed", action="store_true",
                   help="run the dense layers with the model's own linears instead of oneDNN-prepacked ones (CPU)")
    add_policy_arg_argument(p)
    add_kv_storage_argument(p)
    add_backend_argument(parser)
    return parser


def check_hf_backend(args: argparse.Namespace) -> None:
    """Refuses what ``--backend hf`` does not run: traces generated by the model, the oracle, int8 storage.

    Raises:
        FidelityError: Naming the option and the fix.
    """
    if getattr(args, "backend", "native") != "hf":
        return
    for flag, on in (("--generate", args.generate), ("--oracle", args.oracle), ("--exact", args.exact),
                     ("--no-packed", args.no_packed)):
        if on:
            raise FidelityError(f"--backend hf forces the records' texts through PolicyCache runs; drop {flag} "
                                "(the native backend has it).")
    if args.kv_storage != "dense":
        raise FidelityError(f"--backend hf stores keys and values densely; drop --kv-storage {args.kv_storage}.")


def run_fidelity(args: argparse.Namespace) -> int:
    """Runs ``beaconkv fidelity`` from parsed arguments: measures, writes CSV/markdown/PNGs, prints the table.

    Returns:
        0 on success.

    Raises:
        FidelityError: Bad settings (before the model loads where they can be checked then).
    """
    t0 = time.perf_counter()
    rule = GlobalQueryRule(args.attention_top_k, args.global_threshold)
    sparse_rule = LengthAwareRule(args.attention_top_k, args.la_fraction, args.la_recent, args.la_mass)
    if args.study == "ablations":
        if args.policy_arg:
            raise FidelityError("--policy-arg applies to the grid (--study grid); the ablations set their own "
                                "parameters.")
        runs = ablation_runs(args.budgets[0] if args.budgets else 256)
    else:
        try:
            extra = policy_args_by_policy(args, args.policies)
        except PolicyConfigError as err:
            raise FidelityError(str(err)) from err
        runs = study_runs(args.policies, args.budgets, args.n_recent, args.n_beacon, args.n_prefix, extra=extra)
    check_hf_backend(args)
    model, _, traces = load_model_and_traces(args)
    tokens = forced_tokens(traces, args.tokens)
    if args.oracle:
        future = record_future_attention(model, [t.prompt_ids for t in traces], tokens)
        runs = runs + oracle_runs(future, args.budgets, args.n_recent, args.n_prefix)
    print(f"forcing {len(traces)} trace(s) ({', '.join(t.name for t in traces)}), {args.tokens} tokens each, "
          f"prompts {[len(t.prompt_ids) for t in traces]} tokens; {len(runs)} runs + FullKV"
          + (f", {args.kv_storage} KV storage" if args.kv_storage != "dense" else ""), file=sys.stderr)
    rows = measure_fidelity(model, traces, runs, args.tokens, rule, stack=not args.exact,
                            progress=not args.no_progress, kv_storage=args.kv_storage, sparse_rule=sparse_rule,
                            packed=not args.no_packed, backend=args.backend)
    wall = time.perf_counter() - t0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, out / "fidelity.csv")
    table = markdown_table(rows)
    (out / "fidelity.md").write_text(table + "\n")
    plots = plot_fidelity(rows, out)
    settings = {
        "argv": sys.argv,
        "traces": [t.name for t in traces], "prompt_tokens": [len(t.prompt_ids) for t in traces],
        "tokens": args.tokens, "budgets": args.budgets, "policies": args.policies, "top_k": rule.top_k,
        "policy_args": dict(args.policy_arg),
        "global_threshold": rule.threshold, "length_aware_rule": dataclasses.asdict(sparse_rule), "study": args.study, "runs": [r.name for r in runs],
        "n_prefix": args.n_prefix, "generated": bool(args.generate),
        "kv_storage": args.kv_storage, "threads": torch.get_num_threads(), "wall_time_s": round(wall, 1),
        "backend": args.backend,
    }
    (out / "run.json").write_text(json.dumps(settings, indent=2) + "\n")
    print(table)
    print(f"\nwrote {out / 'fidelity.csv'}, {out / 'fidelity.md'}, {len(plots)} plots in {out} "
          f"({wall / 60:.1f} min)", file=sys.stderr)
    return 0

