"""The one error type of the fidelity study and the trace analysis."""

from __future__ import annotations

from ...errors import BeaconKVError


class FidelityError(BeaconKVError, ValueError):
    """Bad fidelity/analysis settings or inputs (trace too short, unknown id, bad threshold...)."""
