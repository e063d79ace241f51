"""The rotate-half rotation of rotary position embeddings, the one definition every layer shares.

A rotation to a position is ``x * cos + rotate_half(x) * sin`` with ``(cos, sin)`` the same in both
halves of the last dimension. The native model (:mod:`beaconkv.models.rope`), the transformers
integration (:mod:`beaconkv.hf.rotary`) and the policies that rotate stored queries
(:mod:`beaconkv.policies.expected_attention`) all take it from here; the module imports only torch.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["rotate", "rotate_half"]


def rotate_half(x: Tensor) -> Tensor:
    """Maps the two halves ``(a, b)`` of the last dimension to ``(-b, a)``.

    Args:
        x: Any tensor whose last dimension is even.

    Returns:
        A tensor of ``x``'s shape and dtype.

    Example:
        >>> rotate_half(torch.tensor([1.0, 2.0, 3.0, 4.0]))
        tensor([-3., -4.,  1.,  2.])
    """
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotates ``x`` along its last dimension: ``x * cos + rotate_half(x) * sin``.

    Args:
        x: ``(..., d)`` with ``d`` even.
        cos: Cosines, broadcastable to ``x`` (both halves equal), in the dtype the product should have.
        sin: Sines, as ``cos``.

    Returns:
        The rotated tensor, ``x``'s shape.
    """
    return x * cos + rotate_half(x) * sin
