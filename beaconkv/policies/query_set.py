"""A set of stored pre-RoPE queries per head: the unit BeaconKV samples, keeps and scores with."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .query_selection import QuerySelector


@dataclass
class QuerySet:
    """A per-head set of stored pre-RoPE queries.

    Its tensors share leading axes: ``(batch, heads)`` for one layer's set, ``(layers, batch, heads)``
    for the sets of every layer stacked (what BeaconKV's maintenance samples from in one call).

    Attributes:
        q: ``(..., S, head_dim)`` vectors.
        pos: ``(..., S)`` their absolute positions (``-1`` empty).
        valid: ``(..., S)`` which entries exist.
    """

    q: Tensor
    pos: Tensor
    valid: Tensor

    @classmethod
    def empty(cls, batch: int, heads: int, size: int, head_dim: int, dtype: torch.dtype, device,
              layers: int | None = None) -> QuerySet:
        """An all-empty set of ``size`` slots (with ``layers``: one per layer, stacked)."""
        lead = (batch, heads) if layers is None else (layers, batch, heads)
        return cls(
            torch.zeros(*lead, size, head_dim, dtype=dtype, device=device),
            torch.full((*lead, size), -1, dtype=torch.long, device=device),
            torch.zeros(*lead, size, dtype=torch.bool, device=device),
        )

    @property
    def size(self) -> int:
        """Slots per head."""
        return self.pos.shape[-1]

    def rows(self, rows: Tensor) -> QuerySet:
        """The sub-set of some sequences (the batch axis is the one before ``heads``)."""
        return QuerySet(self.q.index_select(-4, rows), self.pos.index_select(-3, rows),
                        self.valid.index_select(-3, rows))

    def assign(self, rows: Tensor, other: QuerySet) -> None:
        """Overwrites some sequences in place with ``other`` (same slot count)."""
        self.q.index_copy_(self.q.dim() - 4, rows, other.q.to(self.q.dtype))
        self.pos.index_copy_(self.pos.dim() - 3, rows, other.pos)
        self.valid.index_copy_(self.valid.dim() - 3, rows, other.valid)

    def clear(self, rows: Tensor) -> None:
        """Empties some sequences in place."""
        self.q.index_fill_(self.q.dim() - 4, rows, 0)
        self.pos.index_fill_(self.pos.dim() - 3, rows, -1)
        self.valid.index_fill_(self.valid.dim() - 3, rows, False)

    def pad_to(self, size: int) -> QuerySet:
        """The set with empty slots appended up to ``size`` (no-op if it has as many)."""
        n = size - self.size
        if n <= 0:
            return self
        lead = self.pos.shape[:-1]
        return QuerySet.cat(self, QuerySet(self.q.new_zeros(*lead, n, self.q.shape[-1]), self.pos.new_full((*lead, n), -1),
                                           self.valid.new_zeros(*lead, n)))

    @staticmethod
    def cat(*sets: QuerySet) -> QuerySet:
        """Concatenates along the slot axis."""
        return QuerySet(torch.cat([s.q for s in sets], dim=-2), torch.cat([s.pos for s in sets], dim=-1),
                        torch.cat([s.valid for s in sets], dim=-1))

    def unbind(self) -> list[QuerySet]:
        """Splits the leading axis (e.g. one set per layer, as views)."""
        return [QuerySet(q, p, v) for q, p, v in zip(self.q.unbind(0), self.pos.unbind(0), self.valid.unbind(0))]

    def select(self, sampler: QuerySelector, k: int) -> QuerySet:
        """Keeps ``k`` entries per head chosen by ``sampler`` over the valid ones (any leading axes)."""
        idx, ok = sampler.select(self.q, k, self.valid)  # (..., k)
        q = torch.gather(self.q, -2, idx.unsqueeze(-1).expand(*idx.shape, self.q.shape[-1]))
        pos = torch.where(ok, torch.gather(self.pos, -1, idx), -1)
        return QuerySet(q, pos, ok & torch.gather(self.valid, -1, idx))
