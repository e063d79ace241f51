"""One layer of a :class:`~beaconkv.hf.PolicyCache`, as transformers sees it: a ``CacheLayerMixin``.

The layer holds no tensors itself: its keys and values live in the policy cache's fixed-capacity store
(a :class:`~beaconkv.cache.LayerKVCache`, post-RoPE keys, one position per slot), which the policy
compacts between steps. What transformers asks of a layer it answers in **logical** terms:

* :meth:`PolicyLayer.get_seq_length` is the number of tokens the layer has seen (prompt columns, padding
  included, plus one per decode step), as for a ``DynamicLayer``: a forward without ``position_ids``
  rotates its new token at that position, its logical one, however many slots eviction freed;
* :meth:`PolicyLayer.get_mask_sizes` sizes the mask transformers builds over those logical positions; the
  decode attention of a policy layer masks by the store's slots instead (see :mod:`beaconkv.hf.attention`).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor
from transformers.cache_utils import CacheLayerMixin

from .host import PolicyHost


class PolicyLayer(CacheLayerMixin):
    """A full-attention layer whose cache the policy bounds.

    Args:
        cache: The policy cache that owns the store.
        index: This layer's index among the policy's layers (its store and observer).
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, cache: PolicyHost, index: int) -> None:
        super().__init__()
        self.cache, self.index = cache, index

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        """Nothing to allocate here: the policy cache allocates every store at the prefill."""
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        """Writes the step's keys and values into the store; returns them unchanged (the prefill attends over
        the prompt itself; a decode step attends over the store, in the attention function)."""
        self.is_initialized = True
        self.cache.write(self.index, key_states, value_states)
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` of the logical sequence, as a ``DynamicLayer`` gives them."""
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        """Tokens seen so far (the logical length), not the slots held."""
        return self.cache.seen

    def get_max_length(self) -> int:
        """-1: the logical sequence has no bound (the store's capacity bounds the slots, not the positions)."""
        return -1

    def reset(self) -> None:
        """Forgets the layer's tokens (the policy cache drops its stores and state)."""
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        """Refused: evicted tokens cannot be restored, so the cache cannot roll back."""
        self.cache.refuse("crop")

    def reorder_cache(self, beam_idx: Tensor) -> None:
        """Refused: beam search reorders rows whose policy state would not follow."""
        self.cache.refuse("reorder_cache (beam search)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Refused: rows are admitted to the policy at the prefill."""
        self.cache.refuse("batch_repeat_interleave")

    def batch_select_indices(self, indices: Tensor) -> None:
        """Refused: rows are admitted to the policy at the prefill."""
        self.cache.refuse("batch_select_indices")
