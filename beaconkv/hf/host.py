"""What the hooks, the attention function and the cache layers call on a :class:`~beaconkv.hf.PolicyCache`.

Declared once as a protocol, so those modules depend on this contract and not on the cache module
(which imports them): the arrows run from the cache down to its parts, never back.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor


class PolicyHost(Protocol):
    """The calls a :class:`~beaconkv.hf.PolicyCache` answers for its parts."""

    @property
    def phase(self) -> str | None:
        """The forward under way: ``"prefill"``, ``"chunk"``, ``"decode"``, or None between forwards."""

    #: Tokens every row has seen, padding included (the logical length transformers reads).
    seen: int

    #: True while the hooks run a forward's earlier model calls (they pass those calls through).
    splitting: bool

    def policy_index(self, layer_idx: int) -> int | None:
        """The index among the policy's layers of model layer ``layer_idx`` (None: a layer transformers keeps)."""

    def begin_forward(self, batch: int, n_tokens: int, device: torch.device, attention_mask: Tensor | None,
                      position_ids: Tensor | None) -> list[tuple[int, int]]:
        """Starts a forward; returns the column ranges of the model calls to run it as (one unless split)."""

    def begin_piece(self, k: int) -> None:
        """Starts the forward's ``k``-th model call."""

    def end_piece(self) -> None:
        """Ends a model call: the policy's work (its schedule and evictions) for what it completed."""

    def end_forward(self) -> None:
        """Ends the forward's last model call."""

    def write(self, index: int, keys: Tensor, values: Tensor) -> None:
        """Writes a forward's keys and values of policy layer ``index``."""

    def observe_prefill(self, index: int, query: Tensor, cos: Tensor, sin: Tensor) -> None:
        """Hands a whole prompt's queries of policy layer ``index`` to its observer."""

    def chunk_attention(self, index: int, query: Tensor, cos: Tensor, sin: Tensor, scaling: float,
                        sinks: Tensor | None = None, softcap: float | None = None) -> Tensor:
        """A chunk's attention over the stored slots of policy layer ``index``."""

    def decode_attention(self, index: int, query: Tensor, cos: Tensor, sin: Tensor, scaling: float,
                         sinks: Tensor | None = None, softcap: float | None = None) -> Tensor:
        """A decode step's attention over the stored slots of policy layer ``index``."""

    def refuse(self, what: str) -> None:
        """Raises for an operation a policy cache cannot do."""
