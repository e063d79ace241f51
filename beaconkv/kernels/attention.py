"""Decode attention of float32 queries over a bfloat16 cache, without widening the cache first.

A session that computes in float32 on a bf16 model (the ``bf16w`` kernels of
:mod:`beaconkv.kernels.choice`) keeps its dense cache in bf16, so the cache costs what the caller
sized. PyTorch's attention needs one dtype, so every step would first widen each layer's whole cache
to float32: write twice its bytes and read them again. ``beaconkv_cpu::mixed_attention`` reads the
bf16 keys and values once, widening them in registers, and computes the logits, the masked softmax
and the weighted sum of values in float32. :class:`~beaconkv.storage.DenseKV` calls it
(:func:`mixed_attention_op`) where :func:`mixed_attention_applies`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .build import KernelBuildError, kernels_status


def mixed_attention_applies(q_dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int, device: torch.device) -> bool:
    """Whether :func:`mixed_attention` serves these queries and cache (building the kernels if needed).

    It does for float32 queries over a bfloat16 cache on the CPU, with ``head_dim`` a multiple of 8,
    where the kernels can be built.
    """
    if device.type != "cpu" or q_dtype != torch.float32 or kv_dtype != torch.bfloat16 or head_dim % 8:
        return False
    return kernels_status() is None


def mixed_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Attention of one step's queries over every valid slot, in float32, on bf16 keys and values.

    Args:
        q: ``(batch, kv_heads, group, head_dim)`` float32 queries (the GQA group plays the query axis).
        k: ``(batch, kv_heads, slots, head_dim)`` bfloat16 keys.
        v: Values, like ``k``.
        mask: Bool, broadcastable to ``(batch, kv_heads, 1, slots)``: the slots that may be attended.
        scale: Logit scale.

    Returns:
        ``(batch, kv_heads, group, head_dim)`` float32. A (sequence, head) with no valid slot gets zeros
        (PyTorch's attention gives NaN there); such a row is not decoding.

    Raises:
        KernelBuildError: The kernels cannot be built here.
    """
    reason = kernels_status()
    if reason is not None:
        raise KernelBuildError(f"the CPU kernels are unavailable: {reason}. Use a cache in the compute dtype.")
    return torch.ops.beaconkv_cpu.mixed_attention(q, k, v, mask, scale)


def mixed_attention_op(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """The operator of :func:`mixed_attention` itself, without the build check.

    For a caller that asked :func:`mixed_attention_applies` once, when it was built: a compiled decode step
    cannot trace the check, and the operator is then known to be loaded. Arguments and result as
    :func:`mixed_attention`.
    """
    return torch.ops.beaconkv_cpu.mixed_attention(q, k, v, mask, scale)
