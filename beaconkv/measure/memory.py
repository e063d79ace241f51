"""The memory a generation needs, from a model's config alone: the paper's Table-4 arithmetic as a tool.

``beaconkv memory --model qwen3-4b --batch 14 --tokens 32768 --budget 2048 --device-memory 80GiB``
prints, for each policy, the cache slots a sequence needs, the bytes of keys and values, the
predicted peak and the largest batch that fits the device. Nothing is loaded and nothing is
allocated: the parameter count comes from the config (:func:`parameter_count`), the cache size from
the policy's own allocation rule (:meth:`~beaconkv.policies.EvictionPolicy.capacity`, as the session
sizes it), and the policy's own tensors from its ``create_state`` run on PyTorch's meta device
(shapes without memory; :func:`policy_state_bytes`).

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
import re
import weakref
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

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
from ..cache import KVCache
from ..errors import BeaconKVError
from ..models.config import ModelConfig
from ..models.decoder import default_rope
from ..models.loading import resolve_dtype
from ..models.random_weights import RANDOM_SHAPES
from ..policies.base import EvictionPolicy, FullKV
from ..policies.registry import auto_n_recent, make_policy, policy_class, policy_parameters
from ..storage.int8 import SCALE_DTYPE

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

MEMORY_UNITS: dict[str, int] = {
    "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
}
"""Memory units of :func:`parse_memory`: decimal (``GB`` = 10**9 bytes) and binary (``GiB`` = 2**30)."""

_UNITS_LOWER = {unit.lower(): unit for unit in MEMORY_UNITS}
_MEMORY = re.compile(r"^\s*(?P<number>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>[A-Za-z]+)\s*$")


class MemoryPlanError(BeaconKVError, ValueError):
    """Settings a memory plan cannot be made for (the message names the value, the limit and the fix)."""


# ------------------------------------------------------------------------------------------ units
def parse_memory(text: str | int) -> int:
    """An amount of memory in bytes: ``"80GiB"`` -> ``85899345920``, ``"80GB"`` -> ``80000000000``.

    Units are case-insensitive (:data:`MEMORY_UNITS`): ``KB``/``MB``/``GB``/``TB`` are powers of 1000,
    ``KiB``/``MiB``/``GiB``/``TiB`` powers of 1024; a fraction is exact (``"79.5GiB"``), a fraction of
    a byte rounds down. An int is taken as bytes.

    Args:
        text: The amount, e.g. ``"80GiB"``, ``"81920MiB"``, ``"40 GB"``, or bytes as an int.

    Returns:
        Bytes, at least 1.

    Raises:
        MemoryPlanError: No unit, an unknown unit, not a number, or zero.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        match = _MEMORY.match(str(text))
        units = ", ".join(MEMORY_UNITS)
        if match is None:
            raise MemoryPlanError(f"device memory {text!r} is not a number with a unit; write e.g. 80GiB or 80GB "
                                  f"(units: {units}).")
        unit = _UNITS_LOWER.get(match["unit"].lower())
        if unit is None:
            raise MemoryPlanError(f"device memory {text!r}: unknown unit {match['unit']!r}; use one of {units} "
                                  "(GB = 10**9 bytes, GiB = 2**30).")
        value = math.floor(Fraction(match["number"]) * MEMORY_UNITS[unit])
    if value < 1:
        raise MemoryPlanError(f"device memory {text!r} is {value} bytes; it must be at least 1 byte.")
    return value


def _gib(n: int | float) -> str:
    return f"{n / 2**30:.2f}"


# ------------------------------------------------------------------------------------------ model
def parameter_count(config: ModelConfig) -> int:
    """Parameters of the model ``config`` describes, counted from the config alone.

    The token embedding (``vocab · hidden``), the LM head unless it is tied to it, and per layer: the
    q/k/v/o projections (``hidden · heads · head_dim`` for q and o, ``hidden · kv_heads · head_dim`` for
    k and v), their biases where the config has them (Qwen2: q, k and v; o never), Qwen3's per-head
    q/k RMSNorm weights (``head_dim`` each), the SwiGLU MLP (``3 · hidden · intermediate``) and two
    RMSNorms; then the final norm.

    Args:
        config: The architecture.

    Returns:
        The count, equal to ``sum(p.numel() for p in build_model(config).parameters())``.
    """
    c = config
    q_width, kv_width = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    attention = 2 * c.hidden_size * q_width + 2 * c.hidden_size * kv_width
    if c.attention_bias:
        attention += q_width + 2 * kv_width
    if c.qk_norm:
        attention += 2 * c.head_dim
    layer = attention + 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size
    embedding = c.vocab_size * c.hidden_size
    head = 0 if c.tie_word_embeddings else embedding
    return embedding + head + c.num_hidden_layers * layer + c.hidden_size


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def weight_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of the weights: :func:`parameter_count` parameters in ``dtype``.

    Args:
        config: The architecture.
        dtype: The model dtype.
    """
    return parameter_count(config) * _element_size(dtype)


def _storage_name(kv_storage: str) -> str:
    key = str(kv_storage).strip().lower()
    if key not in ("dense", "int8"):
        raise MemoryPlanError(f"kv_storage={kv_storage!r} has no memory rule here; use 'dense' or 'int8'.")
    return key


def kv_token_bytes(config: ModelConfig, dtype: torch.dtype, kv_storage: str = "dense") -> int:
    """Bytes one token's keys and values take in every layer's cache.

    Dense: ``2 · layers · kv_heads · head_dim · bytes`` (``bytes`` of ``dtype``). Int8
    (:class:`~beaconkv.storage.int8.Int8KV`): per layer, KV head and token one int8 per element and one
    float16 scale, for keys and for values: ``2 · layers · kv_heads · (head_dim + 2)``.

    Args:
        config: The architecture.
        dtype: The model dtype (a dense cache keeps keys and values in it).
        kv_storage: ``"dense"`` or ``"int8"``.

    Raises:
        MemoryPlanError: Another storage.
    """
    c = config
    if _storage_name(kv_storage) == "int8":
        per_head = c.head_dim * _element_size(torch.int8) + _element_size(SCALE_DTYPE)
    else:
        per_head = c.head_dim * _element_size(dtype)
    return 2 * c.num_hidden_layers * c.num_key_value_heads * per_head


def index_bytes(config: ModelConfig, batch: int, slots: int) -> int:
    """Bytes of the cache's bookkeeping: per layer, one int64 position per (row, KV head, slot), one int64
    length and one bool flag per row (:class:`~beaconkv.cache.LayerKVCache`'s ``pos``, ``length``, ``active``).

    Args:
        config: The architecture.
        batch: Rows.
        slots: Slots per (row, KV head).
    """
    return config.num_hidden_layers * (batch * config.num_key_value_heads * slots * 8 + batch * 8 + batch)


# ---------------------------------------------------------------------------------------- policies
def build_policy(name: str, budget: int | None = None, n_recent: int | None = None,
                 **kwargs: Any) -> EvictionPolicy:
    """A policy by registry name, as the command line builds it: FullKV takes no budget, and ``n_recent``
    left out is the policy's own, lowered to what the budget's eviction step leaves (``--n-recent auto``).

    Args:
        name: A registry name (``full``, ``beacon``, ``snapkv``...) or a ``module:Class`` spec.
        budget: The budget of an evicting policy (None for FullKV).
        n_recent: Recent tokens kept (None: auto).
        **kwargs: Further constructor arguments.

    Raises:
        PolicyConfigError: An unknown policy or settings it rejects.
    """
    if issubclass(policy_class(name), FullKV):
        return make_policy(name, **kwargs)
    if n_recent is not None:
        kwargs["n_recent"] = n_recent
    elif isinstance(budget, int) and budget >= 1:
        params = policy_parameters(name)
        own, ratio = params.get("n_recent"), kwargs.get("ratio", params.get("ratio"))
        if isinstance(own, int) and isinstance(ratio, (int, float)) and 0 < ratio < 1:
            kwargs["n_recent"] = auto_n_recent(budget, own, ratio)
    return make_policy(name, budget=budget, **kwargs)


class _NewStorages(TorchDispatchMode):
    """Remembers (weakly) every meta tensor an operation returns while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[weakref.ref[torch.Tensor]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type == "meta":
                self.made.append(weakref.ref(t))
        return out


def policy_state_bytes(config: ModelConfig, policy: EvictionPolicy, batch: int, slots: int, max_tokens: int,
                       dtype: torch.dtype = torch.bfloat16, kv_storage: str = "dense") -> int:
    """Bytes of the tensors ``policy`` keeps for a cache of ``batch`` rows of ``slots`` slots.

    The policy's own ``create_state`` runs over a cache allocated on the meta device (shapes, no
    memory), exactly as the session calls it; the storages its tensors still hold afterwards, not the
    cache's, are summed. So whatever a policy keeps — query rings, query sets, per-slot buffers, row
    counters — is counted without a rule per policy.

    Args:
        config: The architecture.
        policy: The policy.
        batch: Rows.
        slots: Slots per (row, KV head).
        max_tokens: The longest sequence a row holds (sizes the query ring).
        dtype: The model dtype.
        kv_storage: ``"dense"`` or ``"int8"``.

    Raises:
        MemoryPlanError: The policy's state cannot be built on the meta device.
    """
    c = config
    cache = KVCache.allocate(c.num_hidden_layers, batch, c.num_key_value_heads, c.num_attention_heads, slots,
                             c.head_dim, dtype=dtype, device="meta", storage=_storage_name(kv_storage))
    before = {t.untyped_storage()._cdata for t in cache.buffers()}
    try:
        with _NewStorages() as seen:
            state = policy.create_state(cache, default_rope(c), None, max_tokens=max_tokens)
    except Exception as err:  # a policy that reads device values while allocating
        raise MemoryPlanError(f"{policy!r}'s state could not be sized on the meta device ({type(err).__name__}: "
                              f"{err}); its create_state must allocate without reading tensor values.") from err
    storages: dict[int, int] = {}
    for ref in seen.made:
        t = ref()
        if t is not None:
            s = t.untyped_storage()
            if s._cdata not in before:
                storages[s._cdata] = s.nbytes()
    del state
    return sum(storages.values())


# ---------------------------------------------------------------------------------------- workspace
def workspace_terms(config: ModelConfig, policy: EvictionPolicy, batch: int, slots: int, prompt: int,
                    max_tokens: int, dtype: torch.dtype = torch.bfloat16, kv_storage: str = "dense",
                    prefill_chunk: int | None = None) -> dict[str, dict[str, int]]:
    """The transient memory of the three moments of a generation, term by term (an estimate).

    Symbols: ``B`` batch, ``C`` slots, ``V`` vocabulary, ``H`` hidden, ``I`` intermediate, ``h`` query
    heads, ``k`` KV heads, ``g = h / k`` the GQA group, ``d`` head_dim, ``e`` bytes of ``dtype``, ``L``
    tokens per prefill forward (the prompt, or ``prefill_chunk``), ``n`` the queries an eviction scores
    with (the policy's query window). One layer's transients are alive at a time.

    * ``prefill``: ``activations`` ``B·L·(2H + 2(h + 2k)d + 3I)·e`` (input and residual, q/k/v and the
      rotated q/k, the MLP's gate, up and product); ``logits`` ``B·V·(e + 4)`` (the last token's, in
      ``dtype`` and float32); ``positions`` ``B·k·C·8`` (the positions the prefill writes); ``chunk mask``
      ``B·k·L·C`` (bool, a prompt in chunks: which slots each query sees).
    * ``decode``: ``activations`` as the prefill's with ``L = 1``; ``logits`` ``B·V·(e + 4)``;
      ``attention weights`` ``2·B·h·C·4`` (float32 logits and weights) where the policy observes them
      (``track_attention``) or int8 storage computes them; ``int8 dequantised`` ``B·k·C·d·4`` (int8: one
      layer's keys or values as float32).
    * ``eviction`` (a policy that evicts): ``keys`` ``B·k·C·d·4`` (one layer's keys in float32);
      ``scores`` ``2·B·k·g·n·C·4`` (two float32 score tensors of ``n`` queries over the cache alive at
      once: an operation's input and output); ``selection`` ``B·k·C·12`` (per-slot float32 scores and int64
      ranks).

    Not counted: the host side, the generated token ids, a policy's prefill observation (no larger than
    its eviction's scores over the prompt), an unfused attention kernel's ``B·h·L·L`` scores. A policy
    that scores with its whole query history (an unbounded sampler) has a query window of the whole
    sequence: its ``scores`` are then an overestimate.

    Args:
        config: The architecture.
        policy: The policy.
        batch: Rows.
        slots: Slots per (row, KV head).
        prompt: Prompt tokens per row.
        max_tokens: The longest sequence a row holds.
        dtype: The model dtype.
        kv_storage: ``"dense"`` or ``"int8"``.
        prefill_chunk: Tokens per prefill chunk (None: whole prompts).

    Returns:
        ``{moment: {term: bytes}}`` for ``prefill``, ``decode`` and ``eviction`` (empty for FullKV).
    """
    c = config
    B, C, V, H, I = batch, slots, c.vocab_size, c.hidden_size, c.intermediate_size
    h, k, d, e = c.num_attention_heads, c.num_key_value_heads, c.head_dim, _element_size(dtype)
    g = h // k
    int8 = _storage_name(kv_storage) == "int8"
    chunked = prefill_chunk is not None and prompt > prefill_chunk
    L = prefill_chunk if chunked else prompt

    def activations(tokens: int) -> int:
        return B * tokens * (2 * H + 2 * (h + 2 * k) * d + 3 * I) * e

    logits = B * V * (e + 4)
    prefill = {"activations": activations(L), "logits": logits, "positions": B * k * C * 8,
               "chunk mask": B * k * L * C if chunked else 0}
    decode = {"activations": activations(1), "logits": logits,
              "attention weights": 2 * B * h * C * 4 if (policy.track_attention or int8) else 0,
              "int8 dequantised": B * k * C * d * 4 if int8 else 0}
    eviction: dict[str, int] = {}
    if policy.evicts:
        n = policy.query_window(max_tokens)
        eviction = {"keys": B * k * C * d * 4, "scores": 2 * B * k * g * n * C * 4, "selection": B * k * C * 12}
    return {"prefill": prefill, "decode": decode, "eviction": eviction}


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
