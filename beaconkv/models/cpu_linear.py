"""The former home of the CPU linear kernels and of ``choose_kernels``, kept for one release.

They live in :mod:`beaconkv.kernels` now, one job a module: oneDNN prepacking in
:mod:`beaconkv.kernels.packed` (``PackedLinear``, ``prepack``, ``PackingError``), the model copy in
:mod:`beaconkv.kernels.model_copy`, the bf16-weight copy in :mod:`beaconkv.kernels.bf16w`
(``with_bf16w_linears``) and the choice in :mod:`beaconkv.kernels.choice` (``choose_kernels``, ``KERNELS``,
``KernelChoice``, ...). Importing this module warns. Replacing ``native_bf16_matmuls`` here no longer steers
``choose_kernels``: replace ``beaconkv.kernels.choice.native_bf16_matmuls``.
"""

from __future__ import annotations

import warnings

from ..kernels.bf16w import with_bf16w_linears
from ..kernels.choice import (  # noqa: F401 - KERNELS, KERNEL_LABELS, PACK_MIN_ROWS: importable, as before
    KERNEL_LABELS,
    KERNELS,
    PACK_MIN_ROWS,
    KernelChoice,
    bf16w_copy,
    choose_kernels,
    native_bf16_matmuls,
    packed_copy,
)
from ..kernels.model_copy import copy_with_linears
from ..kernels.packed import (
    PackedLinear,
    PackingError,
    packed_linear,
    packing_available,
    prepack,
)

__all__ = ["KernelChoice", "PackedLinear", "PackingError", "bf16w_copy", "choose_kernels", "copy_with_linears",
           "native_bf16_matmuls", "packed_copy", "packed_linear", "packing_available", "prepack", "with_bf16w_linears"]

warnings.warn("beaconkv.models.cpu_linear is now beaconkv.kernels: choose_kernels, KERNELS and KernelChoice are in "
              "beaconkv.kernels.choice, prepack/PackedLinear/PackingError in beaconkv.kernels.packed, "
              "with_bf16w_linears in beaconkv.kernels.bf16w", DeprecationWarning, stacklevel=2)
