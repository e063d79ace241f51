"""Several caches driven as one batch: run the dense layers once for many independent runs.

A study that compares policies decodes the *same* tokens through many caches (FullKV and every
policy at every budget). :class:`CacheStack` lets them share one pass through the model's public
path — ``model.prefill(ids, valid, stack)`` and ``model.decode_step(tokens, positions, stack)`` —
while each member cache keeps its own contents, policy and evictions:

* prefill with the members' common batch ``B``: every member receives the same prompt writes
  (the prompt is computed once);
* decode with batch ``R * B`` (the tokens repeated once per member): rows ``r*B .. (r+1)*B - 1``
  belong to member ``r``; :meth:`LayerStack.append` and :meth:`LayerStack.attend` split the batch and
  concatenate the members' attention outputs.

It speaks the attention ↔ cache contract of :mod:`beaconkv.cache`, so any attention module works
with it unchanged.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .cache import KVCache, LayerKVCache


class LayerStack:
    """One layer of a :class:`CacheStack`: the members' layer caches, side by side along the batch.

    Args:
        members: The members' caches of this layer (same batch ``B`` each).
    """

    def __init__(self, members: list[LayerKVCache]) -> None:
        self.members = members
        self.batch = members[0].batch

    def _split(self, x: Tensor) -> list[Tensor]:
        return list(x.split(self.batch)) if x.shape[0] == self.batch * len(self.members) else [x] * len(self.members)

    def write_prefill(self, k: Tensor, v: Tensor, q_pre: Tensor, positions: Tensor, valid: Tensor) -> None:
        """Writes prompts into every member: the same ``B`` prompts to each, or each its own ``R*B`` slice."""
        for member, *args in zip(self.members, *map(self._split, (k, v, q_pre, positions, valid))):
            member.write_prefill(*args)

    def append(self, k: Tensor, v: Tensor, q_pre: Tensor, positions: Tensor) -> None:
        """Appends each member's slice of the ``R*B`` decode rows to it."""
        for member, *args in zip(self.members, *map(self._split, (k, v, q_pre, positions))):
            member.append(*args)

    def attend(self, q: Tensor, scale: float) -> Tensor:
        """Each member attends its slice of the queries over its own cache; outputs concatenated."""
        return torch.cat([m.attend(part, scale) for m, part in zip(self.members, q.split(self.batch))])


class CacheStack:
    """Caches of ``R`` runs seen as one cache of batch ``R * B`` (or ``B`` at prefill); see the module.

    Args:
        caches: The members (same number of layers and batch).

    Raises:
        ValueError: Members of different shapes.
    """

    def __init__(self, caches: list[KVCache]) -> None:
        if len({(len(c), c.batch) for c in caches}) != 1:
            raise ValueError("stacked caches need the same number of layers and the same batch.")
        self.caches = caches
        self.layers = [LayerStack([c[i] for c in caches]) for i in range(len(caches[0]))]

    def __getitem__(self, i: int) -> LayerStack:
        return self.layers[i]

    def __len__(self) -> int:
        return len(self.layers)
