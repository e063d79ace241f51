"""The former name of :mod:`beaconkv.kernels.bf16w` (the bf16-weight linear kernel), kept for one release.

Importing this module warns.
"""

from __future__ import annotations

import warnings

from ..kernels.bf16w import (
    BF16WLinear,
    KernelBuildError,
    bf16w_available,
    bf16w_linear,
    bf16w_status,
    with_bf16w_linears,
)

__all__ = ["BF16WLinear", "KernelBuildError", "bf16w_available", "bf16w_linear", "bf16w_status", "with_bf16w_linears"]

warnings.warn("beaconkv.models.bf16w is now beaconkv.kernels.bf16w", DeprecationWarning, stacklevel=2)
