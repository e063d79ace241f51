"""Generation for a list of prompts: texts, token ids or chat conversations, through the engine.

:func:`generate` encodes the prompts (rendering conversations with the checkpoint's chat template),
makes an :class:`~beaconkv.engine.Engine` whose slot pool fits them (``max_batch`` slots; all
prompts at once by default) and runs them to completion. Every prompt is one request with its own
position counter, cache fill, kept positions and noise generator, so a ragged batch produces the
same greedy tokens as running each prompt alone, and a finished sequence leaves its slot at once: it
is no longer evicted or counted, and with more prompts than slots the next one takes its place.

The decode step (:meth:`beaconkv.models.CausalLM.decode_step` + per-row sampling) has static shapes
and no host synchronisation; the host reads the new tokens once per step (stopping, streaming,
admissions). Eviction runs between steps, at steps the policy computes on the host. With
``compile=True`` the decode step and the policy's device work run as ``torch.compile`` graphs
(:mod:`beaconkv.execution`; CUDA graphs on CUDA); the prefill stays eager.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .decode_setup import DecodeSetup
from .engine import Engine, EngineError, Event, Request
from .errors import BeaconKVError
from .execution import CompileConfig
from .models.decoder import CausalLM
from .policies.base import EvictionPolicy, FullKV
from .policies.config import PolicyConfigError
from .policies.state import EvictionRecord, PolicyState
from .sampling import SamplingParams
from .session import Session
from .storage import KVStorage
from .tokenizer import Tokenizer

#: ``stream(sequence_index, token_id, text_delta)`` is called for every new token.
StreamCallback = Callable[[int, int, str], None]
#: One chat conversation: ``[{"role": "system" | "user" | "assistant", "content": "..."}, ...]``.
Conversation = Sequence[Mapping[str, Any]]


class PromptError(BeaconKVError, ValueError):
    """A prompt is empty, malformed or too long for the model or the cache."""


@dataclass
class GenerationStats:
    """Figures of one :func:`generate` call.

    Attributes:
        prompt_tokens: Prompt length per sequence.
        new_tokens: Generated tokens per sequence (including a final end-of-sequence token).
        cache_capacity: Slots per (sequence, KV head) allocated for the generation.
        cache_bytes: Bytes of keys and values allocated (the whole slot pool).
        evictions: Evictions per sequence.
        peak_cache_tokens: Most tokens any sequence held in the cache.
        prefill_s: Wall time of the prefills.
        wall_time_s: Wall time of the whole call.
        decode_steps: Decode steps run.
        eviction_s: Wall time spent evicting.
        policy_s: Host wall time in the policy between steps (evictions and BeaconKV's query-set
            maintenance included).
        compiled: Whether the decode step ran compiled.
        compile_s: Wall seconds spent compiling graphs during the call (decode step and policy work; 0
            eager, and 0 once every graph this setting needs was compiled by an earlier call).
        compiled_evictions: Evictions that ran as compiled graphs.
        max_batch: Slots of the pool (sequences decoded together).
        kernels: The matmul kernels that ran (``"model"``, ``"packed"`` or ``"bf16w"``, see ``generate(kernels=...)``).
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
    max_batch: int = 1
    kernels: str = "model"
    compile_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens of the whole batch per second of decode time (compilation excluded)."""
        decode = self.wall_time_s - self.prefill_s - self.compile_s
        return sum(self.new_tokens) / decode if decode > 0 else float("nan")


@dataclass
class GenerationOutput:
    """The result of :func:`generate`.

    Attributes:
        token_ids: New token ids per prompt (ending with the stop token if one was produced).
        texts: Decoded new text per prompt (special tokens skipped; cut before a stop string).
        finish_reasons: ``"stop"`` (an end-of-sequence id or a stop string) or ``"length"``.
        prompt_ids: The prompt ids that were fed.
        stats: Figures of the run.
        policy: The policy that ran.
        policy_state: Its state at the end (counters, the kept sets' telemetry...); its rows are the
            engine's slots (prompt ``i`` ran in slot ``i`` when every prompt had a slot at once).
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


def _is_conversation(x: Any) -> bool:
    return isinstance(x, Sequence) and not isinstance(x, (str, bytes)) and len(x) > 0 and isinstance(x[0], Mapping)


def encode_prompts(
    tokenizer: Tokenizer | None, prompts: Any, chat: bool = False, chat_template_kwargs: Mapping[str, Any] | None = None,
) -> list[list[int]]:
    """Token ids of every prompt of :func:`generate`'s ``prompts`` argument.

    Args:
        tokenizer: Encodes texts and renders conversations.
        prompts: A text, token ids, a conversation (a list of ``{"role", "content"}`` messages), or a
            list of any of these.
        chat: Render plain texts as one user turn of the chat template.
        chat_template_kwargs: Template options, e.g. ``{"enable_thinking": False}`` for Qwen3.

    Raises:
        PromptError: No prompt, an empty one, a malformed message, or text without a tokenizer.
    """
    if isinstance(prompts, (str, bytes)) or _is_conversation(prompts) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]  # a single prompt
    if not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise PromptError("prompts is empty; pass at least one prompt.")
    options = dict(chat_template_kwargs or {})
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str) or _is_conversation(p):
            if tokenizer is None:
                raise PromptError("text prompts and conversations need a tokenizer; pass tokenizer= or token ids.")
            if isinstance(p, str) and not p:
                raise PromptError(f"prompt {i} is an empty string; every prompt needs at least one token.")
            if _is_conversation(p):
                for m in p:
                    if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                        raise PromptError(f"prompt {i}: every message needs a string 'role' and 'content', got {dict(m)!r}.")
                text = tokenizer.apply_chat_template([dict(m) for m in p], **options)
            else:
                text = tokenizer.apply_chat_template([{"role": "user", "content": p}], **options) if chat else p
            ids = tokenizer.encode_prompt(text)
        else:
            try:
                ids = [_token_id(t) for t in p]
            except (TypeError, ValueError) as err:
                raise PromptError(f"prompt {i} must be a text, a conversation or token ids: {err}") from None
        if not ids:
            raise PromptError(f"prompt {i} encodes to no tokens; every prompt needs at least one token.")
        out.append(ids)
    return out


def _token_id(t: Any) -> int:
    if isinstance(t, bool) or not isinstance(t, (int, torch.Tensor)) or (isinstance(t, torch.Tensor) and t.numel() != 1):
        raise TypeError(f"{t!r} is not a token id (an int)")
    return int(t)


def resolve_policy(policy: EvictionPolicy | None) -> EvictionPolicy:
    """A policy object from ``generate``'s ``policy`` argument: a policy object, or None (FullKV).

    Raises:
        beaconkv.policies.PolicyConfigError: ``policy`` is anything else; a registry name is refused
            with the call that builds it (names go through :func:`~beaconkv.policies.make_policy`).
    """
    if policy is None:
        return FullKV()
    if isinstance(policy, str):
        raise PolicyConfigError(
            f"policy={policy!r} is a name; build the policy first: "
            f"policy=beaconkv.make_policy({policy!r}, budget=1024), or from its class, e.g. beaconkv.BeaconKV(budget=1024)."
        )
    if not isinstance(policy, EvictionPolicy):
        raise PolicyConfigError(f"policy={policy!r} must be an EvictionPolicy (e.g. beaconkv.BeaconKV(budget=1024)) "
                                "or None (keep everything).")
    return policy


def _check_count(name: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        example = f"e.g. {name}={max(minimum, int(value))}" if isinstance(value, float) and math.isfinite(value) \
            else f"e.g. {name}={max(minimum, 256)}"
        raise ValueError(f"{name}={value!r} must be an int >= {minimum}, not {type(value).__name__}; "
                         f"pass a whole number ({example}).")
    if value < minimum:
        raise ValueError(f"{name}={value} must be an int >= {minimum}.")


def generate(
    model: CausalLM,
    tokenizer: Tokenizer | None,
    prompts: Sequence[str] | Sequence[Sequence[int]] | str | Conversation | Sequence[Conversation],
    *,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    policy: EvictionPolicy | None = None,
    stream: StreamCallback | None = None,
    chat: bool = False,
    eos_token_ids: Sequence[int] | None = None,
    stop: Sequence[str] | str | None = None,
    cache_dtype: torch.dtype | None = None,
    compile: bool | CompileConfig = False,
    capacity_tokens: int | None = None,
    kv_storage: str | type[KVStorage] = "dense",
    on_step: Callable[[int, Session], None] | None = None,
    max_batch: int | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    kernels: str = "auto",
    prefill_chunk: int | None = None,
    tensor_parallel_size: int = 1,
    setup: DecodeSetup | None = None,
) -> GenerationOutput:
    """Generates continuations for a batch of prompts.

    Args:
        model: A loaded :class:`~beaconkv.models.CausalLM`.
        tokenizer: Encodes text prompts and decodes outputs (None: prompts must be ids; no texts).
        prompts: Texts (tokenized as-is, BOS added when the tokenizer adds one), lists of ids, chat
            conversations (``[{"role": "system" | "user" | "assistant", "content": ...}, ...]``, rendered
            with the chat template), or one of these alone.
        max_new_tokens: Most new tokens per sequence.
        temperature: 0 = greedy; else softmax temperature.
        top_p: Nucleus sampling mass.
        top_k: Keep only the k most likely tokens (0 = off).
        seed: Seeds the sampling: prompt ``i`` draws from its own generator seeded ``seed + i``, so its
            tokens do not depend on the other prompts (None: seeds 0, 1, ...).
        policy: KV-cache eviction policy, from its class (``beaconkv.BeaconKV(budget=1024)``) or its
            registry name (``beaconkv.make_policy("beacon", budget=1024)``); None keeps everything
            (:class:`~beaconkv.policies.FullKV`). A policy object holds settings only: one may serve
            any number of calls.
        stream: Called as ``stream(i, token_id, text_delta)`` for each new token of sequence ``i``;
            the text is detokenised incrementally.
        chat: Wrap text prompts in the tokenizer's chat template as a single user turn.
        eos_token_ids: Stop ids (default: the tokenizer's).
        stop: Strings that end a sequence; its text ends before the first one.
        cache_dtype: Dtype the KV cache stores keys and values in (default: the model's); attention
            casts them to the model's dtype.
        compile: Run the decode step (all layers, cache write, attention, sampling) and the policy's
            device work as ``torch.compile(fullgraph=True)`` graphs — CUDA graphs on CUDA, inductor on
            CPU; a :class:`~beaconkv.execution.CompileConfig` tunes it. The first call compiles (a
            minute or two for a 30-layer model on a CPU); later calls reuse the graphs. Greedy tokens
            are the same as eager.
        capacity_tokens: New tokens the cache is sized for (default ``max_new_tokens``): a larger value
            allocates the cache a longer generation needs while decoding only ``max_new_tokens``
            (benchmarks measure a long generation's memory and step time this way).
        kv_storage: How the cache holds keys and values: ``"dense"`` (default) or ``"int8"`` (per-token,
            per-KV-head scales; see :mod:`beaconkv.storage`), or a :class:`~beaconkv.storage.KVStorage` class.
        on_step: Called as ``on_step(step, session)`` after every decode step, once the policy's work
            (evictions included) is done — a public hook for measurement (see
            :class:`beaconkv.measure.speed.timing.StepRecorder`).
        max_batch: Sequences decoded at once (default: all prompts). With more prompts, a finished
            sequence's slot is taken by the next prompt (continuous batching).
        kernels: Matmul kernels: ``"auto"`` (default; when 4+ sequences decode together on a CPU
            without native bfloat16, the bf16 weights with fp32 arithmetic for a bf16 model, else
            oneDNN-prepacked fp32 linears; see :func:`~beaconkv.kernels.choice.choose_kernels`),
            ``"model"``, ``"packed"`` or ``"bf16w"``.
        chat_template_kwargs: Options of the chat template, e.g. ``{"enable_thinking": False}`` for Qwen3.
        prefill_chunk: Prefill prompts longer than this in chunks of this many tokens, the policy evicting
            between chunks: the cache then holds at most ``n_prefix + budget + prefill_chunk`` slots per KV
            head (``stats.cache_capacity``) instead of the whole prompt, when the policy's ``n_prefix`` is an
            int (with the whole prompt protected, every prompt token stays). None (default): whole prompts,
            as before.
        tensor_parallel_size: Split the model over this many processes (tensor parallelism, see
            :mod:`beaconkv.distributed`): this process becomes rank 0 and spawns the others; each rank loads
            its shard of ``model``'s checkpoint (``model.checkpoint_dir``, as :func:`~beaconkv.models.load_model`
            sets it; for a model too large for one device, start from
            :class:`beaconkv.distributed.TensorParallelRun` instead, which never loads the whole model).
            ``model`` may also be rank 0's shard of a running group (then leave this at 1); the shard of a
            :class:`~beaconkv.distributed.launch.TensorParallelRun` runs under the run's
            :meth:`~beaconkv.distributed.launch.TensorParallelRun.guard`.

        setup: The runtime options (``kv_storage``, ``cache_dtype``, ``kernels``, ``compile``,
            ``prefill_chunk``, ``threads``) as one :class:`~beaconkv.decode_setup.DecodeSetup`, instead of
            those keywords (not with them).

    Returns:
        The new tokens, texts, finish reasons and stats.

    Raises:
        PromptError: Empty or malformed prompt, or a prompt longer than the model's maximum positions.
        ValueError: Bad sampling parameters, a non-int or non-positive ``max_new_tokens``/``max_batch``/
            ``prefill_chunk``,
            ``capacity_tokens < max_new_tokens``, or a token id outside the vocabulary.
        beaconkv.policies.PolicyConfigError: ``policy`` is not a policy object (a name must go through
            :func:`~beaconkv.policies.make_policy`).
        beaconkv.CompileError: ``compile`` was asked for and ``torch.compile`` is unavailable or
            failed (there is no silent fallback to eager).
        beaconkv.distributed.TensorParallelError: With ``tensor_parallel_size > 1`` or a
            :class:`~beaconkv.distributed.launch.TensorParallelRun`'s shard: a rank that failed or died (named),
            or a model tensor parallelism cannot run (a shard with a size, no checkpoint directory, a size the
            model cannot be split by).
    """
    with _rank_guard(model):  # rank 0 of a TensorParallelRun: a rank that fails or dies -> one error naming it
        setup = DecodeSetup.of(setup, kv_storage=kv_storage, cache_dtype=cache_dtype, kernels=kernels, compile=compile,
                               prefill_chunk=prefill_chunk)
        kv_storage, cache_dtype, kernels, compile, prefill_chunk = (setup.kv_storage, setup.cache_dtype, setup.kernels,
                                                                    setup.compile, setup.prefill_chunk)
        setup.apply_threads()
        if tensor_parallel_size != 1:  # spawn the ranks, run this call on rank 0 (here), stop them
            return _generate_tensor_parallel(
                model, tokenizer, prompts, tensor_parallel_size, max_new_tokens=max_new_tokens,
                temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, policy=policy, stream=stream, chat=chat,
                eos_token_ids=eos_token_ids, stop=stop, cache_dtype=cache_dtype, compile=compile,
                capacity_tokens=capacity_tokens, kv_storage=kv_storage, on_step=on_step, max_batch=max_batch,
                chat_template_kwargs=chat_template_kwargs, kernels=kernels, prefill_chunk=prefill_chunk)
        t_start = time.perf_counter()
        _check_count("max_new_tokens", max_new_tokens)
        params = SamplingParams(temperature, top_p, top_k)
        policy = resolve_policy(policy)
        ids = encode_prompts(tokenizer, prompts, chat, chat_template_kwargs)
        if max_batch is not None:
            _check_count("max_batch", max_batch)
        if capacity_tokens is not None:
            _check_count("capacity_tokens", capacity_tokens)
            if capacity_tokens < max_new_tokens:
                raise ValueError(f"capacity_tokens={capacity_tokens} must be >= max_new_tokens={max_new_tokens}.")
        lengths = [len(p) for p in ids]
        limit = model.config.max_position_embeddings
        too_long = [(i, n) for i, n in enumerate(lengths) if n >= limit]
        if too_long:
            i, n = too_long[0]
            raise PromptError(f"prompt {i} has {n} tokens, more than the model's max_position_embeddings={limit} "
                              "leaves room for; shorten it.")
        room = limit - max(lengths)
        if max_new_tokens > room:
            warnings.warn(f"max_new_tokens={max_new_tokens} capped to {room} by max_position_embeddings.", stacklevel=2)
            max_new_tokens = room
        capacity = min(capacity_tokens or max_new_tokens, room)
        stop_strings = [stop] if isinstance(stop, str) else list(stop or [])
        make_engine = Engine
        if getattr(model, "tensor_parallel", None) is not None:  # rank 0 of a tensor-parallel shard: ranks mirror it
            from .distributed.mirror import MirroredEngine as make_engine
        try:
            engine = make_engine(
                model, tokenizer, policy=policy, max_batch=min(max_batch or len(ids), len(ids)),
                prompt_capacity=max(lengths), max_new_tokens=capacity, kv_storage=kv_storage, cache_dtype=cache_dtype,
                compile=compile, seed=0 if seed is None else seed, on_step=on_step, kernels=kernels,
                prefill_chunk=prefill_chunk,
            )
            eos = list(eos_token_ids) if eos_token_ids is not None else None
            requests = [Request(p, max_new_tokens, params, eos_token_ids=eos, stop=stop_strings,
                                on_event=_streaming(stream, i)) for i, p in enumerate(ids)]
            with torch.inference_mode():
                done = engine.run(requests)
        except EngineError as err:
            raise PromptError(str(err)) from None
        failed = next((c for c in done if c.finish_reason == "error"), None)
        if failed is not None:  # a library call fails loudly (the engine isolates a failing request for servers)
            if failed.exception is not None:
                raise failed.exception
            raise RuntimeError(failed.error)
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
        st = engine.session.state
        executors = {id(e): e for e in (engine.session.decoder, st.executor)}.values()  # one object when shared
        stats = GenerationStats(
            prompt_tokens=lengths, new_tokens=[len(c.token_ids) for c in done], cache_capacity=engine.slot_capacity,
            cache_bytes=engine.cache_bytes, evictions=[c.evictions for c in done], peak_cache_tokens=st.peak_tokens,
            prefill_s=engine.stats.prefill_s, wall_time_s=time.perf_counter() - t_start,
            decode_steps=engine.stats.steps, eviction_s=st.stats.eviction_seconds, policy_s=engine.session.policy_s,
            compiled=engine.session.compiled,
            compiled_evictions=st.stats.eviction_calls if st.executor.compiled else 0, max_batch=engine.max_batch,
            kernels=engine.prepared.kernels, compile_s=sum(e.compile_s for e in executors),
        )
        texts = [c.text for c in done] if tokenizer is not None else [""] * len(done)
        reasons = [c.finish_reason for c in done]
        return GenerationOutput([c.token_ids for c in done], texts, reasons, ids, stats, policy, st)


def _streaming(stream: StreamCallback | None, index: int) -> Callable[[Event], None] | None:
    if stream is None:
        return None

    def on_event(ev: Event) -> None:
        if ev.token_id is not None:
            stream(index, ev.token_id, ev.text)

    return on_event


def _rank_guard(model: CausalLM) -> contextlib.AbstractContextManager[None]:
    """The guard of the :class:`~beaconkv.distributed.launch.TensorParallelRun` whose rank-0 shard ``model`` is
    (``model.tensor_parallel_guard``: a failure while generating becomes one
    :class:`~beaconkv.distributed.group.TensorParallelError` naming the rank that failed or died), else nothing."""
    guard = getattr(model, "tensor_parallel_guard", None)
    return guard("generating") if guard is not None else contextlib.nullcontext()


def _generate_tensor_parallel(model: CausalLM, tokenizer: Tokenizer | None, prompts: Any, tensor_parallel_size: int,
                              **kwargs: Any) -> GenerationOutput:
    """:func:`generate` with ``tensor_parallel_size`` ranks: a :class:`~beaconkv.distributed.launch.TensorParallelRun`
    from the model's checkpoint, with this process as rank 0, for one call.

    Args:
        model: A model :func:`~beaconkv.models.load_model` loaded (its ``checkpoint_dir``, dtype and device
            say what each rank loads).
        tokenizer: The tokenizer.
        prompts: The prompts.
        tensor_parallel_size: Ranks.
        **kwargs: :func:`generate`'s keyword arguments.

    Raises:
        TensorParallelError: A model without a checkpoint directory, a rank shard passed with a size, or the
            run's own errors.
    """
    # late on purpose: only a call with tensor_parallel_size > 1 spawns processes (the launcher imports no generation)
    from .distributed.group import TensorParallelError
    from .distributed.launch import TensorParallelRun

    if getattr(model, "tensor_parallel", None) is not None:
        raise TensorParallelError("this model is already a tensor-parallel shard; call generate on it with "
                                  "tensor_parallel_size=1 (its group is running).")
    directory = getattr(model, "checkpoint_dir", None)
    if directory is None:
        raise TensorParallelError("tensor_parallel_size needs the model's checkpoint (each rank loads its shard from "
                                  "it): load the model with beaconkv.load_model(path), or start "
                                  "beaconkv.distributed.TensorParallelRun(path, size) yourself.")
    with TensorParallelRun(directory, tensor_parallel_size, dtype=model.dtype, device=model.device) as run:
        return generate(run.model, tokenizer, prompts, **kwargs)
