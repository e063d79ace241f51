"""Linear layers with oneDNN-prepacked weights: the CPU kernels that make batched decoding pay.

A decode step multiplies a few rows (the batch) by every weight matrix. On CPUs without native
bfloat16 (AVX2, no AVX-512), the BLAS's small-M GEMMs waste most of their time packing the weight
matrix at every call. oneDNN can pack a weight once, in the blocked layout its GEMM kernel reads, so
each call only streams the packed weights: with the embedded model's shapes, batch 8, a whole step's
matmuls take about half the time (see ``docs/benchmarks.md``, "Batching on the CPU").

:func:`prepack` returns a copy of a model whose ``nn.Linear`` layers are :class:`PackedLinear` (the
original model is untouched; embeddings, norms and the rotary module are shared). The packed call is
a registered custom op (``beaconkv::packed_linear``), so ``torch.compile`` keeps it as one extern
kernel inside the fullgraph decode step. :func:`with_bf16w_linears` makes the other batched copy: a
bf16 model's linears read in place by the bf16-weight kernel of :mod:`beaconkv.models.bf16w`.

:func:`choose_kernels` picks, per device and rows per step, which of them a decode session runs.
"""

from __future__ import annotations

import copy
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..errors import BeaconKVError
from .bf16w import BF16WLinear, bf16w_status
from .decoder import CausalLM


class PackingError(BeaconKVError, ValueError):
    """Prepacking is not possible here (no oneDNN, or a device other than the CPU)."""


def native_bf16_matmuls() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX-512-BF16 or AMX, through oneDNN).

    Without it (AVX2 CPUs) a bf16 matmul of ``rows`` rows costs about ``rows`` times one row, which is
    what :func:`choose_kernels` works around. Tests replace this function to take either branch on
    any CPU.
    """
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


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


def prepack(model: CausalLM, batch_hint: int = 8, dtype: torch.dtype = torch.float32) -> CausalLM:
    """A copy of ``model`` computing in ``dtype`` with every linear layer prepacked by oneDNN.

    The copy shares the embedding (cast to ``dtype`` if needed), norms and rotary module with the
    original where their dtype allows; the packed weights are new memory (one more copy of the
    projections). Generation with the copy uses the same cache, policies and compile path.

    Args:
        model: A CPU model.
        batch_hint: Rows per step the packing is tuned for (the slot pool's size).
        dtype: Compute dtype of the copy.

    Raises:
        PackingError: See :class:`PackedLinear`.
    """
    if model.device.type != "cpu":
        raise PackingError(f"prepack() is for a CPU model, not one on {model.device}.")
    return copy_with_linears(model, lambda linear: PackedLinear(linear, batch_hint, dtype), dtype)


def with_bf16w_linears(model: CausalLM) -> CausalLM:
    """A copy of a bfloat16 CPU ``model`` computing in float32 on its bf16 linear weights.

    Every ``nn.Linear`` becomes a :class:`~beaconkv.models.bf16w.BF16WLinear`, which reads the
    model's own bf16 weight in place (no copy); the other parameters (embedding, norms) are copied in
    float32, so activations, residuals and logits are float32.

    Raises:
        ValueError: The model's linear weights are not bfloat16 on the CPU.
        KernelBuildError: The kernel cannot be built here.
    """
    return copy_with_linears(model, BF16WLinear, torch.float32)


def copy_with_linears(module: nn.Module, make_linear: Callable[[nn.Linear], nn.Module], dtype: torch.dtype,
                      seen: dict[int, nn.Module] | None = None) -> nn.Module:
    """A structural copy of ``module`` with each ``nn.Linear`` replaced by ``make_linear(linear)`` and the
    other parameters cast to ``dtype`` (buffers are shared).

    A module reached twice (the rotary module every layer shares) is copied once, so it stays shared.
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


# ----------------------------------------------------------------------------------- the choice
#: The values of ``kernels`` (``generate``, :class:`~beaconkv.engine.Engine`, ``--kernels``).
KERNELS = ("auto", "model", "packed", "bf16w")

#: How reports name each chosen kernel (what runs, not the option's name).
KERNEL_LABELS = {"model": "the model's own", "packed": "packed fp32", "bf16w": "bf16 weights, fp32 arithmetic"}

#: ``kernels="auto"`` switches to the batched CPU kernels from this many rows per decode step on
#: (see :func:`choose_kernels`).
PACK_MIN_ROWS = 4


@dataclass(frozen=True)
class KernelChoice:
    """The model a decode session runs, and why.

    Attributes:
        model: The model to run (the caller's, or its copy with other linear kernels).
        kernels: ``"model"``, ``"packed"`` (oneDNN-prepacked fp32 linears) or ``"bf16w"`` (the
            model's bf16 weights, fp32 arithmetic, :mod:`beaconkv.models.bf16w`).
        reason: One sentence: what was chosen and why.
    """

    model: CausalLM
    kernels: str
    reason: str


_COPIES: weakref.WeakKeyDictionary[CausalLM, dict[str, tuple[tuple[int, ...], CausalLM]]] = weakref.WeakKeyDictionary()


def _cached_copy(model: CausalLM, kind: str, make: Callable[[CausalLM], CausalLM]) -> CausalLM:
    """``make(model)``, made once per kind and reused while the model's weights are unchanged.

    The copy is kept (weakly, with the model) so that successive ``generate`` calls reuse it — and with
    it their compiled decode step. It is remade when a weight of the model was changed in place
    (every parameter's version counter is compared).
    """
    versions = tuple(p._version for p in model.parameters())
    copies = _COPIES.setdefault(model, {})
    hit = copies.get(kind)
    if hit is not None and hit[0] == versions:
        return hit[1]
    made = make(model)
    copies[kind] = (versions, made)
    return made


def packed_copy(model: CausalLM) -> CausalLM:
    """The fp32 prepacked copy of ``model`` (:func:`prepack`), made once and reused while the weights are unchanged."""
    # the hint 8 serves 1-16 rows best (a hint of 16 is slower at 16)
    return _cached_copy(model, "packed", lambda m: prepack(m, dtype=torch.float32))


def bf16w_copy(model: CausalLM) -> CausalLM:
    """The bf16-weight fp32-compute copy of ``model`` (:func:`with_bf16w_linears`), made once and reused."""
    return _cached_copy(model, "bf16w", with_bf16w_linears)


def _ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX system: no guard
        return 1 << 62


def _has_own_kernels(model: CausalLM) -> bool:
    return any(isinstance(m, (PackedLinear, BF16WLinear)) for m in model.modules())


def _linears_bf16(model: CausalLM) -> bool:
    return all(m.weight.dtype == torch.bfloat16 for m in model.modules() if isinstance(m, nn.Linear))


def choose_kernels(model: CausalLM, rows: int, kernels: str = "auto") -> KernelChoice:
    """Picks the matmul kernels of a decode session with ``rows`` rows per step.

    ``"auto"`` runs the model as it is unless all of these hold:

    * the model is on the CPU, and the CPU has no native bfloat16 (AVX2 without AVX-512-BF16/AMX):
      there a bf16 matmul of ``rows`` rows costs about ``rows`` times one row;
    * ``rows >= PACK_MIN_ROWS``: at 1-3 rows the model's own step (inductor's vectorised
      matrix-vector products when compiled) is as fast;

    and then it picks, in this order:

    * ``"bf16w"`` for a model with bf16 linear weights where the kernel can be built (AVX2 + FMA, a
      C++ compiler): the weights are read in bf16, in place, and widened to fp32 in registers;
    * ``"packed"`` where oneDNN can prepack: an fp32 copy of the linears, streamed once per step —
      unless that copy would take more than a quarter of the machine's memory.

    On this project's 2-core AVX2 CPU (embedded model, compiled step, batch 8) the step takes about
    49 ms with bf16w, 93 ms packed and 150 ms with the model's bf16 kernels (``docs/benchmarks.md``,
    "Batching on the CPU").

    Args:
        model: The caller's model.
        rows: Rows each decode step runs (the batch, or the engine's slot pool).
        kernels: ``"auto"``, ``"model"`` (never replace the linears), ``"packed"`` or ``"bf16w"`` (always,
            where possible).

    Raises:
        ValueError: An unknown ``kernels``, or ``"bf16w"`` for a model whose weights are not bf16.
        PackingError: ``"packed"`` where packing is impossible.
        KernelBuildError: ``"bf16w"`` where the kernel cannot be built.
    """
    if kernels not in KERNELS:
        raise ValueError(f"kernels={kernels!r} is unknown; choose one of {', '.join(KERNELS)}.")
    if kernels == "model" or _has_own_kernels(model):
        return KernelChoice(model, "model", "the model's own kernels" + (" (already replaced)" if kernels != "model"
                                                                          and _has_own_kernels(model) else ""))
    if kernels == "packed":
        return KernelChoice(packed_copy(model), "packed", "oneDNN-prepacked fp32 linears, as asked")
    if kernels == "bf16w":
        return KernelChoice(bf16w_copy(model), "bf16w", "bf16 weights with fp32 arithmetic, as asked")
    if model.device.type != "cpu":
        return KernelChoice(model, "model", f"the model's own kernels on {model.device.type}")
    if native_bf16_matmuls():
        return KernelChoice(model, "model", "this CPU has native bfloat16 matmuls")
    if rows < PACK_MIN_ROWS:
        return KernelChoice(model, "model", f"{rows} row(s) per step: the model's kernels read fewer bytes")
    why = f"{rows} rows per step on a CPU without native bfloat16"
    if _linears_bf16(model):
        reason = bf16w_status()
        if reason is None:
            return KernelChoice(bf16w_copy(model), "bf16w", f"{why}: the bf16 weights widened to fp32 in registers")
        why += f" (no bf16-weight kernel: {reason})"
    if not packing_available():
        return KernelChoice(model, "model", f"{why}, but this PyTorch has no oneDNN packing")
    fp32_bytes = 4 * sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    if fp32_bytes > _ram_bytes() // 4:
        return KernelChoice(model, "model", f"an fp32 copy of the linears ({fp32_bytes / 2**30:.1f} GiB) would "
                                            "take more than a quarter of this machine's memory")
    return KernelChoice(packed_copy(model), "packed", f"{why}: oneDNN-prepacked fp32 linears")
