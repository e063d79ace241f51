"""The ``beaconkv`` command line: ``generate``, ``demo``, and the measuring and evaluation tools.

Each tool subcommand (``fidelity``, ``analyze``, ``lengths``, ``bench``, ``eval``) lives with its package, which
provides ``add_*_arguments(parser)`` and ``run_*(args)``; this file wires them up, and holds
``generate`` and ``demo`` themselves. ``demo`` is the first thing a new user runs: it answers a
reasoning prompt with BeaconKV at a budget that evicts many times, compiled, then with FullKV, and
prints the two side by side (cache slots and MiB, evictions, decode speed, agreement). The options
several subcommands take (``--model``, ``--device``, ``--dtype``, the policy options, ...) are
defined once, in :mod:`beaconkv.arguments`, so they mean the same everywhere. Every subcommand runs
through :func:`beaconkv.command.run_command`: a user error is one line,
``beaconkv <command>: error: ...``, with exit status 2 (``--debug`` shows the traceback).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import re
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from . import __version__
from .arguments import (
    DEFAULT_BUDGET,
    WORKLOAD_BUDGETS,
    add_backend_argument,
    add_kernels_argument,
    add_kv_storage_argument,
    add_prefill_chunk_argument,
    add_model_arguments,
    add_n_beacon_argument,
    add_policy_arguments,
    add_threads_argument,
    add_top_k_argument,
    model_path,
    policy_from_args,
    positive_int,
)
from .command import CommandParser, add_debug_argument, run_command
from .distributed.cli import add_tensor_parallel_argument
from .distributed.cli import start_run as start_tensor_parallel_run
from .eval.answers import extract_last_boxed
from .eval.cli import add_eval_arguments, run_eval_from_args
from .execution import CompileConfig
from .generation import GenerationOutput, generate
from .measure.accuracy.cli import add_accuracy_arguments, run_accuracy
from .measure.analysis import add_analyze_arguments, run_analyze
from .measure.fidelity.cli import add_fidelity_arguments, run_fidelity
from .measure.lengths import add_lengths_arguments, run_lengths
from .measure.memory import add_memory_arguments, run_memory
from .measure.speed.cli import add_bench_arguments, run_bench
from .models.decoder import CausalLM
from .models.loading import load_model, resolve_device, resolve_dtype
from .policies.base import EvictionPolicy, FullKV
from .sampling import SamplingParams
from .serve.cli import add_serve_arguments, run_serve
from .session import Session
from .tokenizer import Tokenizer, load_tokenizer

#: The demo's question: a word problem that invites step-by-step reasoning.
DEMO_PROMPT = (
    "A farmer has 17 sheep. All but 9 run away. How many sheep does the farmer have left? "
    "Think step by step, then give the final answer."
)

#: ``beaconkv demo``'s defaults: at its budget (``WORKLOAD_BUDGETS["demo"]``, 64, where ``--n-recent auto``
#: is 8, the 8-token eviction step), 320 new tokens past the protected prompt evict 32 times.
DEMO_DEFAULTS = {"budget": WORKLOAD_BUDGETS["demo"], "max_new_tokens": 320}

#: Seconds the demo's compiles of the embedded model's decode step took on this project's 2-core CPU
#: (inductor, float32, 2 threads) with an empty (``cold``) and a filled (``warm``) inductor cache:
#: BeaconKV's cache size first, then FullKV's. The demo announces these until it has timed a compile
#: on the machine it runs on, then the time it measured.
DEMO_COMPILE_ESTIMATE_S = {"decode": {"cold": 55.0, "warm": 15.0}, "decode-fullkv": {"cold": 40.0, "warm": 15.0}}

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


def _check_generation_settings(args: argparse.Namespace, default_budget: int = DEFAULT_BUDGET) -> EvictionPolicy:
    """Validates the policy, sampling, dtype and device options before anything loads, applies ``--threads``.

    Args:
        args: The parsed options.
        default_budget: The budget without ``--budget``.

    Returns:
        The policy ``--policy`` and its options name.

    Raises:
        beaconkv.policies.PolicyConfigError: An unknown policy or inconsistent settings.
        ValueError: Bad sampling settings, an unsupported dtype or an unavailable device.
    """
    policy = policy_from_args(args, default_budget)
    SamplingParams(args.temperature, args.top_p, args.top_k)
    resolve_dtype(args.dtype, resolve_device(args.device))
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    return policy


def _compile_setting(args: argparse.Namespace) -> CompileConfig | bool:
    """``--compile``/``--compile-backend`` as ``generate``'s ``compile``.

    Static shapes (``dynamic=False``): a second cache size (the demo's FullKV run after BeaconKV)
    compiles a second static graph, which inductor's on-disk cache keeps for the next run, instead
    of a shape-generic graph that is recompiled every time.
    """
    return CompileConfig(backend=args.compile_backend, dynamic=False) if args.compile else False


def run_generation(args: argparse.Namespace, prompts: list[str]) -> int:
    """``beaconkv generate``: validate the settings, load, generate, stream and print the stats."""
    policy = _check_generation_settings(args)  # bad settings fail before anything loads
    if getattr(args, "backend", "native") == "hf":
        return run_hf_generation(args, prompts, policy)
    path = model_path(args.model)
    t0 = time.perf_counter()
    run = start_tensor_parallel_run(args, path)  # None unless --tensor-parallel-size > 1 (this process: rank 0)
    model = run.model if run is not None else load_model(path, dtype=args.dtype, device=args.device)
    tok = load_tokenizer(path)
    print(f"loaded {path} ({model.config.model_type}, {_placement(args)}"
          + (f", tensor parallel {run.size}: {model.shard_plan.describe()}" if run is not None else "")
          + f") in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    single = len(prompts) == 1

    def stream(i: int, token: int, text: str) -> None:
        if single:
            print(text, end="", flush=True)

    with run if run is not None else contextlib.nullcontext():
        out = (run.generate if run is not None else functools.partial(generate, model))(
            tok, prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
            top_k=args.top_k, seed=args.seed, policy=policy, chat=not args.raw, stream=stream,
            eos_token_ids=[] if args.ignore_eos else None, kv_storage=args.kv_storage, compile=_compile_setting(args),
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
        + f"total {s.wall_time_s:.2f}s, decode {s.tokens_per_s:.1f} tokens/s "
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
          f"{_placement(args)}) in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
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
        f"total {s.wall_time_s:.2f}s, {s.tokens_per_s:.1f} tokens/s (prefill included, eager)",
        file=sys.stderr if not getattr(args, "stats_to_stdout", False) else sys.stdout,
    )
    return 0


def _placement(args: argparse.Namespace) -> str:
    """``--dtype`` and ``--device`` as resolved (``auto`` made concrete): ``"float32, cpu"``."""
    device = resolve_device(args.device)
    return f"{str(resolve_dtype(args.dtype, device)).removeprefix('torch.')}, {device}"


# ------------------------------------------------------------------------------------------- demo
@dataclass
class DemoRun:
    """One generation of ``beaconkv demo``: its output and its clock.

    Attributes:
        label: How the table names it (``FullKV``, ``BeaconKV(budget=64)``).
        out: The generation's output.
        first_step_s: Seconds of the first decode step (compilation included when compiled).
        tokens_per_s: Decode tokens per second once compiled: the steps after the first eviction
            (all graphs compiled by then) for an evicting policy, after the first step otherwise.
        answer_ids: The new tokens up to and including the first end-of-sequence token.
        finished: Whether the model produced an end-of-sequence token (its answer ended by itself).
    """

    label: str
    out: GenerationOutput
    first_step_s: float
    tokens_per_s: float
    answer_ids: list[int]
    finished: bool = False

    def answer(self, tok: Tokenizer) -> str | None:
        """The final answer of the response up to its first end-of-sequence token (see :func:`final_answer`)."""
        return final_answer(tok.decode(self.answer_ids), self.finished)


def _demo_generation(model: CausalLM, tok: Tokenizer, args: argparse.Namespace, policy: EvictionPolicy,
                     label: str, show: bool) -> DemoRun:
    """Runs one greedy generation of the demo prompt, timing every decode step; streams it when ``show``.

    When compiling, ``[decode step compiled in N s]`` is printed (stderr) as soon as the first decode step is
    done, and the text streamed before it (the prefill's token) is held back until then.
    """
    eos = set(tok.eos_token_ids)
    first_token: list[float] = []
    ends: list[float] = []
    evict_s: list[float] = []
    ended = [False]
    held: list[str] = []

    def stream(i: int, token: int, text: str) -> None:
        if not first_token:
            first_token.append(time.perf_counter())
        if show:
            if args.compile and not ends:
                held.append(text)
            else:
                print(text, end="", flush=True)
            if token in eos and args.ignore_eos and not ended[0]:
                print("\n[end of the model's answer: decoding goes on past end-of-sequence (--ignore-eos) so that "
                      "the cache keeps filling]", flush=True)
        ended[0] = ended[0] or token in eos

    def on_step(step: int, session: Session) -> None:
        ends.append(time.perf_counter())
        evict_s.append(session.state.stats.eviction_seconds)
        if len(ends) == 1 and args.compile:
            print(f"[decode step compiled in {ends[0] - first_token[0]:.0f} s]", file=sys.stderr, flush=True)
            print("".join(held), end="", flush=True)

    out = generate(
        model, tok, args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed, policy=policy, chat=not args.raw, stream=stream, on_step=on_step,
        eos_token_ids=[] if args.ignore_eos else None, kv_storage=args.kv_storage, compile=_compile_setting(args),
        kernels=args.kernels, prefill_chunk=args.prefill_chunk,
    )
    if show:
        print(flush=True)
    first_step = ends[0] - first_token[0] if ends and first_token else math.nan
    # steady state: after the first eviction (which compiles the eviction graphs), else after the first step
    start = next((i for i in range(1, len(evict_s)) if evict_s[i] > evict_s[i - 1]), 0)
    start = start if len(ends) - 1 - start >= 4 else 0
    window = len(ends) - 1 - start
    tokens_per_s = window / (ends[-1] - ends[start]) if window > 0 else out.stats.tokens_per_s
    ids = out.token_ids[0]
    stop = next((i + 1 for i, t in enumerate(ids) if t in eos), None)
    return DemoRun(label, out, first_step, tokens_per_s, ids[:stop], stop is not None)


def final_answer(text: str, finished: bool = True) -> str | None:
    """The final answer a response states: its last ``\\boxed{}``, else the number after "answer", else its last number.

    Args:
        text: A response.
        finished: Whether the response ended by itself; a cut-off one gets no last-number fallback
            (its last number is mid-reasoning, not an answer).

    Returns:
        The answer as written (a number without thousands separators), or None when it states none.
    """
    boxed = extract_last_boxed(text)
    if boxed:
        return boxed.strip()
    stated = re.findall(r"answer\W{0,20}?(?:is\W{0,5})?(-?\d[\d,]*(?:\.\d+)?)", text, flags=re.IGNORECASE)
    numbers = stated or (re.findall(r"-?\d[\d,]*(?:\.\d+)?", text) if finished else [])
    return numbers[-1].replace(",", "").rstrip(".") if numbers else None


def token_agreement(reference: list[int], other: list[int]) -> tuple[float, int | None]:
    """Share of positions where two token sequences hold the same token, and the first position that differs.

    Args:
        reference: The reference tokens (FullKV's).
        other: The tokens to compare.

    Returns:
        ``(share, first_difference)``: the share over the longer sequence, and the first index that
        differs (None when the sequences are identical).
    """
    n = max(len(reference), len(other))
    if n == 0:
        return 1.0, None
    same = sum(a == b for a, b in zip(reference, other))
    first = next((i for i, (a, b) in enumerate(zip(reference, other)) if a != b), None)
    if first is None and len(reference) != len(other):
        first = min(len(reference), len(other))
    return same / n, first


def _compile_times_file() -> Path:
    """Where the demo keeps the compile times it measured on this machine (next to the embedded model)."""
    return Path(os.environ.get("BEACONKV_CACHE") or Path.home() / ".cache" / "beaconkv") / "demo-compile-times.json"


def _inductor_cache_state() -> str:
    """``"warm"`` when inductor's on-disk graph cache holds graphs, else ``"cold"``."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        folder = Path(cache_dir()) / "fxgraph"
        return "warm" if folder.is_dir() and any(folder.iterdir()) else "cold"
    except (ImportError, OSError):
        return "cold"


def _compile_key(args: argparse.Namespace, what: str, state: str) -> str:
    device = resolve_device(args.device)
    dtype = str(resolve_dtype(args.dtype, device)).removeprefix("torch.")
    return (f"{what} torch={torch.__version__} {device} {dtype} threads={torch.get_num_threads()} "
            f"{args.compile_backend} model={args.model or 'embedded'} {state}")


def compile_estimate(args: argparse.Namespace, what: str, state: str | None = None) -> float:
    """Seconds the demo's compile ``what`` (``"decode"``, ``"decode-fullkv"``) is expected to take here.

    Args:
        args: The demo's options (device, dtype, threads, backend and model key the measurements).
        what: Which compile.
        state: ``"cold"`` or ``"warm"``: inductor's on-disk cache when the demo started (None: now).

    Returns:
        The last time measured on this machine for these settings and cache state, else
        :data:`DEMO_COMPILE_ESTIMATE_S` (measured on this project's 2-core CPU).
    """
    state = state or _inductor_cache_state()
    try:
        recorded = json.loads(_compile_times_file().read_text()).get(_compile_key(args, what, state))
    except (OSError, ValueError, AttributeError):
        recorded = None
    if isinstance(recorded, (int, float)) and math.isfinite(recorded) and recorded > 0:
        return float(recorded)
    return DEMO_COMPILE_ESTIMATE_S.get(what, DEMO_COMPILE_ESTIMATE_S["decode"])[state]


def _record_compile_time(args: argparse.Namespace, what: str, state: str, seconds: float) -> None:
    """Remembers a measured compile time for the next estimate (best effort: a read-only home is fine)."""
    if not math.isfinite(seconds):
        return
    path = _compile_times_file()
    try:
        times = json.loads(path.read_text()) if path.is_file() else {}
        times = times if isinstance(times, dict) else {}
        times[_compile_key(args, what, state)] = round(seconds, 1)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(times, indent=1, sort_keys=True) + "\n")
    except (OSError, ValueError):
        pass


def _timed_demo_generation(model: CausalLM, tok: Tokenizer, args: argparse.Namespace, policy: EvictionPolicy,
                           label: str, show: bool, what: str, announce: str, state: str) -> DemoRun:
    """:func:`_demo_generation`, announcing the compile beforehand and remembering how long it took."""
    if args.compile:
        print(f"{announce} (once, ~{compile_estimate(args, what, state):.0f} s)…", file=sys.stderr, flush=True)
    run = _demo_generation(model, tok, args, policy, label, show)
    if args.compile:
        _record_compile_time(args, what, state, run.first_step_s)
    return run


def _demo_table(full: DemoRun, test: DemoRun, tok: Tokenizer, args: argparse.Namespace) -> str:
    """The side-by-side comparison the demo ends with."""
    share, first = token_agreement(full.out.token_ids[0], test.out.token_ids[0])
    answers = [r.answer(tok) for r in (full, test)]
    mode = f"compiled, {args.compile_backend}" if args.compile else "eager"
    n = len(full.out.token_ids[0])

    def column(r: DemoRun, answer: str | None) -> list[str]:
        s = r.out.stats
        cells = [f"{s.cache_capacity}", f"{s.cache_bytes / 2**20:.2f} MiB", f"{s.peak_cache_tokens}",
                 f"{s.evictions[0]}", f"{r.tokens_per_s:.1f}", answer or "(none stated)"]
        if args.compile:
            cells.insert(4, f"{s.compile_s:.1f}")
        return cells

    names = ["cache slots per KV head", "KV cache memory", "most tokens held", "evictions",
             f"decode tokens/s ({mode})", "final answer"]
    if args.compile:  # once per setting and process (inductor's disk cache shortens the next process's)
        names.insert(4, "compile seconds (once)")
    left, right = column(full, answers[0]), column(test, answers[1])
    agreement = "identical" if first is None else f"{share:.0%} of {n} positions, first difference at token {first}"
    ratio = full.out.stats.cache_bytes / max(test.out.stats.cache_bytes, 1)
    w0, w1 = max(map(len, names)) + 2, max(len(full.label), len("(reference)"), *map(len, left)) + 3
    lines = [f"{'':{w0}}{full.label:{w1}}{test.label}"]
    lines += [f"{name:{w0}}{a:{w1}}{b}" for name, a, b in zip(names, left, right)]
    lines += [f"{'tokens same as FullKV':{w0}}{'(reference)':{w1}}{agreement}",
              f"{'final answers match':{w0}}" + ("- (neither states one)" if answers == [None, None]
                                                 else "yes" if answers[0] == answers[1] else "no"),
              ""]
    notes = [f"{test.label} held the cache at {test.out.stats.cache_capacity} slots per KV head ({ratio:.1f}x less "
             f"KV memory than FullKV for these {n} tokens) and evicted {test.out.stats.evictions[0]} times; FullKV's "
             "cache grows with every token, the compressed one stays this size however long the answer.",
             "The embedded SmolLM2-135M is a small model, not a reasoner: its answers are often wrong, with or "
             "without eviction. The demo shows memory, evictions, speed and agreement with FullKV; accuracy needs "
             "a reasoning model (e.g. --model Qwen/Qwen3-4B on a GPU) and `beaconkv eval`."]
    lines += [textwrap.fill(note, 100) for note in notes]
    return "\n".join(lines)


def run_demo(args: argparse.Namespace) -> int:
    """``beaconkv demo``: the demo prompt with the chosen policy (compiled, streamed), then FullKV, side by side.

    Returns:
        0 on success.

    Raises:
        beaconkv.policies.PolicyConfigError: Bad policy settings (before the model loads).
        ValueError: Bad sampling settings, dtype or device (before the model loads).
    """
    policy = _check_generation_settings(args, DEMO_DEFAULTS["budget"])
    if not args.prompt.strip():
        raise ValueError("--prompt is empty; pass a question, or leave --prompt out for the default one.")
    path = model_path(args.model)
    t0 = time.perf_counter()
    model = load_model(path, dtype=args.dtype, device=args.device)
    tok = load_tokenizer(path)
    name = "the embedded SmolLM2-135M-Instruct" if args.model in (None, "embedded") else path
    print(f"beaconkv demo: {name} ({_placement(args)}, {torch.get_num_threads()} thread(s), loaded in "
          f"{time.perf_counter() - t0:.1f} s), greedy, {args.max_new_tokens} new tokens"
          + (" (end-of-sequence ignored so that the cache fills)" if args.ignore_eos else ""), flush=True)
    settings = ", ".join(f"{k}={getattr(policy, k)}" for k in ("n_recent", "n_beacon") if hasattr(policy, k))
    print(f"question: {args.prompt}\n\n--- {_short_label(policy)}" + (f", {settings}" if settings else "") + " ---",
          flush=True)
    state = _inductor_cache_state()  # before the first compile fills it
    test = _timed_demo_generation(model, tok, args, policy, _short_label(policy), True, "decode",
                                  "compiling the decode step", state)
    if isinstance(policy, FullKV):
        full = test
    else:
        print("\n--- FullKV (the reference: every token kept) ---", flush=True)
        full = _timed_demo_generation(model, tok, args, FullKV(), "FullKV", False, "decode-fullkv",
                                      "compiling the decode step for FullKV's larger cache", state)
        print(f"FullKV's final answer: {full.answer(tok) or '(none stated)'}", flush=True)
    print("\n" + _demo_table(full, test, tok, args), flush=True)
    return 0


def _short_label(policy: EvictionPolicy) -> str:
    """``BeaconKV(budget=64)``: the class (a user's own too) and the budget."""
    budget = getattr(policy, "budget", None)
    name = type(policy).__name__
    return f"{name}(budget={budget})" if budget is not None else name


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
    return run_command(args.command, args._run, args)


if __name__ == "__main__":
    sys.exit(main())
