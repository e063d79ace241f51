"""The options the ``beaconkv`` subcommands share, each defined once, and what the policy options mean.

An option that several subcommands take (``--model``, ``--device``, ``--dtype``, ``--policy``,
``--budget``, ``--n-recent``, ``--policy-arg``, ``--kv-storage``, ...) is added by one function
here, so it has one spelling, one default and one help text wherever it appears. Those functions
are listed in :data:`SHARED_OPTIONS`; the CLI's tests build every subcommand's parser and check
each shared option against its definition. vLLM's spellings are aliases of ours, on the same
argument: ``--max-num-seqs`` is ``--max-batch`` and ``--kv-cache-dtype`` is ``--kv-storage``.

:func:`policy_settings` turns the policy options into a :class:`PolicySettings` the same way for
every command: ``--policy`` (default ``beacon``; a registry name, ``module:Class`` or
``path/to/file.py:Class``), ``--budget`` (default :data:`DEFAULT_BUDGET`; an error with ``full``),
``--n-recent auto`` (the policy's own default, lowered to what the budget's eviction step leaves)
and every ``--policy-arg KEY=VALUE``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .execution import CompileConfig
from .kernels.choice import KERNELS
from .models.embedded import embedded_model_path
from .models.loading import resolve_device, resolve_dtype
from .policies.base import EvictionPolicy, FullKV
from .policies.config import PolicyConfigError
from .policies.registry import auto_n_recent, make_policy, policy_class, policy_names, policy_parameters
from .policies.schedules import AtBudget, parse_schedule
from .sampling import SamplingParams
from .storage import storage_names

#: ``--budget``'s default: evictable tokens per sequence and KV head.
DEFAULT_BUDGET = 1024

#: Commands whose fixed, short workload would never evict at :data:`DEFAULT_BUDGET`, and their
#: default budget instead: the demo's 320 tokens, analyze's 768-token trace, the bench's cost curve.
WORKLOAD_BUDGETS = {"demo": 64, "analyze": 128, "bench": 256}

#: ``--policy``'s default.
DEFAULT_POLICY = "beacon"

#: ``--backend``'s choices, the default first: beaconkv's own decoder, or the model in transformers.
BACKENDS = ("native", "hf")

AddOption = Callable[[Any], None]

#: The functions that add the shared options (a parser or an argument group in, the option added).
SHARED_OPTIONS: list[AddOption] = []


def _shared(add: AddOption) -> AddOption:
    SHARED_OPTIONS.append(add)
    return add


# ------------------------------------------------------------------------------------------- types
def int_list(text: str) -> list[int]:
    """``"64,128"`` -> ``[64, 128]`` (an argparse type)."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from err


def str_list(text: str) -> list[str]:
    """``"a, b"`` -> ``["a", "b"]`` (an argparse type)."""
    return [x.strip() for x in text.split(",") if x.strip()]


def int_or_auto(text: str) -> int | None:
    """An int, or ``auto``/``prompt``/``none`` for None (an argparse type)."""
    if text.lower() in ("auto", "prompt", "none"):
        return None
    try:
        return int(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {text!r}") from err


def _int_at_least(text: str, minimum: int, also: str = "") -> int:
    """``text`` as an int >= ``minimum``, else an argparse error naming what was expected (``also``: other words taken)."""
    expected = f"expected an integer >= {minimum}{also}"
    try:
        value = int(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{expected}, got {text!r}") from err
    if value < minimum:
        raise argparse.ArgumentTypeError(f"{expected}, got {value}")
    return value


def positive_int(text: str) -> int:
    """An int >= 1 (an argparse type)."""
    return _int_at_least(text, 1)


def recent_count(text: str) -> int | None:
    """``--n-recent``: an int >= 0, or ``auto`` for None (an argparse type)."""
    return None if text.strip().lower() == "auto" else _int_at_least(text, 0, " or 'auto'")


def key_value(text: str) -> tuple[str, str]:
    """``"KEY=VALUE"`` -> ``("KEY", "VALUE")`` (an argparse type)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (e.g. aggregation=mean), got {text!r}")
    return key.strip(), value


def kv_storage_name(text: str) -> str:
    """``--kv-storage``/``--kv-cache-dtype``: a storage name, or vLLM's ``auto`` for ``dense`` (an argparse type)."""
    key = text.strip().lower()
    if key == "auto":
        return "dense"
    if key in storage_names():
        return key
    if key.startswith("fp8"):
        raise argparse.ArgumentTypeError(f"{text!r}: beaconkv has no float8 KV cache; use int8 (8-bit integers, "
                                         "per-token and per-KV-head scales) or auto (the model's dtype)")
    raise argparse.ArgumentTypeError(f"{text!r} is not a KV storage: use auto (= dense, the model's dtype; "
                                     f"--dtype sets it) or {' or '.join(storage_names())}")


class RenamedOption(argparse.Action):
    """An option's former spelling, kept so that using it fails with the new name instead of meaning something else.

    Args:
        option_strings: The old spelling(s).
        dest: Unused (nothing is stored).
        new: The option's name now.
        meaning: What the option is, for the message.
    """

    def __init__(self, option_strings: Sequence[str], dest: str, *, new: str, meaning: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, nargs="?", default=argparse.SUPPRESS,
                         help=argparse.SUPPRESS)
        self.new, self.meaning = new, meaning

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        """Fails: ``<old> was renamed <new> (<meaning>); pass <new> <value>``."""
        parser.error(f"{option_string} was renamed {self.new} ({self.meaning}); pass {self.new} {values or 'N'}")


# ---------------------------------------------------------------------------------- shared options
@_shared
def add_model_argument(parser: Any) -> None:
    """``--model``: the checkpoint (default: the embedded SmolLM2-135M)."""
    parser.add_argument("--model", default=None,
                        help="checkpoint directory or hub id (default / 'embedded': the embedded SmolLM2-135M)")


@_shared
def add_backend_argument(parser: Any) -> None:
    """``--backend {native,hf}``: beaconkv's own decoder, or the model in transformers with a ``PolicyCache``."""
    parser.add_argument("--backend", default=BACKENDS[0], choices=BACKENDS,
                        help="native (default): beaconkv's own decoder (llama, qwen2, qwen3); hf: the model in "
                             "Hugging Face transformers with a beaconkv.hf.PolicyCache (any decoder; the hf extra)")


@_shared
def add_dtype_argument(parser: Any) -> None:
    """``--dtype``: the model's dtype (default ``auto``)."""
    parser.add_argument("--dtype", default="auto",
                        help="auto (default: bfloat16 on CUDA, float32 on CPU), float32, bfloat16 or float16")


@_shared
def add_device_argument(parser: Any) -> None:
    """``--device``: where the model runs (default ``auto``)."""
    parser.add_argument("--device", default="auto",
                        help="auto (default: cuda when available, else cpu), cpu, cuda, cuda:1 ...")


def add_model_arguments(parser: Any, device: bool = True) -> None:
    """``--model``, ``--dtype`` (and ``--device``): which checkpoint to load, as what, where."""
    add_model_argument(parser)
    add_dtype_argument(parser)
    if device:
        add_device_argument(parser)


@_shared
def add_policy_argument(parser: Any) -> None:
    """``--policy``: a registry name or a class of one's own (default :data:`DEFAULT_POLICY`)."""
    parser.add_argument("--policy", default=DEFAULT_POLICY, metavar="NAME",
                        help=f"eviction policy: {', '.join(policy_names())}, or a class of your own as "
                             f"module:Class or path/to/file.py:Class (default {DEFAULT_POLICY})")


@_shared
def add_budget_argument(parser: Any) -> None:
    """``--budget``: ``B_max`` (default :data:`DEFAULT_BUDGET`, or the command's :data:`WORKLOAD_BUDGETS`)."""
    *first, last = [f"{c} {b}" for c, b in WORKLOAD_BUDGETS.items()]
    parser.add_argument("--budget", type=int, default=None, metavar="N",
                        help=f"evictable tokens kept per sequence and KV head (default {DEFAULT_BUDGET}, except "
                             f"{', '.join(first)} and {last}, whose short runs must evict); not with --policy full, "
                             "which keeps every token")


@_shared
def add_n_recent_argument(parser: Any) -> None:
    """``--n-recent``: the recent tokens always kept (default ``auto``)."""
    parser.add_argument("--n-recent", type=recent_count, default=None, metavar="N|auto",
                        help="recent tokens always kept; auto (default) = the policy's own (16), lowered to "
                             "budget // 8 where budget - floor(7/8 budget) leaves fewer slots (budgets under 128)")


@_shared
def add_policy_arg_argument(parser: Any) -> None:
    """``--policy-arg KEY=VALUE`` (repeatable): a parameter of the policy's constructor."""
    parser.add_argument("--policy-arg", action="append", type=key_value, default=[], metavar="KEY=VALUE",
                        help="a parameter of the policy's constructor, repeatable; VALUE is read as JSON, else "
                             "as a string (e.g. aggregation=mean, n_prefix=null, ratio=0.75)")


def add_policy_arguments(parser: Any) -> None:
    """``--policy``, ``--budget``, ``--n-recent`` and ``--policy-arg``: the policy of a command that runs one."""
    add_policy_argument(parser)
    add_budget_argument(parser)
    add_n_recent_argument(parser)
    add_policy_arg_argument(parser)


def add_n_beacon_argument(parser: Any) -> None:
    """``--n-beacon``: BeaconKV's beacons (a shortcut of ``--policy-arg n_beacon=N``; not shared: the
    fidelity study's ``--n-beacon`` takes per-budget multiples)."""
    parser.add_argument("--n-beacon", type=int, default=None, metavar="N",
                        help="beacons per query head (BeaconKV-like policies; default: the policy's own, 16)")


@_shared
def add_kv_storage_argument(parser: Any) -> None:
    """``--kv-storage`` (alias ``--kv-cache-dtype``): how the KV cache holds keys and values."""
    parser.add_argument("--kv-storage", "--kv-cache-dtype", type=kv_storage_name, default="dense",
                        choices=storage_names(), metavar="{auto," + ",".join(storage_names()) + "}",
                        help="KV cache storage: dense (default; vLLM's auto: the model's dtype) or int8 "
                             "(per-token, per-KV-head scales); --kv-cache-dtype is vLLM's spelling")


@_shared
def add_kernels_argument(parser: Any) -> None:
    """``--kernels {auto,model,packed,bf16w}``: the matmul kernels of the decode steps."""
    parser.add_argument("--kernels", default="auto", choices=KERNELS,
                        help="matmul kernels: auto (default: when 4+ sequences decode together on a CPU without "
                             "native bf16, bf16 weights with fp32 arithmetic (bf16w) for a bf16 model, "
                             "oneDNN-prepacked fp32 linears (packed) otherwise), model (the model's own), packed "
                             "or bf16w")


@_shared
def add_threads_argument(parser: Any) -> None:
    """``--threads``: torch's CPU threads."""
    parser.add_argument("--threads", type=positive_int, default=None, metavar="N",
                        help="torch CPU threads (default: torch's choice; a one-line hint on stderr names a smaller "
                             "count when the free cores, after the load average, are fewer)")


@_shared
def add_max_batch_argument(parser: Any) -> None:
    """``--max-batch`` (alias ``--max-num-seqs``): the engine's cache slots."""
    parser.add_argument("--max-batch", "--max-num-seqs", type=int, default=8, metavar="N",
                        help="cache slots of the engine: sequences decoded together, a finished one's slot taken "
                             "by the next at once (default 8); --max-num-seqs is vLLM's spelling")


@_shared
def add_prefill_chunk_argument(parser: Any) -> None:
    """``--prefill-chunk N``: prefill long prompts N tokens at a time, evicting between chunks."""
    parser.add_argument("--prefill-chunk", type=positive_int, default=None, metavar="N",
                        help="prefill prompts longer than N tokens in chunks of N, the policy evicting between "
                             "chunks, so a cache slot holds at most n_prefix + budget + N tokens instead of the "
                             "whole prompt (with an int n_prefix, e.g. --policy-arg n_prefix=4; default: whole "
                             "prompts)")


@_shared
def add_top_k_argument(parser: Any) -> None:
    """``--top-k``: sampling from the k likeliest tokens only."""
    parser.add_argument("--top-k", type=int, default=0, metavar="K",
                        help="sample from the K likeliest tokens only (default 0 = off)")


def model_path(name: str | None) -> str:
    """The checkpoint ``--model`` names: the embedded model for None or ``"embedded"``."""
    return str(embedded_model_path()) if name in (None, "embedded") else name


# ------------------------------------------------------------------------------ the policy options
@dataclass(frozen=True)
class PolicySettings:
    """What a command's policy options say, resolved: :func:`make_policy`'s arguments.

    Attributes:
        name: ``--policy``: a registry name or a spec (``module:Class``, ``file.py:Class``).
        budget: The budget (None for FullKV).
        kwargs: The constructor's other arguments: ``--n-recent`` (given, or the one ``auto``
            chose where the policy's own does not fit the budget), ``--n-beacon``, ``--policy-arg``.
    """

    name: str
    budget: int | None
    kwargs: dict[str, Any] = field(default_factory=dict)

    def build(self) -> EvictionPolicy:
        """The policy (validated by its constructor).

        Raises:
            PolicyConfigError: Unknown parameters or settings the policy rejects.
        """
        return make_policy(self.name, budget=self.budget, **self.kwargs)


def parse_policy_args(pairs: Iterable[tuple[str, str]]) -> dict[str, Any]:
    """``--policy-arg`` values as keyword arguments, each VALUE read as JSON, else kept as a string.

    Raises:
        PolicyConfigError: A key given twice.
    """
    out: dict[str, Any] = {}
    for key, text in pairs:
        if key in out:
            raise PolicyConfigError(f"--policy-arg {key}= is given twice ({out[key]!r} and {text!r}); keep one.")
        try:
            out[key] = json.loads(text)
        except json.JSONDecodeError:
            out[key] = text
    return out


def _named_options(args: argparse.Namespace) -> dict[str, Any]:
    """The policy parameters a command's own options set (``--n-recent``, ``--n-beacon``), when given."""
    return {k: getattr(args, k) for k in ("n_recent", "n_beacon") if getattr(args, k, None) is not None}


def _merge(named: dict[str, Any], extra: dict[str, Any], budget_option: str) -> dict[str, Any]:
    """The named options and the ``--policy-arg`` ones together; a parameter set by both, or the budget, fails."""
    twice = sorted(set(named) & set(extra))
    if twice:
        key = twice[0]
        raise PolicyConfigError(f"--{key.replace('_', '-')} {named[key]} and --policy-arg {key}={extra[key]!r} both "
                                f"set {key}; give one of them.")
    if "budget" in extra:
        raise PolicyConfigError(f"--policy-arg budget={extra['budget']!r}: set the budget with {budget_option}.")
    return {**named, **extra}


def policy_settings(args: argparse.Namespace, default_budget: int = DEFAULT_BUDGET) -> PolicySettings:
    """Resolves ``--policy``, ``--budget``, ``--n-recent``, ``--n-beacon`` and ``--policy-arg`` (nothing is loaded).

    Args:
        args: Parsed options of a command with :func:`add_policy_arguments`.
        default_budget: The budget when ``--budget`` is not given (:data:`DEFAULT_BUDGET`, or
            the command's entry of :data:`WORKLOAD_BUDGETS`).

    Returns:
        The settings; :meth:`PolicySettings.build` makes the policy.

    Raises:
        PolicyConfigError: An unknown policy or spec; ``--budget`` (or any parameter but
            ``telemetry``) with a policy that keeps every token; a parameter set twice; a bad
            ``--policy-arg schedule=`` spec.

    A schedule that sizes the cache itself (``--policy-arg schedule=periodic:period=1024,compression=4``)
    takes no budget: without ``--budget`` none is set, and with one the schedule refuses it.
    """
    cls = policy_class(args.policy)
    kwargs = _merge(_named_options(args), parse_policy_args(args.policy_arg), "--budget")
    if issubclass(cls, FullKV):
        if args.budget is not None:
            raise PolicyConfigError(f"--policy {args.policy} keeps every token, so --budget {args.budget} would be "
                                    f"ignored; drop --budget, or pick an evicting policy (e.g. --policy beacon "
                                    f"--budget {args.budget}).")
        ignored = sorted(set(kwargs) - {"telemetry"})
        if ignored:
            raise PolicyConfigError(f"--policy {args.policy} keeps every token and takes no {', '.join(ignored)}; "
                                    "drop it, or pick an evicting policy (e.g. --policy beacon).")
        return PolicySettings(args.policy, None, kwargs)
    if args.budget is None and parse_schedule(kwargs.get("schedule", AtBudget())).sizes_itself:
        return PolicySettings(args.policy, None, kwargs)  # --policy-arg schedule=periodic:...: no budget
    budget = args.budget if args.budget is not None else default_budget
    if "n_recent" not in kwargs and isinstance(budget, int) and budget >= 1:
        params = policy_parameters(args.policy)
        own, ratio = params.get("n_recent"), kwargs.get("ratio", params.get("ratio"))
        if own == "auto":  # the policy would fit it too; written out, the runs' recorded settings stay as they were
            own = getattr(policy_class(args.policy), "default_n_recent", None)
        if isinstance(own, int) and isinstance(ratio, (int, float)) and 0 < ratio < 1:
            fitted = auto_n_recent(budget, own, ratio)
            if fitted != own:
                kwargs["n_recent"] = fitted
    return PolicySettings(args.policy, budget, kwargs)


def policy_from_args(args: argparse.Namespace, default_budget: int = DEFAULT_BUDGET) -> EvictionPolicy:
    """The policy a command's options describe, validated before any model loads (see :func:`policy_settings`).

    Raises:
        PolicyConfigError: As :func:`policy_settings`, or settings the policy rejects.
    """
    return policy_settings(args, default_budget).build()


def policy_args_by_policy(args: argparse.Namespace, policies: Iterable[str]) -> dict[str, dict[str, Any]]:
    """``--policy-arg`` of a command that runs several policies: each key goes to the policies that take it.

    Args:
        args: Parsed options (``policy_arg``; ``n_recent``/``n_beacon`` when the command has them).
        policies: The policies' names or specs.

    Returns:
        Policy name -> its share of the arguments.

    Raises:
        PolicyConfigError: A key no listed policy takes, a key the command's own option sets too,
            ``budget``, or a key given twice.
    """
    extra = _merge(_named_options(args), parse_policy_args(args.policy_arg), "--budgets")
    for key in _named_options(args):
        extra.pop(key)
    names = [p for p in policies if not issubclass(policy_class(p), FullKV)]
    params = {p: policy_parameters(p) for p in names}
    for key in extra:
        if not any(key in params[p] for p in names):
            raise PolicyConfigError(f"--policy-arg {key}={extra[key]!r}: none of the policies "
                                    f"{', '.join(names) or '(none)'} has a parameter {key!r}; check the name.")
    return {p: {k: v for k, v in extra.items() if k in params[p]} for p in names}


# ------------------------------------------------------------------------------------------- threads
def free_cores() -> tuple[int, float]:
    """``(cores this process may run on, the one-minute load average)`` (the load is 0 where it is unknown)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = 0.0
    return cores, load


def thread_hint(threads: int, cores: int, load: float) -> str | None:
    """The one-line hint a command prints when torch runs more threads than the cores other work leaves free.

    A CPU decode step waits for its slowest thread: a thread that shares a core with another busy process
    slows every step (12x on a busy 2-core box, where ``--threads 1`` was fast).

    Args:
        threads: torch's thread count.
        cores: Cores the process may run on.
        load: The load average (runnable processes, this one's own start-up included).

    Returns:
        The hint, or None when ``threads`` fits the free cores.
    """
    free = max(1, cores - int(load + 0.5))
    if threads <= free:
        return None
    return (f"hint: torch runs {threads} threads, but {cores} core(s) at a load of {load:.1f} leave about {free} "
            f"free; if decoding is slow, pass --threads {free} (a thread sharing a busy core slows every step)")


def print_thread_hint() -> None:
    """Prints :func:`thread_hint` of torch's thread count on stderr, if there is one (once the model loaded, so
    that a command refused before it still says one line)."""
    hint = thread_hint(torch.get_num_threads(), *free_cores())
    if hint is not None:
        print(f"beaconkv: {hint}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------- generation
def check_generation_settings(args: argparse.Namespace, default_budget: int = DEFAULT_BUDGET) -> EvictionPolicy:
    """Validates the policy, sampling, dtype and device options of ``generate`` and ``demo`` before anything loads,
    and applies ``--threads``.

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


def compile_setting(args: argparse.Namespace) -> CompileConfig | bool:
    """``--compile``/``--compile-backend`` as ``generate``'s ``compile``: a static-shape
    :class:`~beaconkv.execution.CompileConfig`, or False.

    Static shapes (``dynamic=False``): a second cache size (the demo's FullKV run after BeaconKV)
    compiles a second static graph, which inductor's on-disk cache keeps for the next run, instead
    of a shape-generic graph that is recompiled every time.
    """
    return CompileConfig(backend=args.compile_backend, dynamic=False) if args.compile else False


def placement(args: argparse.Namespace) -> str:
    """``--dtype`` and ``--device`` as resolved (``auto`` made concrete): ``"float32, cpu"``."""
    device = resolve_device(args.device)
    return f"{str(resolve_dtype(args.dtype, device)).removeprefix('torch.')}, {device}"
