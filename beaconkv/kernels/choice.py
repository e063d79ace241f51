"""Which matmul kernels a decode session runs: the model's own, oneDNN-prepacked fp32, or bf16 weights.

:func:`choose_kernels` picks, per device and rows per step, between the model as it is, its copy with
:class:`~beaconkv.kernels.packed.PackedLinear` layers (:mod:`beaconkv.kernels.packed`) and its copy with
:class:`~beaconkv.kernels.bf16w.BF16WLinear` layers (:mod:`beaconkv.kernels.bf16w`); the copies are made once
per model and reused while its weights are unchanged.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .bf16w import BF16WLinear, bf16w_status, with_bf16w_linears
from .packed import PackedLinear, packing_available, prepack

__all__ = ["KERNELS", "KERNEL_LABELS", "PACK_MIN_ROWS", "KernelChoice", "bf16w_copy", "choose_kernels",
           "native_bf16_matmuls", "packed_copy"]


def native_bf16_matmuls() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX-512-BF16 or AMX, through oneDNN).

    Without it (AVX2 CPUs) a bf16 matmul of ``rows`` rows costs about ``rows`` times one row, which is
    what :func:`choose_kernels` works around. Tests replace this function to take either branch on
    any CPU.
    """
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


KERNELS = ("auto", "model", "packed", "bf16w")
"""The values of ``kernels`` (``generate``, :class:`~beaconkv.engine.Engine`, ``--kernels``)."""

KERNEL_LABELS = {"model": "the model's own", "packed": "packed fp32", "bf16w": "bf16 weights, fp32 arithmetic"}
"""How reports name each chosen kernel (what runs, not the option's name)."""

PACK_MIN_ROWS = 4
"""``kernels="auto"`` switches to the batched CPU kernels from this many rows per decode step on (see
:func:`choose_kernels`)."""


@dataclass(frozen=True)
class KernelChoice:
    """The model a decode session runs, and why.

    Attributes:
        model: The :class:`~beaconkv.models.decoder.CausalLM` to run (the caller's, or its copy with other
            linear kernels).
        kernels: ``"model"``, ``"packed"`` (oneDNN-prepacked fp32 linears, :mod:`beaconkv.kernels.packed`) or
            ``"bf16w"`` (the model's bf16 weights, fp32 arithmetic, :mod:`beaconkv.kernels.bf16w`).
        reason: One sentence: what was chosen and why.
    """

    model: nn.Module
    kernels: str
    reason: str


_COPIES: weakref.WeakKeyDictionary[nn.Module, dict[str, tuple[tuple[int, ...], nn.Module]]]
_COPIES = weakref.WeakKeyDictionary()


def _cached_copy(model: nn.Module, kind: str, make: Callable[[nn.Module], nn.Module]) -> nn.Module:
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


def packed_copy(model: nn.Module) -> nn.Module:
    """The fp32 prepacked copy of ``model`` (:func:`prepack`), made once and reused while the weights are unchanged."""
    # the hint 8 serves 1-16 rows best (a hint of 16 is slower at 16)
    return _cached_copy(model, "packed", lambda m: prepack(m, dtype=torch.float32))


def bf16w_copy(model: nn.Module) -> nn.Module:
    """The bf16-weight fp32-compute copy of ``model`` (:func:`with_bf16w_linears`), made once and reused."""
    return _cached_copy(model, "bf16w", with_bf16w_linears)


def _ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX system: no guard
        return 1 << 62


def _has_own_kernels(model: nn.Module) -> bool:
    return any(isinstance(m, (PackedLinear, BF16WLinear)) for m in model.modules())


def _linears_bf16(model: nn.Module) -> bool:
    return all(m.weight.dtype == torch.bfloat16 for m in model.modules() if isinstance(m, nn.Linear))


def choose_kernels(model: nn.Module, rows: int, kernels: str = "auto") -> KernelChoice:
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
        model: The caller's :class:`~beaconkv.models.decoder.CausalLM`.
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
