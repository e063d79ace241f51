"""bfloat16 weights, float32 arithmetic: the batched decode matmul for CPUs with AVX2 and no native bf16.

A decode step multiplies a few rows by every weight matrix, so it is bound by the bytes of weights
it reads. On a CPU without native bfloat16 (AVX2, no AVX-512-BF16/AMX), PyTorch's bf16 matmul is
emulated and costs about ``rows`` times one row, and oneDNN's prepacked fp32 matmul
(:mod:`beaconkv.kernels.packed`) reads twice the bytes. This kernel reads the model's bf16
weights once, widens each 8-wide vector in registers and reuses it for up to 8 rows, accumulating
in float32: a bf16 model's bytes at fp32's instruction count (measured on the embedded model's MLP
matrix, 8 rows, 2 threads: 0.17 ms against 0.27 ms prepacked fp32 and 0.94 ms bf16).

The kernel is C++ (``beaconkv/kernels/csrc/bf16w_linear.cpp``, AVX2 + FMA intrinsics), built at first
use with the other CPU kernels (:mod:`beaconkv.kernels.build`: about 50 s once per machine, cached in
torch's extensions folder) and registered as the operator ``beaconkv_cpu::bf16w_linear`` with a
shape function, so ``torch.compile`` keeps each call as one extern kernel of the fullgraph decode
step. Where it cannot be built (no C++ compiler, not an x86 CPU with AVX2) :func:`bf16w_status` says
why and the kernel choice falls back to prepacked fp32. :func:`with_bf16w_linears` makes a model's copy
that runs it.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .build import KernelBuildError, kernels_status
from .model_copy import copy_with_linears

__all__ = ["BF16WLinear", "KernelBuildError", "bf16w_available", "bf16w_linear", "bf16w_status", "with_bf16w_linears"]


def bf16w_status(build: bool = True) -> str | None:
    """None when the kernel is loaded (building it first if ``build``), else why it is not available.

    The first call with ``build=True`` compiles the CPU kernels (about 50 s on a 2-core machine, then
    cached on disk across processes); later calls return at once.
    """
    return kernels_status(build)


def bf16w_available(build: bool = True) -> bool:
    """Whether :func:`bf16w_linear` can run here (see :func:`bf16w_status`)."""
    return bf16w_status(build) is None


def bf16w_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ weight.T + bias`` with a bf16 ``weight`` and float32 ``x``, products and sums.

    Args:
        x: ``(rows, in_features)``, float32, CPU.
        weight: ``(out_features, in_features)``, bfloat16, CPU.
        bias: ``(out_features,)`` or None.

    Raises:
        KernelBuildError: The kernel cannot be built here.
    """
    reason = bf16w_status()
    if reason is not None:
        raise KernelBuildError(f"the bf16-weight kernel is unavailable: {reason}. Use kernels='packed' or 'model'.")
    return torch.ops.beaconkv_cpu.bf16w_linear(x, weight, bias)


class BF16WLinear(nn.Module):
    """An ``nn.Linear`` computing in float32 on its bfloat16 weight, read in place (no copy).

    Args:
        linear: A CPU layer with a bfloat16 weight (shared with this module, not copied).

    Raises:
        KernelBuildError: The kernel cannot be built here.
        ValueError: The weight is not bfloat16 on the CPU.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight
        if w.dtype != torch.bfloat16 or w.device.type != "cpu":
            raise ValueError(f"BF16WLinear needs a bfloat16 CPU weight, not {w.dtype} on {w.device}; "
                             "load the model with dtype=torch.bfloat16, or use prepack() for other dtypes.")
        reason = bf16w_status()
        if reason is not None:
            raise KernelBuildError(f"the bf16-weight kernel is unavailable: {reason}. Use prepack() instead.")
        self.in_features, self.out_features = w.shape[1], w.shape[0]
        self.register_buffer("weight", w.detach(), persistent=False)
        bias = None if linear.bias is None else linear.bias.detach().float()
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        """Applies the layer to ``(..., in_features)``; the result is float32."""
        lead = x.shape[:-1]
        y = torch.ops.beaconkv_cpu.bf16w_linear(x.reshape(-1, self.in_features).float(), self.weight, self.bias)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def with_bf16w_linears(model: nn.Module) -> nn.Module:
    """A copy of a bfloat16 CPU ``model`` computing in float32 on its bf16 linear weights.

    Every ``nn.Linear`` becomes a :class:`BF16WLinear`, which reads the model's own bf16 weight in place
    (no copy); the other parameters (embedding, norms) are copied in float32, so activations, residuals and
    logits are float32.

    Args:
        model: A :class:`~beaconkv.models.decoder.CausalLM` (the copy is one too).

    Raises:
        ValueError: The model's linear weights are not bfloat16 on the CPU.
        KernelBuildError: The kernel cannot be built here.
    """
    return copy_with_linears(model, BF16WLinear, torch.float32)
