"""Teacher-force one batch of token streams through FullKV and several policies at once, in lock-step.

Every run is a :class:`~beaconkv.session.Session` — the same cache allocation, policy state and
lifecycle as :func:`beaconkv.generate` — and all runs decode through the model's *public* path
(``model.prefill`` / ``model.decode_step``). With ``stack=True`` (default) they share one pass
through the dense layers: the runs' caches form a :class:`~beaconkv.measure.fidelity.cache_stack.CacheStack`, so
norms, projections, MLPs and the LM head run once over ``runs x traces`` rows while every run's
attention reads and writes its own cache. ``stack=False`` decodes each run on its own (the literal
generation call); a test checks both give the same logits.

On a CPU the shared pass runs with oneDNN-prepacked linear weights (:func:`~beaconkv.kernels.packed.prepack`):
its dozens of rows per step are exactly the small-M matrix products the BLAS handles worst.

The FullKV reference's decode attention (the recall's ground truth) is captured by an observer of each
of its layers (:class:`WeightCapture`, wrapping the reference's own observer: the attention ↔ observer
contract of :mod:`beaconkv.observation`), and each run's held positions are read from its cache before
the policy's post-step eviction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ...kernels.packed import packing_available, prepack
from ...models.decoder import CausalLM
from ...observation import LayerObserver
from ...policies.base import EvictionPolicy, FullKV
from ...session import Session, pad_prompts
from ...storage import KVStorage
from .cache_stack import CacheStack
from .errors import FidelityError


@dataclass
class StepOutput:
    """What one lock-step decode step produced.

    Attributes:
        logits: ``(runs, batch, vocab)`` float32; run 0 is the FullKV reference.
        weights: ``(layers, batch, kv_heads, group, C)`` the reference's decode attention weights
            over its filled slots (``C``: the longest sequence's length so far).
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


class WeightCapture:
    """An observer of one layer that keeps the decode step's attention weights, then hands the step on.

    Args:
        inner: The observer it wraps (the reference policy's, which keeps its query ring; None: none).
        sink: Where the weights go: ``sink[layer]`` is overwritten at every decode step.
        layer: The layer index.
    """

    needs_weights = True

    def __init__(self, inner: LayerObserver | None, sink: list[Tensor | None], layer: int) -> None:
        self.inner, self.sink, self.layer = inner, sink, layer

    def prefill(self, q_pre: Tensor, positions: Tensor, valid: Tensor) -> None:
        """Hands the prompt queries to the wrapped observer."""
        if self.inner is not None:
            self.inner.prefill(q_pre, positions, valid)

    def decode(self, q_pre: Tensor, positions: Tensor, weights: Tensor | None) -> None:
        """Keeps ``weights`` ``(batch, kv_heads, group, capacity)`` and hands the step on."""
        self.sink[self.layer] = weights
        if self.inner is not None:
            self.inner.decode(q_pre, positions, weights if self.inner.needs_weights else None)


class LockStep:
    """Teacher-forces one batch of token streams through a FullKV session and one session per policy.

    Args:
        model: The model (eval mode).
        policies: Compressed runs (policy objects; each gets its own session and state).
        prompts: Prompt token ids per sequence (ragged).
        max_new_tokens: Decode steps the caches must hold (sizes FullKV).
        stack: Share the dense layers of all runs in one batched pass (fast); False decodes each
            session on its own.
        reference_query_window: Pre-RoPE query ring length of the reference cache (analysis: keep
            every query by passing at least the reference capacity); 0 = none.
        cache_dtype: KV dtype of every run (default: the model's).
        kv_storage: Storage of the compressed runs' caches (the reference is always dense).
        packed: Run the model with oneDNN-prepacked linears on a CPU (the same kernels for every run;
            False, or no oneDNN, uses the model as it is).

    Attributes:
        sessions: The reference's session first, then one per policy.
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
        kv_storage: str | type[KVStorage] = "dense",
        packed: bool = True,
    ) -> None:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise FidelityError("every prompt needs at least one token.")
        cfg = model.config
        if packed and model.device.type == "cpu" and packing_available():
            model = prepack(model, batch_hint=(len(policies) + 1) * len(prompts), dtype=model.dtype)
        self.model, self.stack, self.prompts = model, stack, [list(p) for p in prompts]
        self.lengths = [len(p) for p in prompts]
        if max(self.lengths) + max_new_tokens > cfg.max_position_embeddings:
            raise FidelityError(
                f"prompt {max(self.lengths)} + {max_new_tokens} tokens exceeds max_position_embeddings="
                f"{cfg.max_position_embeddings}; lower --tokens."
            )
        # the kernels were chosen above (`packed`), once for every run: every session runs that model
        reference = Session.for_prompts(model, FullKV(), self.lengths, max_new_tokens, cache_dtype=cache_dtype,
                                        query_window=reference_query_window)
        self.sessions = [reference] + [
            Session.for_prompts(model, p, self.lengths, max_new_tokens, cache_dtype=cache_dtype, kv_storage=kv_storage)
            for p in policies
        ]
        self._captured: list[Tensor | None] = [None] * cfg.num_hidden_layers
        capture = [WeightCapture(o, self._captured, i) for i, o in enumerate(reference.state.observers)]
        self._observers = [capture] + [s.state.observers for s in self.sessions[1:]]
        self._stacked = CacheStack([s.cache for s in self.sessions], self._observers)
        self.device = reference.device

    @property
    def reference(self) -> Session:
        """The FullKV session."""
        return self.sessions[0]

    @property
    def policies(self) -> list[EvictionPolicy]:
        """The reference's policy (FullKV), then the compressed runs'."""
        return [s.policy for s in self.sessions]

    @torch.inference_mode()
    def prefill(self) -> Tensor:
        """Writes the prompts into every cache and lets each policy act on them.

        Returns:
            ``(runs, batch, vocab)`` logits of the last prompt token (identical across runs).
        """
        if not self.stack:
            return torch.stack([s.prefill(self.prompts) for s in self.sessions])
        rows = list(range(len(self.prompts)))
        for s in self.sessions:
            s.admit(rows, self.lengths)
        ids, valid = pad_prompts(self.prompts, self.device)
        logits = self.model.prefill(ids, valid, self._stacked, self._stacked)  # the prompt runs once for every cache
        for s in self.sessions:
            s.after_prefill(rows)
        return logits.expand(len(self.sessions), -1, -1)

    @torch.inference_mode()
    def step(self, tokens: Tensor) -> StepOutput:
        """Decodes one forced token per sequence in every run, then lets every policy evict.

        Args:
            tokens: ``(batch,)`` the forced tokens (their positions follow the prompts).

        Returns:
            The logits of every run and what the recall needs (see :class:`StepOutput`).
        """
        tokens = tokens.to(self.device)
        positions = self.reference.positions.clone()
        R, B = len(self.sessions), tokens.shape[0]
        if self.stack:
            logits = self.model.decode_step(tokens.repeat(R), positions.repeat(R), self._stacked,
                                            self._stacked).view(R, B, -1)
        else:
            logits = torch.stack([self.model.decode_step(tokens, s.positions, s.cache, o)
                                  for s, o in zip(self.sessions, self._observers)])
        weights = torch.stack(self._captured)  # type: ignore[arg-type]  # (layers, batch, kv_heads, group, C)
        key_pos = torch.stack([layer.positions() for layer in self.reference.cache.layers])
        # FullKV fills its slots in order: the slots past the last filled one carry no weight, and every
        # metric over the reference slots costs O(C) — so C is the context so far, not the capacity.
        used = int(self.reference.cache.layers[0].length.max())
        weights, key_pos = weights[..., :used], key_pos[..., :used]
        held = [torch.stack([layer.positions() for layer in s.cache.layers]) for s in self.sessions[1:]]
        for s in self.sessions:
            s.after_step()
        return StepOutput(logits, weights, key_pos, held, positions)
