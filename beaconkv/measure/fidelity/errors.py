"""The one error type of the fidelity study and the trace analysis."""

from __future__ import annotations


class FidelityError(ValueError):
    """Bad fidelity/analysis settings or inputs (trace too short, unknown id, bad threshold...)."""
