"""The fidelity study's lock-step on a transformers model: every run a :class:`~beaconkv.hf.PolicyCache`.

:class:`HFLockStep` has :class:`~beaconkv.measure.fidelity.lockstep.LockStep`'s interface (``prefill``, ``step``
returning a :class:`~beaconkv.measure.fidelity.lockstep.StepOutput`, ``sessions`` with each run's ``policy``
and ``state``), so :func:`~beaconkv.measure.fidelity.study.measure_fidelity` measures any transformers decoder
the same way (``beaconkv fidelity --backend hf``). Each run is its own forward of the model per step (no
shared dense pass); the FullKV reference is a ``PolicyCache`` too, whose observers are wrapped in
:class:`~beaconkv.measure.fidelity.lockstep.WeightCapture` to keep its decode weights, and each run's held
positions are read after its layers wrote and before its policy evicts (``PolicyCache.on_written``). The
metrics cover the policy's layers (full attention); sliding-window layers are transformers' own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from ...hf.cache import PolicyCache
from ...hf.generation import left_pad
from ...policies.base import EvictionPolicy, FullKV
from .errors import FidelityError
from .lockstep import StepOutput, WeightCapture


class HFLockStep:
    """Teacher-forces one batch of token streams through a FullKV ``PolicyCache`` and one per policy.

    Args:
        model: A transformers causal LM (sdpa or eager attention).
        policies: Compressed runs (policy objects).
        prompts: Prompt token ids per sequence (ragged; left-padded for transformers).
        max_new_tokens: Decode steps the caches must hold.

    Attributes:
        sessions: The reference's cache first, then one per policy (each has ``policy`` and ``state``).
    """

    def __init__(self, model: nn.Module, policies: Sequence[EvictionPolicy], prompts: Sequence[Sequence[int]],
                 max_new_tokens: int) -> None:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise FidelityError("every prompt needs at least one token.")
        self.model, self.prompts = model, [list(p) for p in prompts]
        self.device = next(model.parameters()).device
        limit = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
        if limit is not None and max(map(len, prompts)) + max_new_tokens > limit:
            raise FidelityError(f"prompt {max(map(len, prompts))} + {max_new_tokens} tokens exceeds "
                                f"max_position_embeddings={limit}; lower --tokens.")
        self.sessions = [PolicyCache(model, FullKV(), max_new_tokens=max_new_tokens)] + [
            PolicyCache(model, p, max_new_tokens=max_new_tokens) for p in policies]
        self._captured: list[Tensor | None] = []
        self._held: dict[int, Tensor] = {}
        for r, cache in enumerate(self.sessions[1:], start=1):
            cache.on_written = lambda c, r=r: self._held.__setitem__(
                r, torch.stack([layer.positions().clone() for layer in c.store.layers]))
        self.lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        self._mask: Tensor | None = None
        self._steps = 0

    @property
    def reference(self) -> PolicyCache:
        """The FullKV run."""
        return self.sessions[0]

    @torch.inference_mode()
    def prefill(self) -> Tensor:
        """Writes the prompts into every run's cache; returns ``(runs, batch, vocab)`` last-prompt logits."""
        ids, self._mask = left_pad(self.prompts, 0, self.device)
        positions = (self._mask.cumsum(-1) - 1).clamp(min=0)
        logits = torch.stack([self.model(input_ids=ids, attention_mask=self._mask, position_ids=positions,
                                         cache=cache).logits[:, -1].float() for cache in self.sessions])
        ref = self.reference
        self._captured = [None] * len(ref.observers)
        ref.observers = [WeightCapture(o, self._captured, i) for i, o in enumerate(ref.observers)]
        return logits

    @torch.inference_mode()
    def step(self, tokens: Tensor) -> StepOutput:
        """Decodes one forced token per sequence in every run; every policy then evicts.

        Args:
            tokens: ``(batch,)`` the forced tokens.

        Returns:
            What :class:`~beaconkv.measure.fidelity.lockstep.StepOutput` holds, over the policy's layers.
        """
        tokens = tokens.to(self.device)
        positions = self.lengths + self._steps
        self._mask = torch.cat([self._mask, self._mask.new_ones(self._mask.shape[0], 1)], dim=1)
        logits = torch.stack([self.model(input_ids=tokens[:, None], attention_mask=self._mask,
                                         position_ids=positions[:, None], cache=cache).logits[:, -1].float()
                              for cache in self.sessions])
        self._steps += 1
        store = self.reference.store
        used = int(store.layers[0].length.max())  # FullKV fills its slots in order
        weights = torch.stack(self._captured)[..., :used]  # type: ignore[arg-type]  # (layers, b, kv, group, C)
        key_pos = torch.stack([layer.positions() for layer in store.layers])[..., :used]
        held = [self._held[r] for r in range(1, len(self.sessions))]
        return StepOutput(logits, weights, key_pos, held, positions)
