"""Several caches driven as one batch: run the dense layers once for many independent runs.

A study that compares policies decodes the *same* tokens through many caches (FullKV and every
policy at every budget). :class:`CacheStack` lets them share one pass through the model's public
path — ``model.prefill(ids, valid, stack, stack)`` and ``model.decode_step(tokens, positions, stack, stack)`` —
while each member cache keeps its own contents, policy and evictions:

* prefill with the members' common batch ``B``: every member receives the same prompt writes
  (the prompt is computed once);
* decode with batch ``R * B`` (the tokens repeated once per member): rows ``r*B .. (r+1)*B - 1``
  belong to member ``r``; :meth:`LayerStack.append` and :meth:`LayerStack.attend` split the batch and
  concatenate the members' attention outputs.

It speaks the attention ↔ cache contract of :mod:`beaconkv.cache` and the attention ↔ observer
contract of :mod:`beaconkv.observation` (each member's observer — its policy's, or a measurement's —
sees its own rows), so any attention module works with it unchanged: pass the stack as both the cache
and the observers of ``model.prefill`` / ``model.decode_step``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ...cache import KVCache, LayerKVCache
from ...observation import LayerObserver, ModelObserver


class LayerStack:
    """One layer of a :class:`CacheStack`: the members' layer caches (and observers), side by side along the batch.

    It is a :class:`~beaconkv.cache.LayerCache` and a :class:`~beaconkv.observation.LayerObserver` at once:
    each call splits the batch and hands every member its rows.

    Args:
        members: The members' caches of this layer (same batch ``B`` each).
        observers: Each member's observer of this layer (None: nobody observes that member).

    Attributes:
        needs_weights: Whether any member's observer needs the decode attention weights.
    """

    def __init__(self, members: list[LayerKVCache], observers: Sequence[LayerObserver | None] | None = None) -> None:
        self.members = members
        self.observers = list(observers) if observers is not None else [None] * len(members)
        self.batch = members[0].batch
        self.needs_weights = any(o is not None and o.needs_weights for o in self.observers)

    def _split(self, x: Tensor) -> list[Tensor]:
        return list(x.split(self.batch)) if x.shape[0] == self.batch * len(self.members) else [x] * len(self.members)

    def write_prefill(self, k: Tensor, v: Tensor, positions: Tensor, valid: Tensor) -> None:
        """Writes prompts into every member: the same ``B`` prompts to each, or each its own ``R*B`` slice."""
        for member, *args in zip(self.members, *map(self._split, (k, v, positions, valid))):
            member.write_prefill(*args)

    def append(self, k: Tensor, v: Tensor, positions: Tensor) -> None:
        """Appends each member's slice of the ``R*B`` decode rows to it."""
        for member, *args in zip(self.members, *map(self._split, (k, v, positions))):
            member.append(*args)

    def attend(self, q: Tensor, scale: float, need_weights: bool = False) -> tuple[Tensor, Tensor | None]:
        """Each member attends its slice of the queries over its own cache; outputs concatenated.

        The weights, when asked, are the members' along the batch, zero-padded to the largest capacity
        (zero for a member whose observer does not need them; :meth:`decode` hands each its own)."""
        outs, weights = [], []
        for member, obs, part in zip(self.members, self.observers, q.split(self.batch)):
            out, w = member.attend(part, scale, need_weights=need_weights and obs is not None and obs.needs_weights)
            outs.append(out)
            weights.append(w)
        if not need_weights:
            return torch.cat(outs), None
        width = max(m.capacity for m in self.members)
        shape = (self.batch, self.members[0].n_kv_heads, self.members[0].group)
        return torch.cat(outs), torch.cat([
            F.pad(w, (0, width - w.shape[-1])) if w is not None else q.new_zeros((*shape, width), dtype=torch.float32)
            for w in weights
        ])

    def prefill(self, q_pre: Tensor, positions: Tensor, valid: Tensor) -> None:
        """Hands each member's observer its prompt queries (the same ``B`` prompts, or its own slice)."""
        for obs, *args in zip(self.observers, *map(self._split, (q_pre, positions, valid))):
            if obs is not None:
                obs.prefill(*args)

    def decode(self, q_pre: Tensor, positions: Tensor, weights: Tensor | None) -> None:
        """Hands each member's observer its rows of the step (and its own slots of the weights)."""
        parts = self._split(weights) if weights is not None else [None] * len(self.members)
        for member, obs, q, pos, w in zip(self.members, self.observers, self._split(q_pre), self._split(positions),
                                          parts):
            if obs is not None:
                obs.decode(q, pos, w[..., : member.capacity] if w is not None and obs.needs_weights else None)


class CacheStack:
    """Caches of ``R`` runs seen as one cache of batch ``R * B`` (or ``B`` at prefill); see the module.

    Args:
        caches: The members (same number of layers and batch).
        observers: Each member's observers (a :class:`~beaconkv.observation.ModelObserver`, or None).

    Raises:
        ValueError: Members of different shapes.
    """

    def __init__(self, caches: list[KVCache], observers: Sequence[ModelObserver | None] | None = None) -> None:
        if len({(len(c), c.batch) for c in caches}) != 1:
            raise ValueError("stacked caches need the same number of layers and the same batch.")
        observers = list(observers) if observers is not None else [None] * len(caches)
        if len(observers) != len(caches):
            raise ValueError(f"{len(observers)} members' observers for {len(caches)} caches; give one (or None) each.")
        self.caches = caches
        self.layers = [LayerStack([c[i] for c in caches], [None if o is None else o[i] for o in observers])
                       for i in range(len(caches[0]))]

    def __getitem__(self, i: int) -> LayerStack:
        return self.layers[i]

    def __len__(self) -> int:
        return len(self.layers)
