"""A structural copy of a model with other linear layers: how the CPU kernels enter a model.

:func:`~beaconkv.kernels.packed.prepack` and :func:`~beaconkv.kernels.bf16w.with_bf16w_linears` both
build on :func:`copy_with_linears`: the caller's model is untouched, embeddings, norms and the rotary
module are shared (or cast), and each ``nn.Linear`` becomes the kernel's layer.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

__all__ = ["copy_with_linears"]


def copy_with_linears(module: nn.Module, make_linear: Callable[[nn.Linear], nn.Module], dtype: torch.dtype,
                      seen: dict[int, nn.Module] | None = None) -> nn.Module:
    """A structural copy of ``module`` with each ``nn.Linear`` replaced by ``make_linear(linear)`` and the
    other parameters cast to ``dtype`` (buffers are shared).

    A module reached twice (the rotary module every layer shares) is copied once, so it stays shared.

    Args:
        module: The model (or any module) to copy; it is not changed.
        make_linear: Makes the layer that replaces one ``nn.Linear``.
        dtype: The dtype of every other parameter of the copy.
        seen: Modules already copied, by ``id`` (for the recursion; leave it None).

    Returns:
        The copy, of ``module``'s class.
    """
    seen = {} if seen is None else seen
    if id(module) in seen:
        return seen[id(module)]
    if isinstance(module, nn.Linear):
        clone: nn.Module = make_linear(module)
    else:
        clone = copy.copy(module)
        clone._parameters = {name: (None if p is None else nn.Parameter(p.detach().to(dtype), requires_grad=False))
                             for name, p in module._parameters.items()}
        clone._buffers = dict(module._buffers)
        clone._modules = {name: (None if child is None else copy_with_linears(child, make_linear, dtype, seen))
                          for name, child in module._modules.items()}
    seen[id(module)] = clone
    return clone
