"""Teacher-forced fidelity of compressed KV caches against FullKV on long reasoning traces.

One token stream (a reasoning trace: prompt rendered with the chat template, then the model output
forced token by token) goes through the *real* decode path — :class:`~beaconkv.cache.KVCache`,
:meth:`~beaconkv.models.CausalLM.decode_step`'s layers and every policy's lifecycle hooks, exactly
as :func:`beaconkv.generate` drives them — once with FullKV (the reference) and once per policy
and budget, all in lock-step. At every decode step we compare, per policy and budget:

* the next-token distributions: ``KL(full ‖ compressed)`` and top-1 agreement;
* attention recall: the share of the *reference* query's attention mass (captured through the
  FullKV cache's ``attention_hook``) that falls on positions the compressed cache still holds at
  that step (read from its ``pos`` buffer before the policy's post-step eviction). Each query —
  one (step, layer, query head) — is *global* when the mean distance ``t - position`` over its
  top-K attended keys exceeds a threshold (SPEC §1: K = 150, threshold 200), else *local*; recall
  is reported for both classes, pooled over steps, layers, heads and traces.

Speed: the runs share one prefill (the prompt's K/V and queries are fanned out to every cache;
each policy's prefill hook sees them) and, by default, one batched pass through the dense parts
of each decode step (norms, MLPs, LM head over ``runs x traces`` rows) while every run's
attention module reads and writes its own cache. ``stack=False`` calls ``model.decode_step`` per
run instead; a test checks both give the same logits.

Command line: ``beaconkv fidelity`` (:func:`add_fidelity_arguments`, :func:`run_fidelity`) or
``python -m beaconkv.measure.fidelity``. Outputs a CSV, a markdown table and PNG plots.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..cache import KVCache, LayerKVCache
from ..models.decoder import CausalLM
from ..policies.base import EvictionPolicy, FullKV, PolicyConfigError
from ..policies.registry import make_policy, policy_names
from ..tokenizer import Tokenizer

#: Repository root (``beaconkv/measure/fidelity.py`` -> ``<repo>``).
REPO_ROOT = Path(__file__).resolve().parents[2]
#: Shared data directory next to the repository: ``<repo>/../shared/data``.
DEFAULT_DATA_DIR = REPO_ROOT.parent / "shared" / "data"
#: Default trace location (a directory of JSONL files, or one file).
DEFAULT_TRACES = DEFAULT_DATA_DIR / "traces"
#: Budgets of the standard run.
DEFAULT_BUDGETS = (64, 128, 256, 512)
#: Display order of the built-in policies (others follow alphabetically).
POLICY_ORDER = ("beacon", "initial_recent", "snapkv", "rpc", "rkv", "h2o", "streaming")
#: Metric column -> human label, for tables and plots.
METRICS = {
    "kl": "KL(full ‖ policy), nats/token",
    "top1": "top-1 agreement with FullKV",
    "recall_global": "attention recall, global queries",
    "recall_local": "attention recall, local queries",
}


class FidelityError(ValueError):
    """Bad fidelity/analysis settings or inputs (trace too short, unknown id, bad threshold...)."""


# ----------------------------------------------------------------------------------- traces
@dataclass
class Trace:
    """One teacher-forced token stream.

    Attributes:
        name: Identifier (the JSONL ``id``, or ``"generated-<i>"``).
        prompt_ids: The prompt, rendered with the chat template and tokenized.
        output_ids: The assistant text that is forced token by token.
    """

    name: str
    prompt_ids: list[int]
    output_ids: list[int]


def default_traces_path() -> Path:
    """``<repo>/../shared/data/traces``: where the real reasoning traces live."""
    return DEFAULT_TRACES


def read_trace_records(path: str | Path) -> list[dict[str, Any]]:
    """Reads trace records from a JSONL file or every ``*.jsonl`` file of a directory (sorted).

    Args:
        path: A ``.jsonl`` file or a directory.

    Returns:
        The records, each a dict with at least ``problem`` (str) and, for forcing, ``output`` (str).

    Raises:
        FidelityError: The path does not exist, holds no JSONL, or a line is not a JSON object
            with a string ``problem``.
    """
    p = Path(path)
    if not p.exists():
        raise FidelityError(f"traces path {p} does not exist; pass --traces FILE.jsonl or a directory of them.")
    files = sorted(p.glob("*.jsonl")) if p.is_dir() else [p]
    if not files:
        raise FidelityError(f"no *.jsonl file in {p}; pass --traces FILE.jsonl.")
    records = []
    for f in files:
        for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as err:
                raise FidelityError(f"{f}:{n} is not valid JSON ({err}).") from err
            if not isinstance(rec, dict) or not isinstance(rec.get("problem"), str):
                raise FidelityError(f"{f}:{n} needs a JSON object with a string 'problem' field.")
            rec.setdefault("id", f"{f.stem}:{n}")
            records.append(rec)
    return records


def select_records(
    records: list[dict[str, Any]], ids: Sequence[str] | None = None, limit: int | None = None
) -> list[dict[str, Any]]:
    """Picks records by id (in the given order) or the first ``limit``.

    Raises:
        FidelityError: An id is unknown, or ``limit < 1``.
    """
    if ids:
        by_id = {str(r["id"]): r for r in records}
        missing = [i for i in ids if str(i) not in by_id]
        if missing:
            raise FidelityError(f"trace id(s) {missing} not found; available: {', '.join(by_id)}.")
        return [by_id[str(i)] for i in ids]
    if limit is not None:
        if limit < 1:
            raise FidelityError(f"--num-traces={limit} must be >= 1.")
        return records[:limit]
    return records


def trace_from_record(record: dict[str, Any], tokenizer: Tokenizer, chat: bool = True) -> Trace:
    """Renders one record: the problem as the user turn of the chat template, the output as assistant text.

    Raises:
        FidelityError: The record has no string ``output``.
    """
    if not isinstance(record.get("output"), str) or not record["output"]:
        raise FidelityError(f"trace {record.get('id')!r} has no 'output' text to force; use --generate instead.")
    prompt = tokenizer.chat_prompt(record["problem"]) if chat else record["problem"]
    return Trace(str(record["id"]), tokenizer.encode_prompt(prompt), tokenizer.encode(record["output"]))


def load_traces(
    path: str | Path,
    tokenizer: Tokenizer,
    ids: Sequence[str] | None = None,
    limit: int | None = None,
    chat: bool = True,
) -> list[Trace]:
    """Loads and tokenizes reasoning traces (``problem`` + ``output``) from JSONL.

    Args:
        path: A JSONL file or a directory of them (see :func:`read_trace_records`).
        tokenizer: The model's tokenizer (its chat template renders the problem).
        ids: Record ids to take, in order (default: the first ``limit``).
        limit: How many records to take when ``ids`` is not given.
        chat: Render the problem through the chat template (False: raw text).

    Returns:
        The traces.
    """
    return [trace_from_record(r, tokenizer, chat) for r in select_records(read_trace_records(path), ids, limit)]


def generate_traces(
    model: CausalLM,
    tokenizer: Tokenizer,
    problems: Sequence[str],
    n_tokens: int,
    temperature: float = 0.6,
    top_p: float = 0.95,
    seed: int = 0,
) -> list[Trace]:
    """Lets the model write its own traces (FullKV, end-of-sequence ignored) to force afterwards.

    Args:
        model: The model.
        tokenizer: Its tokenizer.
        problems: User turns.
        n_tokens: Tokens to generate per problem.
        temperature: Sampling temperature (0 = greedy; small models loop when greedy).
        top_p: Nucleus mass.
        seed: Sampling seed.

    Returns:
        One trace per problem, named ``generated-<i>``.
    """
    from ..generation import generate

    out = generate(
        model, tokenizer, [tokenizer.chat_prompt(p) for p in problems], max_new_tokens=n_tokens,
        temperature=temperature, top_p=top_p, seed=seed, eos_token_ids=[],
    )
    return [Trace(f"generated-{i}", p, t) for i, (p, t) in enumerate(zip(out.prompt_ids, out.token_ids))]


def forced_tokens(traces: Sequence[Trace], n_tokens: int) -> Tensor:
    """The ``(batch, n_tokens)`` decode inputs: the first ``n_tokens`` output tokens of each trace.

    Raises:
        FidelityError: ``n_tokens < 1`` or a trace is shorter (the message names it and its length).
    """
    if n_tokens < 1:
        raise FidelityError(f"tokens={n_tokens} must be >= 1.")
    short = [(t.name, len(t.output_ids)) for t in traces if len(t.output_ids) < n_tokens]
    if short:
        name, n = short[0]
        raise FidelityError(f"trace {name!r} has only {n} output tokens < --tokens={n_tokens}; lower --tokens.")
    return torch.tensor([t.output_ids[:n_tokens] for t in traces], dtype=torch.long)


# ----------------------------------------------------------------------------------- metrics
@dataclass(frozen=True)
class GlobalQueryRule:
    """SPEC §1: a query is *global* when the mean distance to its top-K attended keys exceeds a threshold.

    Attributes:
        top_k: K, attended keys averaged over (150 in the paper; fewer when fewer keys exist).
        threshold: Mean distance (tokens) above which a query is global (200 in the paper).
    """

    top_k: int = 150
    threshold: float = 200.0

    def __post_init__(self) -> None:
        if self.top_k < 1:
            raise FidelityError(f"top_k={self.top_k} must be >= 1 (paper: 150).")
        if not self.threshold >= 0:
            raise FidelityError(f"global threshold={self.threshold} must be >= 0 (paper: 200).")

    def distance(self, weights: Tensor, key_pos: Tensor, query_pos: Tensor) -> Tensor:
        """Mean attention distance of each query (see :func:`attention_distance`)."""
        return attention_distance(weights, key_pos, query_pos, self.top_k)

    def is_global(self, weights: Tensor, key_pos: Tensor, query_pos: Tensor) -> Tensor:
        """Bool mask of global queries, shaped like ``weights.shape[:-1]``."""
        return self.distance(weights, key_pos, query_pos) > self.threshold


def kl_divergence(ref_logits: Tensor, logits: Tensor) -> Tensor:
    """``KL(softmax(ref) ‖ softmax(logits))`` per row, in nats.

    Args:
        ref_logits: ``(..., vocab)`` reference (FullKV) logits.
        logits: ``(..., vocab)`` compared logits.

    Returns:
        ``(...)`` float32, >= 0 (up to rounding).
    """
    ref = ref_logits.float().log_softmax(-1)
    other = logits.float().log_softmax(-1)
    return (ref.exp() * (ref - other)).sum(-1)


def held_attention_mass(weights: Tensor, key_pos: Tensor, held_pos: Tensor) -> Tensor:
    """Share of each query's attention mass that lies on positions another cache still holds.

    Args:
        weights: ``(..., group, C)`` reference attention weights over the reference cache's slots.
        key_pos: ``(..., C)`` position of each reference slot (``-1`` empty; its weight is ignored).
        held_pos: ``(..., C')`` positions the compressed cache holds (``-1`` empty).

    Returns:
        ``(..., group)``: ``sum(weights over held positions)``; 1 when everything is held and the
        weights sum to 1.
    """
    size = int(max(int(key_pos.max()), int(held_pos.max()), 0)) + 2
    dump = size - 1  # empty slots scatter here, and it is cleared
    held = torch.zeros(*held_pos.shape[:-1], size, dtype=weights.dtype, device=weights.device)
    held.scatter_(-1, torch.where(held_pos >= 0, held_pos, dump), 1.0)
    held[..., dump] = 0
    on = torch.gather(held, -1, torch.where(key_pos >= 0, key_pos, dump))  # (..., C)
    return (weights * on.unsqueeze(-2)).sum(-1)


def attention_distance(weights: Tensor, key_pos: Tensor, query_pos: Tensor, top_k: int = 150) -> Tensor:
    """Mean ``query_pos - key_pos`` over each query's ``top_k`` most attended keys.

    Args:
        weights: ``(..., group, C)`` attention weights.
        key_pos: ``(..., C)`` slot positions (``-1`` empty; never counted).
        query_pos: Query positions, broadcastable to ``key_pos.shape[:-1]``.
        top_k: Keys averaged over (fewer if fewer filled slots exist).

    Returns:
        ``(..., group)`` float32 mean distances (0 for a query with no key).
    """
    k = min(top_k, weights.shape[-1])
    masked = weights.float().masked_fill((key_pos < 0).unsqueeze(-2), -1.0)  # empties rank last
    _, idx = masked.topk(k, dim=-1)  # (..., group, k)
    kp = torch.gather(key_pos.unsqueeze(-2).expand(*weights.shape), -1, idx)
    ok = kp >= 0
    dist = (query_pos.unsqueeze(-1).unsqueeze(-1) - kp).float().masked_fill(~ok, 0.0)
    return dist.sum(-1) / ok.sum(-1).clamp(min=1)


# ------------------------------------------------------------------------------- lock-step
class _FanOutLayer:
    """Stands in for one layer's cache during the shared prefill: every run's layer gets the writes."""

    def __init__(self, layers: list[LayerKVCache]) -> None:
        self.layers = layers

    def write_prefill(self, k: Tensor, v: Tensor, q_pre: Tensor, positions: Tensor, valid: Tensor) -> None:
        for layer in self.layers:
            layer.write_prefill(k, v, q_pre, positions, valid)


class _FanOutCache:
    """Stands in for a :class:`KVCache` during the shared prefill (``cache[i]`` fans out layer ``i``)."""

    def __init__(self, caches: list[KVCache]) -> None:
        self.caches = caches

    def __getitem__(self, i: int) -> _FanOutLayer:
        return _FanOutLayer([c[i] for c in self.caches])

    def __len__(self) -> int:
        return len(self.caches[0])


@dataclass
class StepOutput:
    """What one lock-step decode step produced.

    Attributes:
        logits: ``(runs, batch, vocab)`` float32; run 0 is the FullKV reference.
        weights: ``(layers, batch, kv_heads, group, C)`` the reference's decode attention weights.
        key_pos: ``(layers, batch, kv_heads, C)`` positions of the reference's slots.
        held_pos: Per compressed run, ``(layers, batch, kv_heads, C_run)`` the positions its
            attention saw at this step (before its post-step eviction).
        query_pos: ``(batch,)`` position of the decoded token.
    """

    logits: Tensor
    weights: Tensor
    key_pos: Tensor
    held_pos: list[Tensor]
    query_pos: Tensor


class LockStep:
    """Teacher-forces one batch of token streams through a FullKV cache and several policy caches at once.

    Every run owns a :class:`~beaconkv.cache.KVCache` sized and bound exactly as
    :func:`beaconkv.generate` does (``policy.capacity`` -> ``KVCache.allocate`` -> ``policy.start``),
    and after every step each policy's ``after_decode_step`` runs (its evictions included).

    Args:
        model: The model (eval mode).
        policies: Compressed runs (fresh policy objects, one per run).
        prompts: Prompt token ids per sequence (ragged).
        max_new_tokens: Decode steps the caches must hold (sizes FullKV).
        stack: Share the dense layers of all runs in one batched pass (fast); False calls
            ``model.decode_step`` once per run (the literal generation call).
        reference_query_window: Pre-RoPE query ring length of the reference cache (analysis: keep
            every query by passing at least the reference capacity); 0 = none.
        cache_dtype: KV dtype (default: the model's).
    """

    def __init__(
        self,
        model: CausalLM,
        policies: Sequence[EvictionPolicy],
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        stack: bool = True,
        reference_query_window: int = 0,
        cache_dtype: torch.dtype | None = None,
    ) -> None:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise FidelityError("every prompt needs at least one token.")
        cfg = model.config
        self.model, self.stack = model, stack
        self.lengths = [len(p) for p in prompts]
        if max(self.lengths) + max_new_tokens > cfg.max_position_embeddings:
            raise FidelityError(
                f"prompt {max(self.lengths)} + {max_new_tokens} tokens exceeds max_position_embeddings="
                f"{cfg.max_position_embeddings}; lower --tokens."
            )
        self.reference = FullKV()
        self.policies: list[EvictionPolicy] = [self.reference, *policies]
        device = model.lm_head.weight.device
        dtype = cache_dtype or model.lm_head.weight.dtype
        B = len(prompts)
        self.caches: list[KVCache] = []
        for i, policy in enumerate(self.policies):
            ref = i == 0
            window = max(policy.query_window, reference_query_window if ref else 0)
            cache = KVCache.allocate(
                cfg.num_hidden_layers, B, cfg.num_key_value_heads, cfg.num_attention_heads,
                policy.capacity(self.lengths, max_new_tokens), cfg.head_dim, dtype=dtype, device=device,
                query_window=window, track_attention=policy.track_attention or ref,
            )
            policy.start(cache, model.rope, self.lengths)
            self.caches.append(cache)
        self._captured: list[Tensor | None] = [None] * cfg.num_hidden_layers
        for i, layer in enumerate(self.caches[0].layers):
            layer.attention_hook = self._capture_hook(i)
        L = max(self.lengths)
        self.input_ids = torch.zeros(B, L, dtype=torch.long, device=device)
        for b, p in enumerate(prompts):
            self.input_ids[b, : len(p)] = torch.tensor(list(p), dtype=torch.long)
        self.valid = torch.arange(L, device=device)[None] < torch.tensor(self.lengths, device=device)[:, None]
        self.positions = torch.tensor(self.lengths, device=device)
        self.device = device

    def _capture_hook(self, i: int):
        def hook(weights: Tensor) -> None:
            self._captured[i] = weights  # (batch, kv_heads, group, capacity)

        return hook

    @property
    def reference_cache(self) -> KVCache:
        """The FullKV cache."""
        return self.caches[0]

    @torch.inference_mode()
    def prefill(self) -> Tensor:
        """Writes the prompts into every cache and runs each policy's ``after_prefill``.

        Returns:
            ``(runs, batch, vocab)`` logits of the last prompt token (identical across runs).
        """
        if self.stack:
            logits = self.model.prefill(self.input_ids, self.valid, _FanOutCache(self.caches))  # type: ignore[arg-type]
            logits = logits.expand(len(self.caches), -1, -1)
        else:
            logits = torch.stack([self.model.prefill(self.input_ids, self.valid, c) for c in self.caches])
        for policy in self.policies:
            policy.after_prefill()
        return logits

    @torch.inference_mode()
    def step(self, tokens: Tensor) -> StepOutput:
        """Decodes one forced token per sequence in every run, then lets every policy evict.

        Args:
            tokens: ``(batch,)`` the forced tokens (their positions follow the prompts).

        Returns:
            The logits of every run and what the recall needs (see :class:`StepOutput`).
        """
        tokens = tokens.to(self.device)
        positions = self.positions
        if self.stack:
            logits = self._decode_stacked(tokens, positions)
        else:
            logits = torch.stack([self.model.decode_step(tokens, positions, c) for c in self.caches])
        weights = torch.stack(self._captured)  # type: ignore[arg-type]  # (layers, batch, kv_heads, group, C)
        key_pos = torch.stack([layer.pos for layer in self.caches[0].layers])
        held = [torch.stack([layer.pos for layer in c.layers]) for c in self.caches[1:]]
        for policy in self.policies:
            policy.after_decode_step()
        self.positions = positions + 1
        return StepOutput(logits, weights, key_pos, held, positions.clone())

    def _decode_stacked(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """``model.decode_step`` for every run at once: dense parts batched, attention per run's cache.

        Mirrors :class:`~beaconkv.models.decoder.DecoderModel` / ``DecoderLayer.forward`` (pre-norm:
        ``x + attn(norm(x))``, ``x + mlp(norm(x))``); the equivalence is tested against
        ``model.decode_step``.
        """
        decoder = self.model.model
        R, B = len(self.caches), tokens.shape[0]
        x = decoder.embed_tokens(tokens[:, None]).repeat(R, 1, 1)  # (runs * batch, 1, hidden)
        pos = positions[:, None].repeat(R, 1)  # (runs * batch, 1)
        for i, layer in enumerate(decoder.layers):
            x = x + self._attention_stacked(layer.self_attn, layer.input_layernorm(x), pos, i, B)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.lm_head(decoder.norm(x)[:, 0]).float().view(R, B, -1)

    def _attention_stacked(self, attn: Any, h: Tensor, pos: Tensor, i: int, B: int) -> Tensor:
        """Layer ``i``'s attention for all runs: projections batched, the cache part per run.

        Uses :class:`~beaconkv.models.attention.Attention`'s own ``_project`` / ``_decode`` (the
        decode branch of its ``forward``), so cache writes, masks and hooks are the generation's.
        An attention module without them is called once per run instead.
        """
        R = len(self.caches)
        if not (hasattr(attn, "_project") and hasattr(attn, "_decode")):
            outs = [attn(h[r * B : (r + 1) * B], pos[:B], None, c[i], True) for r, c in enumerate(self.caches)]
            return torch.cat(outs)
        q_pre, q, k, v = attn._project(h, pos)  # (runs * batch, heads, 1, head_dim)
        out = torch.cat([
            attn._decode(q[s], k[s], v[s], q_pre[s], pos[s, 0], c[i])
            for s, c in ((slice(r * B, (r + 1) * B), c) for r, c in enumerate(self.caches))
        ])  # (runs * batch, heads, 1, head_dim)
        return attn.o_proj(out.transpose(1, 2).reshape(R * B, 1, -1))


# ------------------------------------------------------------------------------ the study
@dataclass(frozen=True)
class PolicySpec:
    """One compressed run: a registry name, a budget and constructor arguments.

    Attributes:
        name: Registry name (``beacon``, ``snapkv``...).
        budget: ``B_max``.
        kwargs: Constructor arguments (``n_recent``, ``n_beacon``, ``n_prefix``...).
    """

    name: str
    budget: int
    kwargs: tuple[tuple[str, Any], ...] = ()

    def build(self) -> EvictionPolicy:
        """A fresh policy object.

        Raises:
            FidelityError: The registry rejects the settings (the message names them).
        """
        try:
            return make_policy(self.name, self.budget, **dict(self.kwargs))
        except PolicyConfigError as err:
            raise FidelityError(f"{self.name} at budget {self.budget} with {dict(self.kwargs)}: {err}") from err

    def get(self, key: str, default: Any = None) -> Any:
        """A constructor argument, or ``default``."""
        return dict(self.kwargs).get(key, default)


def auto_n_recent(budget: int, default: int = 16, ratio: float = 7 / 8) -> int:
    """``n_recent`` for a budget: ``default`` when the 7/8 cadence allows it, else ``budget // 8``.

    The base class needs ``budget - floor(ratio * budget) >= n_recent``; with the default 16 that
    means budget >= 128, so smaller budgets scale ``n_recent`` down (64 -> 8).
    """
    return default if budget - math.floor(ratio * budget) >= default else max(budget // 8, 1)


def policy_specs(
    policies: Iterable[str],
    budgets: Iterable[int],
    n_recent: int | None = None,
    n_beacon: int | None = None,
    n_prefix: int | None = None,
    extra: dict[str, dict[str, Any]] | None = None,
) -> list[PolicySpec]:
    """The policy x budget grid of a study, validated.

    Args:
        policies: Registry names (``full`` is the reference and is skipped).
        budgets: Budgets (``B_max``).
        n_recent: Recent tokens kept; None = :func:`auto_n_recent` per budget.
        n_beacon: Beacons of BeaconKV / Initial+Recent; None = ``n_recent`` (the paper's 16/16 split).
        n_prefix: Protected prefix; None = the whole prompt (SPEC default).
        extra: Per-policy extra constructor arguments.

    Returns:
        One spec per (policy, budget), in the given order.

    Raises:
        FidelityError: A budget < 1, an unknown policy, or settings the policy rejects.
    """
    out = []
    for name in policies:
        if name in ("full", "fullkv"):
            continue
        for budget in budgets:
            if budget < 1:
                raise FidelityError(f"budget={budget} must be >= 1.")
            nr = auto_n_recent(budget) if n_recent is None else n_recent
            kw: dict[str, Any] = {"n_recent": nr}
            if n_prefix is not None:
                kw["n_prefix"] = n_prefix
            try:
                cls_name = _policy_class_name(name)
            except PolicyConfigError as err:
                raise FidelityError(str(err)) from err
            if cls_name in ("BeaconKV", "InitialRecent"):
                kw["n_beacon"] = nr if n_beacon is None else n_beacon
            kw.update((extra or {}).get(name, {}))
            spec = PolicySpec(name, budget, tuple(sorted(kw.items())))
            spec.build()  # validate now, not after an hour
            out.append(spec)
    return out


def _policy_class_name(name: str) -> str:
    from ..policies.registry import policy_class

    return policy_class(name).__name__


@dataclass
class FidelityRow:
    """The measured figures of one policy at one budget, over one trace or all of them.

    Attributes:
        policy: Registry name.
        budget: ``B_max``.
        n_recent: Recent tokens kept.
        n_beacon: Beacons (BeaconKV-like policies), else None.
        trace: Trace name, or ``"all"``.
        steps: Decode steps compared (per trace, summed over traces for ``"all"``).
        kl: Mean ``KL(full ‖ policy)`` of the next-token distribution (nats).
        top1: Share of steps whose argmax equals FullKV's.
        recall: Mean attention recall over all queries.
        recall_global: Mean recall over global queries (NaN if none).
        recall_local: Mean recall over local queries.
        n_global: Global queries (steps x layers x query heads).
        n_queries: All queries.
        evictions: Evictions per trace (mean for ``"all"``).
    """

    policy: str
    budget: int
    n_recent: int
    n_beacon: int | None
    trace: str
    steps: int
    kl: float
    top1: float
    recall: float
    recall_global: float
    recall_local: float
    n_global: int
    n_queries: int
    evictions: float


@dataclass
class _Tally:
    """Per-trace running sums of one run's metrics (float64)."""

    batch: int
    kl: Tensor = field(init=False)
    top1: Tensor = field(init=False)
    mass: Tensor = field(init=False)
    mass_global: Tensor = field(init=False)
    n_global: Tensor = field(init=False)
    n_queries: Tensor = field(init=False)
    steps: int = 0

    def __post_init__(self) -> None:
        for name in ("kl", "top1", "mass", "mass_global", "n_global", "n_queries"):
            setattr(self, name, torch.zeros(self.batch, dtype=torch.float64))

    def add(self, kl: Tensor, agree: Tensor, mass: Tensor, is_global: Tensor) -> None:
        """Adds one step: ``kl``/``agree`` ``(batch,)``; ``mass``/``is_global`` ``(layers, batch, kv, group)``."""
        dims = (0, 2, 3)
        self.kl += kl.double()
        self.top1 += agree.double()
        self.mass += mass.double().sum(dims)
        self.mass_global += (mass.double() * is_global).sum(dims)
        self.n_global += is_global.double().sum(dims)
        self.n_queries += mass.numel() // self.batch  # layers x query heads per trace
        self.steps += 1

    def row(self, spec: PolicySpec, trace: str, b: slice, evictions: float) -> FidelityRow:
        """Summarises traces ``b`` into a :class:`FidelityRow`."""
        n_steps = self.steps * len(range(*b.indices(self.batch)))
        kl, top1 = float(self.kl[b].sum()), float(self.top1[b].sum())
        mass, mass_g = float(self.mass[b].sum()), float(self.mass_global[b].sum())
        n_g, n_q = float(self.n_global[b].sum()), float(self.n_queries[b].sum())
        n_l = n_q - n_g
        return FidelityRow(
            policy=spec.name, budget=spec.budget, n_recent=int(spec.get("n_recent", 16)),
            n_beacon=spec.get("n_beacon"), trace=trace, steps=n_steps,
            kl=kl / max(n_steps, 1), top1=top1 / max(n_steps, 1), recall=mass / max(n_q, 1),
            recall_global=mass_g / n_g if n_g else float("nan"),
            recall_local=(mass - mass_g) / n_l if n_l else float("nan"),
            n_global=int(n_g), n_queries=int(n_q), evictions=evictions,
        )


def measure_fidelity(
    model: CausalLM,
    traces: Sequence[Trace],
    specs: Sequence[PolicySpec],
    n_tokens: int,
    rule: GlobalQueryRule | None = None,
    stack: bool = True,
    progress: bool = True,
) -> list[FidelityRow]:
    """Runs the lock-step study and returns one row per (policy, budget) x (each trace, ``"all"``).

    Args:
        model: The model.
        traces: Token streams (batched together; each forces its first ``n_tokens`` output tokens).
        specs: Compressed runs (see :func:`policy_specs`).
        n_tokens: Decode steps per trace.
        rule: Global/local classification of queries (default: SPEC §1, K = 150, threshold 200).
        stack: Batch the dense layers of all runs (see :class:`LockStep`).
        progress: Show a tqdm progress bar.

    Returns:
        The rows, ``"all"`` rows first in spec order, then per-trace rows.

    Raises:
        FidelityError: No spec, no trace, or a trace shorter than ``n_tokens``.
    """
    from tqdm.auto import tqdm

    rule = rule or GlobalQueryRule()
    if not specs:
        raise FidelityError("no policy/budget to measure; pass --policies and --budgets.")
    if not traces:
        raise FidelityError("no trace to force; check --traces / --trace-ids / --num-traces.")
    tokens = forced_tokens(traces, n_tokens)
    policies = [s.build() for s in specs]
    run = LockStep(model, policies, [t.prompt_ids for t in traces], n_tokens, stack=stack)
    B = len(traces)
    tallies = [_Tally(B) for _ in specs]
    run.prefill()
    bar = tqdm(range(n_tokens), desc=f"fidelity ({len(specs)} runs x {B} traces)", unit="tok", disable=not progress)
    for s in bar:
        out = run.step(tokens[:, s])
        is_global = rule.is_global(out.weights, out.key_pos, out.query_pos.view(1, B, 1))
        ref = out.logits[0]
        ref_top = ref.argmax(-1)
        for r, tally in enumerate(tallies, start=1):
            mass = held_attention_mass(out.weights, out.key_pos, out.held_pos[r - 1])
            tally.add(kl_divergence(ref, out.logits[r]), out.logits[r].argmax(-1) == ref_top, mass, is_global)
        if progress and s % 32 == 0:
            bar.set_postfix(global_share=f"{float(is_global.float().mean()):.3f}")
    rows = []
    for spec, tally, policy in zip(specs, tallies, policies):
        ev = policy.stats.evictions
        rows.append(tally.row(spec, "all", slice(None), sum(ev) / len(ev)))
    for b, trace in enumerate(traces):
        for spec, tally, policy in zip(specs, tallies, policies):
            rows.append(tally.row(spec, trace.name, slice(b, b + 1), float(policy.stats.evictions[b])))
    return rows


# ------------------------------------------------------------------------------- reports
def _sort_key(policy: str) -> tuple[int, str]:
    return (POLICY_ORDER.index(policy) if policy in POLICY_ORDER else len(POLICY_ORDER), policy)


def write_csv(rows: Sequence[FidelityRow], path: str | Path) -> Path:
    """Writes every row (all fields) as CSV and returns the path."""
    path = Path(path)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(asdict(rows[0])))
        w.writeheader()
        for r in rows:
            w.writerow(asdict(r))
    return path


def _fmt(x: float, digits: int = 3) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def markdown_table(rows: Sequence[FidelityRow], trace: str = "all") -> str:
    """A markdown table of the rows of one trace (default: pooled over traces), policies x budgets.

    Columns: policy, budget, n_recent (and n_beacon), KL, top-1 agreement, recall (global, local, all).
    """
    sel = sorted((r for r in rows if r.trace == trace), key=lambda r: (_sort_key(r.policy), r.budget))
    lines = [
        ("| policy | budget | n_recent / n_beacon | KL(full ‖ policy) | top-1 agree | recall global | recall local "
         "| recall all |"),
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in sel:
        nb = f" / {r.n_beacon}" if r.n_beacon is not None else ""
        lines.append(
            f"| {r.policy} | {r.budget} | {r.n_recent}{nb} | {_fmt(r.kl, 4)} | {_fmt(r.top1)} | "
            f"{_fmt(r.recall_global)} | {_fmt(r.recall_local)} | {_fmt(r.recall)} |"
        )
    if sel:
        r = sel[0]
        lines.append("")
        lines.append(
            f"{r.steps} decode steps; {r.n_global} of {r.n_queries} queries "
            f"({100 * r.n_global / max(r.n_queries, 1):.2f}%) are global."
        )
    return "\n".join(lines)


def plot_fidelity(rows: Sequence[FidelityRow], out_dir: str | Path, prefix: str = "fidelity") -> list[Path]:
    """Plots each metric against the budget, one line per policy (pooled rows).

    Writes ``<prefix>.png`` (the four metrics in one figure) and ``<prefix>_<metric>.png`` each.

    Returns:
        The written paths, overview first.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    sel = [r for r in rows if r.trace == "all"]
    names = sorted({r.policy for r in sel}, key=_sort_key)
    budgets = sorted({r.budget for r in sel})

    def draw(ax, metric: str) -> None:
        for name in names:
            pts = sorted((r.budget, getattr(r, metric)) for r in sel if r.policy == name)
            style = {"lw": 2.5, "marker": "o"} if name == "beacon" else {"lw": 1.3, "marker": "."}
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=name, **style)
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.set_xlabel("budget (evictable tokens per KV head)")
        ax.set_title(METRICS[metric], fontsize=10)
        if metric == "kl":
            ax.set_yscale("log")
        ax.grid(alpha=0.3)

    paths = []
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, metric in zip(axes.flat, METRICS):
        draw(ax, metric)
    axes[0, 0].legend(fontsize=8)
    fig.tight_layout()
    paths.append(out_dir / f"{prefix}.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    for metric in METRICS:
        fig, ax = plt.subplots(figsize=(6, 4.2))
        draw(ax, metric)
        ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(out_dir / f"{prefix}_{metric}.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


# ----------------------------------------------------------------------------------- CLI
def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from err


def _str_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _int_or_auto(text: str) -> int | None:
    if text in ("auto", "prompt", "none"):
        return None
    try:
        return int(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {text!r}") from err


def add_trace_arguments(parser: argparse.ArgumentParser, num_traces: int, tokens: int) -> None:
    """Adds the model, trace-source and query-classification options shared by ``fidelity`` and ``analyze``.

    Args:
        parser: The parser.
        num_traces: Default ``--num-traces``.
        tokens: Default ``--tokens``.
    """
    g = parser.add_argument_group("model and traces")
    g.add_argument("--model", default=None, help="checkpoint directory or hub id (default / 'embedded': SmolLM2-135M)")
    g.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    g.add_argument("--traces", type=Path, default=None,
                   help=f"JSONL file (or directory of them) with problem + output fields (default: {DEFAULT_TRACES})")
    g.add_argument("--trace-ids", type=_str_list, default=None,
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
    q.add_argument("--top-k", type=int, default=150, help="attended keys averaged per query (paper 150)")
    q.add_argument("--global-threshold", type=float, default=200.0,
                   help="mean distance above which a query is global (paper 200; lower it for short traces)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def load_model_and_traces(args: argparse.Namespace) -> tuple[CausalLM, Tokenizer, list[Trace]]:
    """Loads the model and tokenizer named by ``args`` and the traces to force (see :func:`add_trace_arguments`).

    Raises:
        FidelityError: Bad trace selection or ``--tokens``.
    """
    import beaconkv

    if args.threads is not None:
        if args.threads < 1:
            raise FidelityError(f"--threads={args.threads} must be >= 1.")
        torch.set_num_threads(args.threads)
    if args.tokens < 1:
        raise FidelityError(f"--tokens={args.tokens} must be >= 1.")
    path = beaconkv.embedded_model_path() if args.model in (None, "embedded") else args.model
    model = beaconkv.load_model(path, dtype=args.dtype)
    tok = beaconkv.load_tokenizer(path)
    records = select_records(read_trace_records(args.traces or DEFAULT_TRACES), args.trace_ids, args.num_traces)
    if args.generate:
        traces = generate_traces(model, tok, [r["problem"] for r in records], args.tokens, args.temperature,
                                 args.top_p, args.seed)
    else:
        traces = [trace_from_record(r, tok, chat=not args.raw) for r in records]
    return model, tok, traces


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
    default_policies = [n for n in policy_names() if n != "full"]
    p.add_argument("--policies", type=_str_list, default=sorted(default_policies, key=_sort_key),
                   help="comma-separated registry names (default: all but full)")
    p.add_argument("--budgets", type=_int_list, default=list(DEFAULT_BUDGETS),
                   help="comma-separated budgets (default 64,128,256,512)")
    p.add_argument("--n-recent", type=_int_or_auto, default=None,
                   help="recent tokens kept; 'auto' (default) = 16, or budget // 8 where 16 is invalid")
    p.add_argument("--n-beacon", type=_int_or_auto, default=None,
                   help="beacons of beacon/initial_recent (default: = n_recent)")
    p.add_argument("--n-prefix", type=_int_or_auto, default=None,
                   help="protected prefix tokens (default 'prompt': the whole prompt)")
    o = parser.add_argument_group("output")
    o.add_argument("--out", type=Path, default=Path("results/fidelity"),
                   help="output directory (default results/fidelity)")
    o.add_argument("--exact", action="store_true",
                   help="call model.decode_step per run instead of batching the dense layers (slower; same result)")
    return parser


def run_fidelity(args: argparse.Namespace) -> int:
    """Runs ``beaconkv fidelity`` from parsed arguments: measures, writes CSV/markdown/PNGs, prints the table.

    Returns:
        The exit status (0 on success, 2 on bad settings).
    """
    t0 = time.perf_counter()
    try:
        rule = GlobalQueryRule(args.top_k, args.global_threshold)
        specs = policy_specs(args.policies, args.budgets, args.n_recent, args.n_beacon, args.n_prefix)
        model, _, traces = load_model_and_traces(args)
        forced_tokens(traces, args.tokens)
    except FidelityError as err:
        print(f"beaconkv fidelity: {err}", file=sys.stderr)
        return 2
    print(f"forcing {len(traces)} trace(s) ({', '.join(t.name for t in traces)}), {args.tokens} tokens each, "
          f"prompts {[len(t.prompt_ids) for t in traces]} tokens; {len(specs)} runs + FullKV", file=sys.stderr)
    rows = measure_fidelity(model, traces, specs, args.tokens, rule, stack=not args.exact,
                            progress=not args.no_progress)
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
        "global_threshold": rule.threshold, "n_prefix": args.n_prefix, "generated": bool(args.generate),
        "threads": torch.get_num_threads(), "wall_time_s": round(wall, 1),
    }
    (out / "run.json").write_text(json.dumps(settings, indent=2) + "\n")
    print(table)
    print(f"\nwrote {out / 'fidelity.csv'}, {out / 'fidelity.md'}, {len(plots)} plots in {out} "
          f"({wall / 60:.1f} min)", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m beaconkv.measure.fidelity``: the same as ``beaconkv fidelity``."""
    parser = add_fidelity_arguments(argparse.ArgumentParser(prog="beaconkv fidelity"))
    return run_fidelity(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
