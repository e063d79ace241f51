"""In-place writes that stay in place when compiled.

A device function that writes into a buffer it was handed (a cache, a policy's ring of queries) must
write only the entries it changes. Eagerly ``Tensor.scatter_`` does; compiled, it does not: inductor
functionalises ``buf.scatter_(...)`` into a new buffer (a copy of ``buf`` with the entries written)
that is copied back into ``buf`` at the end of the graph, and no pass of inductor turns that back into
an in-place write. Every decode step then copied every layer's whole cache twice — work that grows with
the budget, on top of attention's own read. An indexed assignment (``index_put_``) is turned back into
an in-place write, so :func:`scatter_` writes that way inside a compiled graph and calls
``Tensor.scatter_`` (several times faster in eager mode) outside one.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["scatter_"]


def scatter_(buf: Tensor, dim: int, index: Tensor, src: Tensor | float | int) -> Tensor:
    """``buf.scatter_(dim, index, src)``, written in place in a compiled graph too (see the module docstring).

    Args:
        buf: The tensor written, in place.
        dim: The dimension ``index`` indexes.
        index: Indices along ``dim``, with as many dimensions as ``buf`` (as ``Tensor.scatter_`` wants);
            each entry should be written once (as with ``Tensor.scatter_``, which of two writes to one
            entry wins is unspecified).
        src: The values, shaped like ``index``, or one number for every indexed entry.

    Returns:
        ``buf``.
    """
    if not torch.compiler.is_compiling():
        return buf.scatter_(dim, index, src)
    dim = dim % buf.dim()
    where = []
    for d, n in enumerate(index.shape):
        if d == dim:
            where.append(index)
        else:
            shape = [1] * index.dim()
            shape[d] = n
            where.append(torch.arange(n, device=index.device).view(shape))
    if not isinstance(src, Tensor):  # a fill on the device, not a copy from the host
        src = torch.full((), src, dtype=buf.dtype, device=buf.device)
    return buf.index_put_(tuple(where), src)
