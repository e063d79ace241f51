"""``beaconkv demo``: a reasoning prompt answered with BeaconKV at a budget that evicts many times, then with
FullKV, side by side.

The first thing a new user runs. :func:`run_demo` loads the model (the embedded SmolLM2-135M by default),
streams the policy's answer (compiled by default: the compile is announced with an estimate of its seconds
and timed, :func:`compile_estimate`), generates FullKV's, and prints :func:`demo_table`: cache slots and MiB,
the most tokens held, evictions, the compile's seconds, decode tokens/s, the final answers and how many tokens
agree. Warnings the run raises (a recompile of the decode step, ...) are summarised in one line after the table
instead of printed as they come. ``beaconkv.cli`` wires the command's options; this module runs it.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import sys
import textwrap
import time
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from ..arguments import (WORKLOAD_BUDGETS, check_generation_settings, compile_setting, model_path, placement,
                         print_thread_hint)
from ..eval.answers import extract_last_boxed
from ..execution.compiled import compile_logger
from ..generation import GenerationOutput, generate
from ..models.decoder import CausalLM
from ..models.loading import load_model, resolve_device, resolve_dtype
from ..policies.base import EvictionPolicy, FullKV
from ..session import Session
from ..tokenizer import Tokenizer, load_tokenizer

__all__ = ["DEMO_COMPILE_ESTIMATE_S", "DEMO_DEFAULTS", "DEMO_PROMPT", "DemoRun", "compile_estimate", "demo_table",
           "final_answer", "rate_text", "run_demo", "token_agreement", "warnings_summary"]

DEMO_PROMPT = (
    "A farmer has 17 sheep. All but 9 run away. How many sheep does the farmer have left? "
    "Think step by step, then give the final answer."
)
"""The demo's question: a word problem that invites step-by-step reasoning."""

DEMO_DEFAULTS = {"budget": WORKLOAD_BUDGETS["demo"], "max_new_tokens": 320}
"""``beaconkv demo``'s defaults: at its budget (``WORKLOAD_BUDGETS["demo"]``, 64, where ``--n-recent auto``
is 8, the 8-token eviction step), 320 new tokens past the protected prompt evict 32 times."""

DEMO_COMPILE_ESTIMATE_S = {"decode": {"cold": 55.0, "warm": 15.0}, "decode-fullkv": {"cold": 40.0, "warm": 15.0}}
"""Seconds the demo's compiles of the embedded model's decode step took on this project's 2-core CPU
(inductor, float32, 2 threads) with an empty (``cold``) and a filled (``warm``) inductor cache:
BeaconKV's cache size first, then FullKV's. The demo announces these until it has timed a compile
on the machine it runs on, then the time it measured."""


TOO_SHORT = "too short to time"
"""What a rate reads when the run was too short to time (no decode step after the prefill and the compile)."""


def rate_text(per_s: float, unit: str = "") -> str:
    """``12.3`` (with ``unit`` after it), or :data:`TOO_SHORT` for a rate that is not a positive finite number.

    Args:
        per_s: A rate (tokens per second; NaN when no decode time was measured).
        unit: Appended to a number (``" tokens/s"``).
    """
    return f"{per_s:.1f}{unit}" if math.isfinite(per_s) and per_s > 0 else TOO_SHORT


def warnings_summary(caught: list[warnings.WarningMessage]) -> str | None:
    """One line for the warnings a demo run raised: how many of each kind, and the first one's message.

    Returns:
        ``"note: 2 RecompileWarning (torch.compile compiled another graph of ...)"``, or None without warnings.
    """
    if not caught:
        return None
    kinds = Counter(w.category.__name__ for w in caught)
    first = str(caught[0].message).strip().splitlines()[0]
    first = first if len(first) <= 160 else first[:157] + "..."
    counted = ", ".join(f"{n} {kind}" for kind, n in kinds.items())
    return f"note: {counted} while it ran (first: {first})"


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
        eos_token_ids=[] if args.ignore_eos else None, kv_storage=args.kv_storage, compile=compile_setting(args),
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


def demo_table(full: DemoRun, test: DemoRun, tok: Tokenizer, args: argparse.Namespace) -> str:
    """The side-by-side comparison the demo ends with."""
    share, first = token_agreement(full.out.token_ids[0], test.out.token_ids[0])
    answers = [r.answer(tok) for r in (full, test)]
    mode = f"compiled, {args.compile_backend}" if args.compile else "eager"
    n = len(full.out.token_ids[0])

    def column(r: DemoRun, answer: str | None) -> list[str]:
        s = r.out.stats
        cells = [f"{s.cache_capacity}", f"{s.cache_bytes / 2**20:.2f} MiB", f"{s.peak_cache_tokens}",
                 f"{s.evictions[0]}", rate_text(r.tokens_per_s), answer or "(none stated)"]
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
    policy = check_generation_settings(args, DEMO_DEFAULTS["budget"])
    if not args.prompt.strip():
        raise ValueError("--prompt is empty; pass a question, or leave --prompt out for the default one.")
    path = model_path(args.model)
    t0 = time.perf_counter()
    model = load_model(path, dtype=args.dtype, device=args.device)
    tok = load_tokenizer(path)
    name = "the embedded SmolLM2-135M-Instruct" if args.model in (None, "embedded") else path
    print(f"beaconkv demo: {name} ({placement(args)}, {torch.get_num_threads()} thread(s), loaded in "
          f"{time.perf_counter() - t0:.1f} s), greedy, {args.max_new_tokens} new tokens"
          + (" (end-of-sequence ignored so that the cache fills)" if args.ignore_eos else ""), flush=True)
    print_thread_hint()
    settings = ", ".join(f"{k}={getattr(policy, k)}" for k in ("n_recent", "n_beacon") if hasattr(policy, k))
    print(f"question: {args.prompt}\n\n--- {_short_label(policy)}" + (f", {settings}" if settings else "") + " ---",
          flush=True)
    level = compile_logger.level
    compile_logger.setLevel(max(level, logging.WARNING))  # the demo announces its compiles itself, with seconds
    try:
        with warnings.catch_warnings(record=True) as caught:  # summarised in one line after the table
            warnings.simplefilter("always")
            test, full = _both_runs(model, tok, args, policy)
    finally:
        compile_logger.setLevel(level)
    print("\n" + demo_table(full, test, tok, args), flush=True)
    summary = warnings_summary(caught)
    if summary is not None:
        print(summary, file=sys.stderr, flush=True)
    return 0


def _both_runs(model: CausalLM, tok: Tokenizer, args: argparse.Namespace,
               policy: EvictionPolicy) -> tuple[DemoRun, DemoRun]:
    """The policy's run (streamed), then FullKV's: ``(policy's, FullKV's)``."""
    state = _inductor_cache_state()  # before the first compile fills it
    test = _timed_demo_generation(model, tok, args, policy, _short_label(policy), True, "decode",
                                  "compiling the decode step", state)
    if isinstance(policy, FullKV):
        return test, test
    print("\n--- FullKV (the reference: every token kept) ---", flush=True)
    full = _timed_demo_generation(model, tok, args, FullKV(), "FullKV", False, "decode-fullkv",
                                  "compiling the decode step for FullKV's larger cache", state)
    print(f"FullKV's final answer: {full.answer(tok) or '(none stated)'}", flush=True)
    return test, full


def _short_label(policy: EvictionPolicy) -> str:
    """``BeaconKV(budget=64)``: the class (a user's own too) and the budget."""
    budget = getattr(policy, "budget", None)
    name = type(policy).__name__
    return f"{name}(budget={budget})" if budget is not None else name
