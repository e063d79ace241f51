"""Generation with a transformers model and a :class:`~beaconkv.hf.PolicyCache`: what ``--backend hf`` runs.

:func:`load_hf_model` loads a checkpoint in transformers (``sdpa`` attention where the architecture has it,
else ``eager``); :func:`generate_hf` encodes prompts with beaconkv's tokenizer (chat template and all, as
:func:`beaconkv.generate` does), left-pads them, runs ``model.generate`` into a ``PolicyCache`` and returns
the tokens, texts and the cache's figures.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import BeaconKVError
from ..generation import encode_prompts, resolve_policy
from ..models.loading import resolve_device, resolve_dtype
from ..policies import EvictionPolicy
from ..policies.state import PolicyState
from ..tokenizer import Tokenizer
from .cache import PolicyCache
from .support import check_config, check_model


class HFBackendError(BeaconKVError, ValueError):
    """A setting the transformers backend does not take; the message names it and the fix."""


@dataclass
class HFGenerationStats:
    """Figures of one :func:`generate_hf` call.

    Attributes:
        prompt_tokens: Prompt tokens per row.
        new_tokens: New tokens per row (up to and including its end-of-sequence token).
        cache_capacity: Slots per (row, KV head) of the policy's layers.
        cache_bytes: Bytes of the policy's layers' keys and values.
        peak_cache_tokens: Most tokens a row held in a policy layer.
        evictions: Evictions per row.
        wall_time_s: Seconds of ``model.generate`` (prefill included).
        tokens_per_s: New tokens of every row per second of ``wall_time_s``.
    """

    prompt_tokens: list[int]
    new_tokens: list[int]
    cache_capacity: int
    cache_bytes: int
    peak_cache_tokens: int
    evictions: list[int]
    wall_time_s: float
    tokens_per_s: float


@dataclass
class HFGenerationOutput:
    """The result of :func:`generate_hf`.

    Attributes:
        token_ids: New token ids per row (up to and including an end-of-sequence token).
        texts: Their decoded texts (None without a tokenizer).
        finish_reasons: ``"stop"`` (an end-of-sequence token) or ``"length"`` per row.
        stats: The figures.
        policy_state: The policy's state at the end (counters, telemetry).
    """

    token_ids: list[list[int]]
    texts: list[str] | None
    finish_reasons: list[str]
    stats: HFGenerationStats
    policy_state: PolicyState


def load_hf_model(path: str, dtype: str | torch.dtype = "auto", device: str = "auto") -> nn.Module:
    """A checkpoint as a transformers causal LM in eval mode, with ``sdpa`` attention (``eager`` where the
    architecture has no sdpa attention, as gpt-oss), checked to be one a :class:`~beaconkv.hf.PolicyCache`
    serves: from its config before any weight loads, then from its modules.

    Args:
        path: A checkpoint directory or hub id.
        dtype: ``auto`` (bfloat16 on CUDA, float32 on CPU) or a dtype or its name.
        device: ``auto``, ``cpu``, ``cuda``...

    Raises:
        UnsupportedArchitectureError: An architecture a PolicyCache does not serve (multi-head latent
            attention, a linear-attention hybrid, ...; see :mod:`beaconkv.hf.support`).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    check_config(AutoConfig.from_pretrained(path))  # refuse before the weights load
    where = resolve_device(device)
    dtype = resolve_dtype(dtype, where)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    except ValueError as err:
        if "scaled_dot_product_attention" not in str(err):
            raise
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")
    model = model.to(where).eval()
    check_model(model)
    return model


def left_pad(prompts: Sequence[Sequence[int]], pad: int, device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
    """``(ids (b, L), attention_mask (b, L))`` of ragged prompts, left-padded with ``pad``."""
    L = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), L), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, L - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
        mask[b, L - len(p):] = 1
    return ids.to(device), mask.to(device)


def generate_hf(
    model: nn.Module,
    tokenizer: Tokenizer | None,
    prompts: Any,
    *,
    policy: EvictionPolicy | None = None,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    chat: bool = False,
    eos_token_ids: Sequence[int] | None = None,
    prefill_chunk: int | None = None,
) -> HFGenerationOutput:
    """Generates continuations of ``prompts`` with ``model.generate`` into a :class:`~beaconkv.hf.PolicyCache`.

    Args:
        model: A transformers causal LM (see :func:`load_hf_model`).
        tokenizer: Encodes texts (and renders ``chat``); None: prompts are token ids, no texts come back.
        prompts: As :func:`beaconkv.generate` takes them (texts, token ids, conversations, or one of them).
        policy: The eviction policy (None: keep everything).
        max_new_tokens: Most new tokens per row.
        temperature: 0: greedy; else the sampling temperature.
        top_p: Nucleus mass.
        top_k: Most likely tokens kept (0: off).
        seed: Seeds torch's generator, which transformers samples from (one stream for the whole batch).
        chat: Render texts as one user turn of the chat template.
        eos_token_ids: Stop ids (default: the tokenizer's; ``[]``: never stop).
        prefill_chunk: Prefill prompts longer than this in chunks of this many tokens, the policy evicting between
            chunks (``PolicyCache(..., prefill_chunk=)``): the store then holds at most ``n_prefix + budget +
            prefill_chunk`` slots per KV head instead of the whole prompt. None: whole prompts.

    Returns:
        The tokens, texts and figures.
    """
    policy = resolve_policy(policy)
    ids_list = encode_prompts(tokenizer, prompts, chat=chat)
    pad = tokenizer.pad_token_id if tokenizer is not None else 0
    device = next(model.parameters()).device
    ids, mask = left_pad(ids_list, pad, device)
    eos = list(eos_token_ids) if eos_token_ids is not None else list(tokenizer.eos_token_ids if tokenizer else [])
    cache = PolicyCache(model, policy, max_new_tokens=max_new_tokens, prefill_chunk=prefill_chunk)
    sampling: dict[str, Any] = {"do_sample": False}
    if temperature > 0:
        sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": top_k or None}
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=max_new_tokens,
                             eos_token_id=eos or None, pad_token_id=pad, **sampling)
    wall = time.perf_counter() - t0
    rows, reasons = [], []
    for row in out[:, ids.shape[1]:].tolist():
        stop = next((i for i, t in enumerate(row) if t in eos), None)
        rows.append(row if stop is None else row[: stop + 1])
        reasons.append("length" if stop is None else "stop")
    state, store = cache.state, cache.store
    held = max(int(layer.length.max()) for layer in store.layers)
    stats = HFGenerationStats(
        prompt_tokens=[len(p) for p in ids_list], new_tokens=[len(r) for r in rows], cache_capacity=store.capacity,
        cache_bytes=store.nbytes(), peak_cache_tokens=max(state.peak_tokens, held),
        evictions=list(state.stats.evictions), wall_time_s=wall, tokens_per_s=sum(map(len, rows)) / max(wall, 1e-9))
    texts = [tokenizer.decode(r) for r in rows] if tokenizer is not None else None
    return HFGenerationOutput(rows, texts, reasons, stats, state)


def check_hf_options(compile: bool, kv_storage: str, kernels: str) -> None:
    """Refuses the native decoder's options the transformers backend has no use for.

    Raises:
        HFBackendError: ``--compile``, a storage other than ``dense`` or kernels other than ``auto``.
    """
    if compile:
        raise HFBackendError("--backend hf runs transformers' eager decode step; drop --compile (the native backend "
                             "compiles).")
    if kv_storage != "dense":
        raise HFBackendError(f"--backend hf stores keys and values densely; drop --kv-storage {kv_storage}.")
    if kernels != "auto":
        raise HFBackendError(f"--backend hf runs the model's own matmuls; drop --kernels {kernels}.")
