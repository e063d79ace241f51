"""Batched generation: right-padded prefill, a static-shape decode loop, per-sequence stopping.

Prompts of different lengths share one batch without attending to padding: every sequence keeps
its own absolute positions, its own cache fill and (through the policy) its own kept positions, so
a ragged batch produces the same greedy tokens as running each prompt alone.

The decode step (:meth:`beaconkv.models.CausalLM.decode_step` + sampling) has static shapes and
no host synchronisation; the host only reads the device to stop early (every ``sync_every``
steps) or to stream text. Eviction runs between steps, at steps the policy computes on the host.
Cache, policy state and execution strategy are set up by :class:`beaconkv.session.Session`; with
``compile=True`` the decode step and the policy's device work run as ``torch.compile`` graphs
(:mod:`beaconkv.execution`; CUDA graphs on CUDA); the prefill stays eager.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .execution import CompileConfig
from .models.decoder import CausalLM
from .policies.base import EvictionPolicy, FullKV
from .policies.registry import make_policy
from .policies.state import EvictionRecord, PolicyState
from .sampling import SamplingParams, sample_next
from .session import Session
from .storage import KVStorage
from .tokenizer import Tokenizer

#: ``stream(sequence_index, token_id, text_delta)`` is called for every new token.
StreamCallback = Callable[[int, int, str], None]


class PromptError(ValueError):
    """A prompt is empty or too long for the model or the cache."""


@dataclass
class GenerationStats:
    """Figures of one :func:`generate` call.

    Attributes:
        prompt_tokens: Prompt length per sequence.
        new_tokens: Generated tokens per sequence (including a final end-of-sequence token).
        cache_capacity: Slots per (sequence, KV head) allocated for the generation.
        cache_bytes: Bytes of keys and values allocated.
        evictions: Evictions per sequence.
        peak_cache_tokens: Most tokens any sequence held in the cache.
        prefill_s: Wall time of the prefill.
        wall_time_s: Wall time of the whole call.
        decode_steps: Decode steps run.
        eviction_s: Wall time spent evicting.
        policy_s: Host wall time in the policy between steps (evictions and BeaconKV's query-set
            maintenance included).
        compiled: Whether the decode step ran compiled.
        compiled_evictions: Evictions that ran as the compiled eviction step (the others ran eagerly).
        tokens_per_s: Generated tokens (all sequences) per second of decoding.
    """

    prompt_tokens: list[int]
    new_tokens: list[int]
    cache_capacity: int
    cache_bytes: int
    evictions: list[int]
    peak_cache_tokens: int
    prefill_s: float
    wall_time_s: float
    decode_steps: int
    eviction_s: float
    policy_s: float = 0.0
    compiled: bool = False
    compiled_evictions: int = 0

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens of the whole batch per second of decode time."""
        decode = self.wall_time_s - self.prefill_s
        return sum(self.new_tokens) / decode if decode > 0 else float("nan")


@dataclass
class GenerationOutput:
    """The result of :func:`generate`.

    Attributes:
        token_ids: New token ids per prompt (ending with the stop token if one was produced).
        texts: Decoded new text per prompt (special tokens skipped).
        finish_reasons: ``"stop"`` (an end-of-sequence id) or ``"length"`` (``max_new_tokens``).
        prompt_ids: The prompt ids that were fed.
        stats: Figures of the run.
        policy: The policy that ran.
        policy_state: Its state at the end (counters, the kept sets' telemetry...).
    """

    token_ids: list[list[int]]
    texts: list[str]
    finish_reasons: list[str]
    prompt_ids: list[list[int]]
    stats: GenerationStats
    policy: EvictionPolicy = field(repr=False, default=None)  # type: ignore[assignment]
    policy_state: PolicyState | None = field(repr=False, default=None)

    @property
    def telemetry(self) -> list[EvictionRecord]:
        """Every eviction's kept positions, layer by layer (policies built with ``telemetry=True``)."""
        return [] if self.policy_state is None else self.policy_state.stats.telemetry


def _encode_prompts(tokenizer: Tokenizer | None, prompts: Sequence, chat: bool) -> list[list[int]]:
    if isinstance(prompts, (str, bytes)) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]  # a single prompt
    if len(prompts) == 0:
        raise PromptError("prompts is empty; pass at least one prompt.")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if tokenizer is None:
                raise PromptError("text prompts need a tokenizer; pass tokenizer= or token ids.")
            if not p:
                raise PromptError(f"prompt {i} is an empty string; every prompt needs at least one token.")
            ids = tokenizer.encode_prompt(tokenizer.chat_prompt(p) if chat else p)
        else:
            ids = [int(t) for t in p]
        if not ids:
            raise PromptError(f"prompt {i} encodes to no tokens; every prompt needs at least one token.")
        out.append(ids)
    return out


def generate(
    model: CausalLM,
    tokenizer: Tokenizer | None,
    prompts: Sequence[str] | Sequence[Sequence[int]] | str,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    policy: EvictionPolicy | str | None = None,
    stream: StreamCallback | None = None,
    chat: bool = False,
    eos_token_ids: Sequence[int] | None = None,
    sync_every: int = 16,
    cache_dtype: torch.dtype | None = None,
    compile: bool | CompileConfig = False,
    capacity_tokens: int | None = None,
    kv_storage: str | type[KVStorage] = "dense",
    policy_args: Mapping[str, Any] | None = None,
    on_step: Callable[[int, Session], None] | None = None,
) -> GenerationOutput:
    """Generates continuations for a batch of prompts.

    Args:
        model: A loaded :class:`~beaconkv.models.CausalLM`.
        tokenizer: Encodes text prompts and decodes outputs (None: prompts must be ids; no texts).
        prompts: Texts (tokenized as-is, BOS added when the tokenizer adds one) or lists of ids.
        max_new_tokens: Most new tokens per sequence.
        temperature: 0 = greedy; else softmax temperature.
        top_p: Nucleus sampling mass.
        top_k: Keep only the k most likely tokens (0 = off).
        seed: Seeds the sampling generator (reproducible sampling).
        policy: KV-cache eviction policy, or its registry name (``"beacon"``; settings in
            ``policy_args``); None keeps everything (:class:`~beaconkv.policies.FullKV`). A policy
            object holds settings only: one may serve any number of calls.
        stream: Called as ``stream(i, token_id, text_delta)`` for each new token of sequence ``i``.
        chat: Wrap text prompts in the tokenizer's chat template as a single user turn.
        eos_token_ids: Stop ids (default: the tokenizer's).
        sync_every: Decode steps between checks whether every sequence has stopped.
        cache_dtype: Dtype the KV cache stores keys and values in (default: the model's); attention
            casts them to the model's dtype.
        compile: Run the decode step (all layers, cache write, attention, sampling) and full-batch
            evictions as ``torch.compile(fullgraph=True)`` graphs — CUDA graphs on CUDA, inductor on
            CPU; a :class:`~beaconkv.execution.CompileConfig` tunes it. The first call compiles (a
            minute or two for a 30-layer model on a CPU); later calls reuse the graphs (a new cache
            capacity or batch recompiles once, then shapes stay symbolic). Greedy tokens are the
            same as eager.
        capacity_tokens: New tokens the cache is sized for (default ``max_new_tokens``): a larger value
            allocates the cache a longer generation needs while decoding only ``max_new_tokens``
            (benchmarks measure a long generation's memory and step time this way).
        kv_storage: How the cache holds keys and values: ``"dense"`` (default) or ``"int8"`` (per-token,
            per-KV-head scales; see :mod:`beaconkv.storage`), or a :class:`~beaconkv.storage.KVStorage` class.
        policy_args: Settings of a policy given by name (``{"budget": 128, "n_beacon": 8}``).
        on_step: Called as ``on_step(step, session)`` after every decode step, once the policy's work
            (evictions included) is done — a public hook for measurement (see
            :class:`beaconkv.measure.speed.timing.StepRecorder`).

    Returns:
        The new tokens, texts, finish reasons and stats.

    Raises:
        PromptError: Empty prompt, or a prompt longer than the model's maximum positions.
        ValueError: Bad sampling parameters, ``max_new_tokens < 1`` or ``capacity_tokens < max_new_tokens``.
        beaconkv.compile.CompileError: ``compile`` was asked for and ``torch.compile`` is unavailable
            or failed (there is no silent fallback to eager).
    """
    t_start = time.perf_counter()
    params = SamplingParams(temperature, top_p, top_k)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1.")
    policy = resolve_policy(policy, policy_args)
    ids = _encode_prompts(tokenizer, prompts, chat)
    lengths = [len(p) for p in ids]
    cfg = model.config
    too_long = [(i, L) for i, L in enumerate(lengths) if L > cfg.max_position_embeddings]
    if too_long:
        i, L = too_long[0]
        raise PromptError(
            f"prompt {i} has {L} tokens, more than the model's max_position_embeddings="
            f"{cfg.max_position_embeddings}; shorten it."
        )
    room = cfg.max_position_embeddings - max(lengths)
    if max_new_tokens > room:
        warnings.warn(f"max_new_tokens={max_new_tokens} capped to {room} by max_position_embeddings.")
        max_new_tokens = room
    stop = list(eos_token_ids if eos_token_ids is not None else (tokenizer.eos_token_ids if tokenizer else []))
    if capacity_tokens is not None and capacity_tokens < max_new_tokens:
        raise ValueError(f"capacity_tokens={capacity_tokens} must be >= max_new_tokens={max_new_tokens}.")
    session = Session.for_prompts(model, policy, lengths, capacity_tokens or max_new_tokens, kv_storage=kv_storage,
                                  cache_dtype=cache_dtype, compile=compile)
    device = session.device
    B = len(ids)
    pad = stop[0] if stop else 0
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
    stop_t = torch.tensor(stop or [-1], device=device)

    with torch.inference_mode():
        logits = session.prefill(ids)
        tokens = sample_next(logits, params, generator)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # so that prefill_s is the prefill's time, not its launch
        prefill_s = time.perf_counter() - t_start
        out = torch.full((B, max_new_tokens), pad, dtype=torch.long, device=device)
        finished = torch.zeros(B, dtype=torch.bool, device=device)
        n_new = torch.zeros(B, dtype=torch.long, device=device)
        streamer = _Streamer(tokenizer, stream, B) if stream else None
        steps = 0
        for step in range(max_new_tokens):
            out[:, step] = torch.where(finished, pad, tokens)
            n_new += (~finished).long()
            if streamer is not None:
                streamer.push(tokens.tolist(), finished.tolist())
            finished |= torch.isin(tokens, stop_t)
            if step == max_new_tokens - 1:
                break
            if (step + 1) % sync_every == 0 and bool(finished.all()):
                break
            tokens = session.step(tokens, params, generator)
            if on_step is not None:
                on_step(steps, session)
            steps += 1
        finished_l = finished.tolist()
        counts = n_new.tolist()
        out_l = out.tolist()
    token_ids = [row[:n] for row, n in zip(out_l, counts)]
    reasons = ["stop" if f else "length" for f in finished_l]
    texts = [tokenizer.decode(t) for t in token_ids] if tokenizer is not None else [""] * B
    wall = time.perf_counter() - t_start
    st = session.state
    stats = GenerationStats(
        prompt_tokens=lengths, new_tokens=[len(t) for t in token_ids], cache_capacity=session.cache.capacity,
        cache_bytes=session.cache.nbytes(), evictions=list(st.stats.evictions), peak_cache_tokens=st.peak_tokens,
        prefill_s=prefill_s, wall_time_s=wall, decode_steps=steps, eviction_s=st.stats.eviction_seconds,
        policy_s=session.policy_s, compiled=session.compiled,
        compiled_evictions=st.stats.eviction_calls if st.executor.compiled else 0,
    )
    return GenerationOutput(token_ids, texts, reasons, ids, stats, session.policy, st)


def resolve_policy(policy: EvictionPolicy | str | None, policy_args: Mapping[str, Any] | None = None) -> EvictionPolicy:
    """A policy object from ``generate``'s ``policy`` argument: an object, a registry name, or None (FullKV).

    Raises:
        beaconkv.policies.PolicyConfigError: Unknown name or settings.
        TypeError: ``policy`` is none of these, or ``policy_args`` come with a policy object.
    """
    if isinstance(policy, str):
        return make_policy(policy, **dict(policy_args or {}))
    if policy_args:
        raise TypeError("policy_args go with a policy name (policy='beacon'); a policy object carries its settings.")
    if policy is None:
        return FullKV()
    if not isinstance(policy, EvictionPolicy):
        raise TypeError(f"policy={policy!r} must be an EvictionPolicy, a registry name or None.")
    return policy


class _Streamer:
    """Turns per-step token ids into text deltas (holding back incomplete UTF-8 sequences)."""

    def __init__(self, tokenizer: Tokenizer | None, callback: StreamCallback, batch: int) -> None:
        self.tok, self.cb = tokenizer, callback
        self.ids: list[list[int]] = [[] for _ in range(batch)]
        self.sent = [""] * batch

    def push(self, tokens: list[int], finished: list[bool]) -> None:
        for i, (t, done) in enumerate(zip(tokens, finished)):
            if done:
                continue
            self.ids[i].append(t)
            delta = ""
            if self.tok is not None:
                text = self.tok.decode(self.ids[i])
                if not text.endswith("\ufffd"):
                    delta, self.sent[i] = text[len(self.sent[i]):], text
            self.cb(i, t, delta)


