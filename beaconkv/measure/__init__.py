"""Measuring tools built on generation: fidelity against FullKV and trace analysis.

* :mod:`beaconkv.measure.fidelity` — teacher-forced KL, top-1 agreement and attention recall of
  every policy x budget against FullKV (``beaconkv fidelity``);
* :mod:`beaconkv.measure.analysis` — global vs local queries on one trace, their pre-RoPE geometry,
  and the beacons BeaconKV held when they arrived (``beaconkv analyze``);
* ``beaconkv.measure.speed`` — decode speed and memory (``beaconkv bench``; its own module).

Submodules are imported lazily so ``import beaconkv.measure`` stays light (no matplotlib).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "FidelityError": "fidelity", "FidelityRow": "fidelity", "GlobalQueryRule": "fidelity", "LockStep": "fidelity",
    "PolicySpec": "fidelity", "Trace": "fidelity", "attention_distance": "fidelity",
    "held_attention_mass": "fidelity", "kl_divergence": "fidelity", "load_traces": "fidelity",
    "measure_fidelity": "fidelity", "policy_specs": "fidelity", "add_fidelity_arguments": "fidelity",
    "run_fidelity": "fidelity",
    "TraceAnalysis": "analysis", "analyze_trace": "analysis", "add_analyze_arguments": "analysis",
    "run_analyze": "analysis",
}

__all__ = [
    "FidelityError", "FidelityRow", "GlobalQueryRule", "LockStep", "PolicySpec", "Trace", "TraceAnalysis",
    "add_analyze_arguments", "add_fidelity_arguments", "analyze_trace", "attention_distance", "held_attention_mass",
    "kl_divergence", "load_traces", "measure_fidelity", "policy_specs", "run_analyze", "run_fidelity",
]


def __getattr__(name: str) -> Any:
    """Imports the submodule that defines ``name`` on first use."""
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
