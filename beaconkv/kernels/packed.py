"""Linear layers with oneDNN-prepacked weights: the fp32 batched decode matmul on CPUs without native bf16.

A decode step multiplies a few rows (the batch) by every weight matrix. On CPUs without native
bfloat16 (AVX2, no AVX-512), the BLAS's small-M GEMMs waste most of their time packing the weight
matrix at every call. oneDNN can pack a weight once, in the blocked layout its GEMM kernel reads, so
each call only streams the packed weights: with the embedded model's shapes, batch 8, a whole step's
matmuls take about half the time (see ``docs/benchmarks.md``, "Batching on the CPU").

:func:`prepack` returns a copy of a model whose ``nn.Linear`` layers are :class:`PackedLinear` (the
original model is untouched; embeddings, norms and the rotary module are shared). The packed call is
a registered custom op (``beaconkv::packed_linear``), so ``torch.compile`` keeps it as one extern
kernel inside the fullgraph decode step. :func:`~beaconkv.kernels.choice.choose_kernels` decides when
a session runs it.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..errors import BeaconKVError
from .model_copy import copy_with_linears

__all__ = ["PackedLinear", "PackingError", "packed_linear", "packing_available", "prepack"]


class PackingError(BeaconKVError, ValueError):
    """Prepacking is not possible here (no oneDNN, or a device other than the CPU)."""


def packing_available() -> bool:
    """Whether this PyTorch can prepack linear weights with oneDNN (``torch.ops.mkldnn``)."""
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


@torch.library.custom_op("beaconkv::packed_linear", mutates_args=())
def packed_linear(x: Tensor, packed: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    """``x @ W.T + b`` with ``W`` prepacked by oneDNN; ``x`` is ``(rows, in_features)``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@packed_linear.register_fake
def _packed_linear_shape(x: Tensor, packed: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    return x.new_empty(x.shape[0], out_features)


class PackedLinear(nn.Module):
    """An ``nn.Linear`` whose weight is packed once by oneDNN (CPU inference only).

    Args:
        linear: The layer to pack (its weight is copied, in ``dtype``).
        batch_hint: The row count the packing is tuned for (any count works).
        dtype: Compute dtype of the packed layer (float32 recommended on CPUs without native bf16).

    Raises:
        PackingError: oneDNN packing is unavailable, or the layer is not on the CPU.
    """

    def __init__(self, linear: nn.Linear, batch_hint: int = 8, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if not packing_available():
            raise PackingError("this PyTorch has no oneDNN linear packing; decode without prepack().")
        if linear.weight.device.type != "cpu":
            raise PackingError(f"prepacking is for CPU weights, not {linear.weight.device}; use the model as it is.")
        w = linear.weight.detach().to(dtype)
        self.in_features, self.out_features = w.shape[1], w.shape[0]
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(w, batch_hint), persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().to(dtype), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        """Applies the layer to ``(..., in_features)``."""
        lead = x.shape[:-1]
        y = packed_linear(x.reshape(-1, self.in_features), self.packed, self.bias, self.out_features)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def prepack(model: nn.Module, batch_hint: int = 8, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A copy of ``model`` computing in ``dtype`` with every linear layer prepacked by oneDNN.

    The copy shares the embedding (cast to ``dtype`` if needed), norms and rotary module with the
    original where their dtype allows; the packed weights are new memory (one more copy of the
    projections). Generation with the copy uses the same cache, policies and compile path.

    Args:
        model: A CPU :class:`~beaconkv.models.decoder.CausalLM` (the copy is one too).
        batch_hint: Rows per step the packing is tuned for (the slot pool's size).
        dtype: Compute dtype of the copy.

    Raises:
        PackingError: See :class:`PackedLinear`.
    """
    if model.device.type != "cpu":
        raise PackingError(f"prepack() is for a CPU model, not one on {model.device}.")
    return copy_with_linears(model, lambda linear: PackedLinear(linear, batch_hint, dtype), dtype)
