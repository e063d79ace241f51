"""The memory a generation needs, from a model's config alone: the paper's Table-4 arithmetic as a tool.

``beaconkv memory --model qwen3-4b --batch 14 --tokens 32768 --budget 2048 --device-memory 80GiB``
prints, for each policy, the cache slots a sequence needs, the bytes of keys and values, the
predicted peak and the largest batch that fits the device. Nothing is loaded and nothing is
allocated: the parameter count comes from the config
(:func:`~beaconkv.measure.memory_terms.parameter_count`), the cache size from
the policy's own allocation rule (:meth:`~beaconkv.policies.EvictionPolicy.capacity`, as the session
sizes it), and the policy's own tensors from its ``create_state`` run on PyTorch's meta device
(shapes without memory; :func:`~beaconkv.measure.memory_terms.policy_state_bytes`). Those terms are
:mod:`beaconkv.measure.memory_terms`'; this module adds them up, searches the largest batch and runs
``beaconkv memory``.

What the peak counts (one :class:`MemoryRow` per policy, every figure in bytes):

* **weights** — every parameter once, in the model dtype (a tied LM head is the embedding);
* **KV** — ``slots · batch · kv_token_bytes``: keys and values of every layer, per token
  ``2 · layers · kv_heads · head_dim · bytes`` dense, ``2 · layers · kv_heads · (head_dim + 2)`` int8
  (one int8 per element and one float16 scale per token and KV head, :mod:`beaconkv.storage.int8`);
* **index** — the cache's bookkeeping: one int64 position per slot and KV head, a length and a flag
  per row, in every layer;
* **state** — the policy's tensors: query rings, query sets, per-slot scores, row counters;
* **workspace** — an *estimate* of the largest transient, the most of three moments (see
  :func:`workspace_terms` for each term and its formula): the prefill (activations of one layer over
  the prompt or one chunk), a decode step (the float32 logits, attention weights where the policy
  observes them or int8 storage computes them, an int8 layer dequantised) and an eviction (one layer's
  keys in float32 and the score tensors ``batch · kv_heads · group · n_queries · capacity · 4``, two
  alive at once).

``peak = weights + KV + index + state + workspace``. The first four are what a
:class:`~beaconkv.session.Session` allocates, byte for byte; the workspace follows eager PyTorch's
transients and a fused attention kernel (``scaled_dot_product_attention``), so a compiled step may
need less, and the CUDA caching allocator rounds blocks up (512 bytes) and keeps the CUDA graphs'
pools. For the paper's setting (Qwen3-4B, bf16, 64 + 32768 tokens, batch 14) the weights and the cache
are over 94% of the peak (FullKV 98%); the prediction is made to be compared with
``torch.cuda.max_memory_allocated`` of a real run (the GPU check asks for agreement within 10%).

The largest batch is the largest whose peak fits ``device_memory · memory_fraction`` (default 0.9,
the share the GPU stage plans with); it is searched over the same arithmetic, so every term grows
with the batch exactly as it does here.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch

from ..arguments import (
    DEFAULT_BUDGET,
    add_budget_argument,
    add_dtype_argument,
    add_kv_storage_argument,
    add_model_argument,
    add_n_recent_argument,
    add_policy_arg_argument,
    add_prefill_chunk_argument,
    policy_args_by_policy,
    positive_int,
    str_list,
)
from ..errors import BeaconKVError
from ..models.config import ModelConfig
from ..models.loading import resolve_dtype
from ..models.random_weights import RANDOM_SHAPES
from ..policies.base import EvictionPolicy, FullKV
from ..policies.registry import policy_class
from .memory_terms import (
    MEMORY_UNITS,
    MemoryPlanError,
    _gib,
    _storage_name,
    build_policy,
    index_bytes,
    kv_token_bytes,
    parameter_count,
    parse_memory,
    policy_state_bytes,
    weight_bytes,
    workspace_terms,
)

__all__ = ["DEFAULT_DEVICE_MEMORY", "DEFAULT_MEMORY_FRACTION", "DEFAULT_POLICIES", "DEFAULT_PROMPT", "DEFAULT_TOKENS",
           "MEMORY_UNITS", "MemoryPlanError", "MemoryRow", "add_memory_arguments", "build_policy", "index_bytes",
           "kv_token_bytes", "largest_batch", "memory_plan", "memory_table", "model_config", "parameter_count",
           "parse_memory", "policy_state_bytes", "run_memory", "weight_bytes", "workspace_terms"]

DEFAULT_PROMPT = 64
"""Prompt tokens per sequence by default: the prompt :mod:`beaconkv.measure.speed.table4` decodes from."""

DEFAULT_TOKENS = 32768
"""Generated tokens per sequence by default: the paper's 32K-token generations."""

DEFAULT_DEVICE_MEMORY = "80GiB"
"""The device memory by default: an 80 GB A100/H100, which holds 80 GiB."""

DEFAULT_MEMORY_FRACTION = 0.9
"""The share of the device memory a plan may use by default (what the GPU stage plans with)."""

DEFAULT_POLICIES = ("full", "beacon")
"""``--policies`` by default: the two rows of the paper's Table 4."""

#: The largest batch the search tries.
MAX_SEARCH_BATCH = 1 << 20


# ------------------------------------------------------------------------------------------- plan
@dataclass(frozen=True)
class MemoryRow:
    """The memory one policy needs (bytes), and what fits the device.

    Attributes:
        policy: The policy's name (as given, or its registry name).
        budget: Its budget (None for FullKV).
        batch: Sequences.
        prompt: Prompt tokens per sequence.
        tokens: Generated tokens per sequence.
        slots: Cache slots per (sequence, KV head): ``prompt + tokens`` for FullKV, the policy's
            ``capacity`` otherwise.
        weights_bytes: The parameters (:func:`weight_bytes`).
        kv_bytes: Keys and values of every layer for the batch (``slots · batch · kv_token_bytes``).
        index_bytes: The cache's positions, lengths and flags (:func:`index_bytes`).
        state_bytes: The policy's tensors (:func:`policy_state_bytes`).
        workspace_bytes: The estimated largest transient: the most of the moments' sums (:func:`workspace_terms`).
        workspace_moment: The moment it comes from (``prefill``, ``decode`` or ``eviction``).
        workspace_term: The largest term of that moment.
        peak_bytes: ``weights + kv + index + state + workspace``.
        usable_bytes: ``device_memory · memory_fraction`` (None without a device memory).
        max_batch: The largest batch whose peak fits ``usable_bytes`` (0: not even one sequence; None
            without a device memory).
        max_tokens: The most tokens each of ``batch`` sequences may generate within ``usable_bytes``,
            at most the model's context minus the prompt (0: none; None without a device memory).
        context_bound: ``max_tokens`` is the model's context, not the memory.
        workspace: Every term, ``{moment: {term: bytes}}``.
    """

    policy: str
    budget: int | None
    batch: int
    prompt: int
    tokens: int
    slots: int
    weights_bytes: int
    kv_bytes: int
    index_bytes: int
    state_bytes: int
    workspace_bytes: int
    workspace_moment: str
    workspace_term: str
    peak_bytes: int
    usable_bytes: int | None = None
    max_batch: int | None = None
    max_tokens: int | None = None
    context_bound: bool = False
    workspace: dict[str, dict[str, int]] = field(default_factory=dict)


@dataclass
class _Planner:
    """The fixed settings of one plan; :meth:`peak` sizes one (policy, batch, tokens)."""

    config: ModelConfig
    prompt: int
    dtype: torch.dtype
    kv_storage: str
    prefill_chunk: int | None
    _states: dict[tuple[int, int, int, int], int] = field(default_factory=dict)

    def slots(self, policy: EvictionPolicy, tokens: int) -> int:
        return policy.capacity([self.prompt], tokens, prefill_chunk=self.prefill_chunk)

    def figures(self, policy: EvictionPolicy, batch: int, tokens: int) -> dict[str, Any]:
        cfg, slots = self.config, self.slots(policy, tokens)
        max_tokens = self.prompt + tokens
        key = (id(policy), batch, slots, max_tokens)
        if key not in self._states:
            self._states[key] = policy_state_bytes(cfg, policy, batch, slots, max_tokens, self.dtype, self.kv_storage)
        terms = workspace_terms(cfg, policy, batch, slots, self.prompt, max_tokens, self.dtype, self.kv_storage,
                                self.prefill_chunk)
        moment = max(terms, key=lambda m: sum(terms[m].values()))
        figures = {"slots": slots, "weights_bytes": weight_bytes(cfg, self.dtype),
                   "kv_bytes": slots * batch * kv_token_bytes(cfg, self.dtype, self.kv_storage),
                   "index_bytes": index_bytes(cfg, batch, slots), "state_bytes": self._states[key],
                   "workspace_bytes": sum(terms[moment].values()), "workspace_moment": moment,
                   "workspace_term": max(terms[moment], key=terms[moment].get), "workspace": terms}
        figures["peak_bytes"] = sum(figures[k] for k in ("weights_bytes", "kv_bytes", "index_bytes", "state_bytes",
                                                         "workspace_bytes"))
        return figures

    def peak(self, policy: EvictionPolicy, batch: int, tokens: int) -> int:
        return self.figures(policy, batch, tokens)["peak_bytes"]


def _largest(fits: Any, low: int, high: int) -> int:
    """The largest ``x`` in ``[low, high]`` with ``fits(x)`` (``fits`` monotone, true at ``low``)."""
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low


def largest_batch(config: ModelConfig, policy: EvictionPolicy, tokens: int, usable_bytes: int, *,
                  prompt: int = DEFAULT_PROMPT, dtype: torch.dtype = torch.bfloat16, kv_storage: str = "dense",
                  prefill_chunk: int | None = None) -> int:
    """The largest batch whose predicted peak fits ``usable_bytes`` (0 when one sequence does not).

    Args:
        config: The architecture.
        policy: The policy.
        tokens: Generated tokens per sequence.
        usable_bytes: The memory the plan may use.
        prompt: Prompt tokens per sequence.
        dtype: The model dtype.
        kv_storage: ``"dense"`` or ``"int8"``.
        prefill_chunk: Tokens per prefill chunk (None: whole prompts).
    """
    planner = _Planner(config, prompt, dtype, _storage_name(kv_storage), prefill_chunk)
    return _largest_batch(planner, policy, tokens, usable_bytes)


def _largest_batch(planner: _Planner, policy: EvictionPolicy, tokens: int, usable: int) -> int:
    def fits(b: int) -> bool:
        return planner.peak(policy, b, tokens) <= usable

    if not fits(1):
        return 0
    high = 2
    while high <= MAX_SEARCH_BATCH and fits(high):
        high *= 2
    return _largest(fits, high // 2, min(high - 1, MAX_SEARCH_BATCH))


def _check_int(name: str, value: Any, low: int, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise MemoryPlanError(f"{name}={value!r} must be an int >= {low}; {fix}.")
    return value


def memory_plan(
    config: ModelConfig,
    policies: Sequence[EvictionPolicy | str],
    batch: int,
    tokens: int,
    *,
    prompt: int = DEFAULT_PROMPT,
    budget: int | None = None,
    dtype: torch.dtype | str = torch.bfloat16,
    kv_storage: str = "dense",
    prefill_chunk: int | None = None,
    device_memory: int | str | None = None,
    memory_fraction: float = DEFAULT_MEMORY_FRACTION,
) -> list[MemoryRow]:
    """The memory each policy needs to generate ``tokens`` tokens for ``batch`` sequences (nothing loaded).

    Example (what the GPU check compares with ``torch.cuda.max_memory_allocated``):

    ```python
    from beaconkv.measure.memory import memory_plan
    from beaconkv.models.random_weights import qwen3_4b_config

    full, beacon = memory_plan(qwen3_4b_config(), ["full", "beacon"], batch=14, tokens=32768, budget=2048)
    print(full.kv_bytes / 2**30, beacon.peak_bytes / 2**30)
    ```

    Args:
        config: The architecture (e.g. ``model.config``, or ``ModelConfig.from_file(checkpoint)``).
        policies: Policies, or registry names built with ``budget`` (:func:`build_policy`).
        batch: Sequences decoded together.
        tokens: Tokens each generates.
        prompt: Prompt tokens of each (default 64, Table 4's).
        budget: The budget of the policies given by name (FullKV takes none).
        dtype: The model dtype (a name: ``"auto"`` is bfloat16, a plan being for a CUDA device).
        kv_storage: ``"dense"`` or ``"int8"``.
        prefill_chunk: Tokens per prefill chunk (None: whole prompts), as ``--prefill-chunk``.
        device_memory: Bytes of the device (an int, or a string such as ``"80GiB"``: :func:`parse_memory`);
            None: no largest batch.
        memory_fraction: The share of ``device_memory`` the plan may use, in ``(0, 1]``.

    Returns:
        One :class:`MemoryRow` per policy, in order.

    Raises:
        MemoryPlanError: A bad batch, token count, prompt, chunk, storage, memory or fraction.
        PolicyConfigError: A policy name or budget the registry rejects.
    """
    _check_int("batch", batch, 1, "decode at least one sequence")
    _check_int("tokens", tokens, 1, "generate at least one token")
    _check_int("prompt", prompt, 1, "a prompt has at least one token")
    if prefill_chunk is not None:
        _check_int("prefill_chunk", prefill_chunk, 1, "use None for whole prompts")
    storage = _storage_name(kv_storage)
    dtype = resolve_dtype(dtype, "cuda") if isinstance(dtype, str) else resolve_dtype(dtype)
    if isinstance(memory_fraction, bool) or not isinstance(memory_fraction, (int, float)) or not (
            0 < memory_fraction <= 1):
        raise MemoryPlanError(f"memory_fraction={memory_fraction!r} must be a number in (0, 1], e.g. 0.9.")
    # the fraction as written (0.9 is 9/10, not the float just above it): exact bytes
    usable = (None if device_memory is None
              else math.floor(parse_memory(device_memory) * Fraction(str(memory_fraction))))
    if not policies:
        raise MemoryPlanError("no policies to plan for; pass e.g. ['full', 'beacon'].")
    context = config.max_position_embeddings - prompt
    planner = _Planner(config, prompt, dtype, storage, prefill_chunk)
    rows = []
    for item in policies:
        policy = build_policy(item, budget) if isinstance(item, str) else item
        name = item if isinstance(item, str) else type(policy).name
        figures = planner.figures(policy, batch, tokens)
        max_batch = max_tokens = None
        context_bound = False
        if usable is not None:
            max_batch = _largest_batch(planner, policy, tokens, usable)
            if context < 1 or planner.peak(policy, batch, 1) > usable:
                max_tokens = 0
            else:
                max_tokens = _largest(lambda t: planner.peak(policy, batch, t) <= usable, 1, context)
                context_bound = max_tokens == context
        rows.append(MemoryRow(policy=name, budget=policy.budget, batch=batch, prompt=prompt, tokens=tokens,
                              usable_bytes=usable, max_batch=max_batch, max_tokens=max_tokens,
                              context_bound=context_bound, **figures))
    return rows


# -------------------------------------------------------------------------------------------- CLI
def model_config(model: str | None) -> tuple[ModelConfig, str]:
    """The config ``--model`` names, and a label: a random shape (:data:`~beaconkv.models.random_weights.RANDOM_SHAPES`),
    ``embedded`` (or None), a checkpoint directory or ``config.json``, or a hub id (its ``config.json``
    alone is downloaded).

    Raises:
        FileNotFoundError: No such directory, file or hub repo.
        ConfigFileError: A config that cannot be trusted.
        UnsupportedModelError: An architecture beaconkv does not run.
    """
    if model in RANDOM_SHAPES:
        return RANDOM_SHAPES[model](), f"{model} (shape)"
    if model in (None, "embedded"):
        from ..models.embedded import embedded_model_path

        return ModelConfig.from_file(embedded_model_path()), "embedded SmolLM2-135M"
    path = Path(model).expanduser()
    if path.exists():
        return ModelConfig.from_file(path), str(model)
    if model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise FileNotFoundError(f"--model {model!r} is no checkpoint directory here; pass a directory holding "
                                f"config.json, a hub id such as Qwen/Qwen3-4B, 'embedded', or a shape: "
                                f"{', '.join(RANDOM_SHAPES)}.")
    from huggingface_hub import hf_hub_download

    try:
        return ModelConfig.from_file(hf_hub_download(repo_id=model, filename="config.json")), model
    except (OSError, ValueError) as err:
        if isinstance(err, BeaconKVError):
            raise
        reason = (str(err).strip().splitlines() or [""])[0][:300]
        raise FileNotFoundError(f"--model {model!r}: its config.json could not be downloaded ({type(err).__name__}: "
                                f"{reason}); check the repo id, the network and HF_TOKEN, or pass a local "
                                "directory.") from err


def memory_table(rows: Sequence[MemoryRow]) -> str:
    """The plan as a Markdown table, one row per policy, and a line per policy naming its largest transient.

    Args:
        rows: :func:`memory_plan`'s rows (one batch, prompt and length).
    """
    r0 = rows[0]
    device = r0.usable_bytes is not None
    head = ["policy", "slots/seq", "KV GiB", "index+state GiB", "workspace GiB", "peak GiB"]
    if device:
        head += [f"largest batch in {_gib(r0.usable_bytes)} GiB", f"tokens at batch {r0.batch}"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for r in rows:
        name = r.policy if r.budget is None else f"{r.policy} ({r.budget})"
        cells = [name, str(r.slots), _gib(r.kv_bytes), _gib(r.index_bytes + r.state_bytes), _gib(r.workspace_bytes),
                 _gib(r.peak_bytes)]
        if device:
            cells += [str(r.max_batch), f"{r.max_tokens}" + (" (context)" if r.context_bound else "")]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for r in rows:
        lines.append(f"{r.policy}: largest transient at the {r.workspace_moment}, mostly {r.workspace_term} "
                     f"({_gib(r.workspace[r.workspace_moment][r.workspace_term])} GiB)")
    return "\n".join(lines)


def add_memory_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the ``beaconkv memory`` options to ``parser``.

    Args:
        parser: A parser (or subparser).

    Returns:
        The same parser.
    """
    parser.description = ("The memory each policy needs — weights, KV cache, its own state and a workspace estimate "
                          "— and the largest batch that fits a device, from the model's config alone (nothing is "
                          "loaded). --model also takes a random shape: " + ", ".join(RANDOM_SHAPES) +
                          "; --dtype auto is bfloat16 (a plan is for a CUDA device).")
    m = parser.add_argument_group("model")
    add_model_argument(m)
    add_dtype_argument(m)
    add_kv_storage_argument(m)
    w = parser.add_argument_group("workload")
    w.add_argument("--batch", type=positive_int, default=1, metavar="N", help="sequences decoded together (default 1)")
    w.add_argument("--tokens", type=positive_int, default=DEFAULT_TOKENS, metavar="N",
                   help=f"tokens each sequence generates (default {DEFAULT_TOKENS})")
    w.add_argument("--prompt", type=positive_int, default=DEFAULT_PROMPT, metavar="N",
                   help=f"prompt tokens of each sequence (default {DEFAULT_PROMPT}, Table 4's)")
    add_prefill_chunk_argument(w)
    p = parser.add_argument_group("policies")
    p.add_argument("--policies", type=str_list, default=list(DEFAULT_POLICIES),
                   help=f"comma-separated registry names (default {','.join(DEFAULT_POLICIES)})")
    add_budget_argument(p)
    add_n_recent_argument(p)
    add_policy_arg_argument(p)
    d = parser.add_argument_group("device")
    d.add_argument("--device-memory", default=DEFAULT_DEVICE_MEMORY, metavar="SIZE",
                   help=f"memory of the device, e.g. 80GiB, 80GB (10**9 bytes), 81920MiB (default "
                        f"{DEFAULT_DEVICE_MEMORY}, an 80 GB A100/H100)")
    d.add_argument("--memory-fraction", type=float, default=DEFAULT_MEMORY_FRACTION, metavar="F",
                   help=f"share of the device memory a plan may use (default {DEFAULT_MEMORY_FRACTION})")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of the table")
    return parser


def run_memory(args: argparse.Namespace) -> int:
    """Runs ``beaconkv memory`` from parsed arguments: prints the table (or JSON with ``--json``).

    Returns:
        0.

    Raises:
        MemoryPlanError: Bad settings (before the config is read).
        PolicyConfigError: Bad policy settings.
    """
    device_memory = parse_memory(args.device_memory)
    if not 0 < args.memory_fraction <= 1:
        raise MemoryPlanError(f"--memory-fraction {args.memory_fraction} must be in (0, 1], e.g. 0.9.")
    extra = policy_args_by_policy(args, args.policies)
    if args.budget is not None and all(issubclass(policy_class(n), FullKV) for n in args.policies):
        raise MemoryPlanError(f"--budget {args.budget} would be ignored: none of --policies "
                              f"{','.join(args.policies)} evicts; add one (e.g. --policies full,beacon) or drop "
                              "--budget.")
    budget = DEFAULT_BUDGET if args.budget is None else args.budget
    policies = [build_policy(name, budget, args.n_recent, **extra.get(name, {})) for name in args.policies]
    config, label = model_config(args.model)
    dtype = resolve_dtype(args.dtype, "cuda")
    rows = memory_plan(config, policies, args.batch, args.tokens, prompt=args.prompt, dtype=dtype,
                       kv_storage=args.kv_storage, prefill_chunk=args.prefill_chunk, device_memory=device_memory,
                       memory_fraction=args.memory_fraction)
    rows = [replace(r, policy=name) for r, name in zip(rows, args.policies)]
    if args.json:
        print(json.dumps({"model": label, "dtype": str(dtype).removeprefix("torch."), "kv_storage": args.kv_storage,
                          "parameters": parameter_count(config),
                          "kv_token_bytes": kv_token_bytes(config, dtype, args.kv_storage),
                          "device_memory_bytes": device_memory, "memory_fraction": args.memory_fraction,
                          "rows": [asdict(r) for r in rows]}, indent=1))
        return 0
    print(f"{label}: {config.model_type}, {parameter_count(config) / 1e9:.3f} B parameters "
          f"({_gib(weight_bytes(config, dtype))} GiB in {str(dtype).removeprefix('torch.')}), "
          f"{kv_token_bytes(config, dtype, args.kv_storage):,} KV bytes per token ({args.kv_storage}); batch "
          f"{args.batch}, prompt {args.prompt} + {args.tokens} tokens; device {_gib(device_memory)} GiB x "
          f"{args.memory_fraction:g}")
    print()
    print(memory_table(rows))
    return 0
