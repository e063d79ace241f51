"""bfloat16 weights, float32 arithmetic: the batched decode matmul for CPUs with AVX2 and no native bf16.

A decode step multiplies a few rows by every weight matrix, so it is bound by the bytes of weights
it reads. On a CPU without native bfloat16 (AVX2, no AVX-512-BF16/AMX), PyTorch's bf16 matmul is
emulated and costs about ``rows`` times one row, and oneDNN's prepacked fp32 matmul
(:mod:`beaconkv.models.cpu_linear`) reads twice the bytes. This kernel reads the model's bf16
weights once, widens each 8-wide vector in registers and reuses it for up to 8 rows, accumulating
in float32: a bf16 model's bytes at fp32's instruction count (measured on the embedded model's MLP
matrix, 8 rows, 2 threads: 0.17 ms against 0.27 ms prepacked fp32 and 0.94 ms bf16).

The kernel is C++ (``csrc/bf16w_linear.cpp``, AVX2 + FMA intrinsics) built at first use with
``torch.utils.cpp_extension`` — about 50 s once per machine, cached in torch's extensions folder —
and registered as the operator ``beaconkv_cpu::bf16w_linear`` with a shape function, so
``torch.compile`` keeps each call as one extern kernel of the fullgraph decode step. Where it cannot
be built (no C++ compiler, not an x86 CPU with AVX2) :func:`bf16w_status` says why and the kernel
choice falls back to prepacked fp32.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
from pathlib import Path

import torch
from torch import Tensor, nn

SOURCE = Path(__file__).with_name("csrc") / "bf16w_linear.cpp"
"""The kernel's C++ source, shipped with the package."""

_BUILD_FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp"]
_lock = threading.Lock()
_status: dict[str, str | None] = {}


class KernelBuildError(RuntimeError):
    """The bf16-weight kernel cannot run here (see the message for why and what to use instead)."""


def _unsupported_reason() -> str | None:
    """Why the kernel cannot be built on this machine, or None."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"this CPU's vector capability is {capability}, the kernel needs AVX2 and FMA"
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r}) on the PATH; install one (e.g. g++) or set CXX"
    if _ninja_dir() is None:
        return "torch builds C++ extensions with ninja, which is not on the PATH; pip install ninja"
    return None


def _ninja_dir() -> str | None:
    """The folder of a ``ninja`` executable: on the PATH, or next to this interpreter (an unactivated venv)."""
    found = shutil.which("ninja")
    if found is not None:
        return os.path.dirname(found)
    beside = Path(sys.executable).parent
    return str(beside) if (beside / "ninja").is_file() else None


def _build() -> str | None:
    """Builds and loads the extension once per process; returns why it failed, or None."""
    reason = _unsupported_reason()
    if reason is not None:
        return reason
    from torch.utils import cpp_extension

    print("beaconkv: loading the bf16-weight CPU matmul kernel (built once per machine, about 50 s)…",
          file=sys.stderr, flush=True)
    ninja = _ninja_dir()
    if ninja is not None and shutil.which("ninja") is None:  # torch looks for it on the PATH only
        os.environ["PATH"] = ninja + os.pathsep + os.environ.get("PATH", "")
    try:
        cpp_extension.load(name="beaconkv_cpu_bf16w", sources=[str(SOURCE)], extra_cflags=_BUILD_FLAGS,
                           extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    except (RuntimeError, OSError, ImportError) as err:  # a compiler or linker failure
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return f"building {SOURCE.name} failed: {first[:300]}"

    @torch.library.register_fake("beaconkv_cpu::bf16w_linear")
    def _shape(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return x.new_empty(x.shape[0], weight.shape[0])

    return None


def bf16w_status(build: bool = True) -> str | None:
    """None when the kernel is loaded (building it first if ``build``), else why it is not available.

    The first call with ``build=True`` compiles the extension (about 50 s on a 2-core machine, then
    cached on disk across processes); later calls return at once.
    """
    with _lock:
        if "reason" not in _status:
            if not build:
                return _unsupported_reason() or "not built yet in this process"
            _status["reason"] = _build()
        return _status["reason"]


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
