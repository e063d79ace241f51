"""What each part of a generation's memory costs, from a model's config alone: the terms of
:mod:`beaconkv.measure.memory`'s plan.

Units (:func:`parse_memory`), the model's parameters and weights (:func:`parameter_count`,
:func:`weight_bytes`), the cache's bytes per token and its bookkeeping (:func:`kv_token_bytes`,
:func:`index_bytes`), the policy's own tensors, measured by running its ``create_state`` on PyTorch's meta
device (:func:`build_policy`, :func:`policy_state_bytes`), and the estimate of the largest transient
(:func:`workspace_terms`). Every figure is in bytes; nothing is loaded and nothing is allocated.
"""

from __future__ import annotations

import math
import re
import weakref
from fractions import Fraction
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..cache import KVCache
from ..errors import BeaconKVError
from ..models.config import ModelConfig
from ..models.decoder import default_rope
from ..policies.base import EvictionPolicy, FullKV
from ..policies.registry import (
    auto_n_recent,
    make_policy,
    policy_class,
    policy_parameters,
)
from ..storage.int8 import SCALE_DTYPE

__all__ = ["MEMORY_UNITS", "MemoryPlanError", "build_policy", "index_bytes", "kv_token_bytes", "parameter_count",
           "parse_memory", "policy_state_bytes", "weight_bytes", "workspace_terms"]

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
