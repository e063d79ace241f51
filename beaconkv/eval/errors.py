"""Exceptions raised by the evaluation harness.

Every error names the offending value and says how to fix it, so that a failed
``beaconkv eval`` run can be corrected from its last line of output.
"""

from __future__ import annotations

__all__ = [
    "EvalError",
    "UnknownBenchmarkError",
    "DatasetFormatError",
    "MissingFieldError",
    "DatasetAccessError",
    "ResultsConflictError",
]


class EvalError(Exception):
    """Base class of every error raised by :mod:`beaconkv.eval`."""


class UnknownBenchmarkError(EvalError, ValueError):
    """A benchmark name that is not registered in :data:`beaconkv.eval.datasets.BENCHMARKS`."""


class DatasetFormatError(EvalError, ValueError):
    """A data file that cannot be read: unknown suffix, malformed line, wrong layout."""


class MissingFieldError(EvalError, KeyError):
    """A record lacks a field that the benchmark's field map requires."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


class DatasetAccessError(EvalError, RuntimeError):
    """A hub dataset could not be downloaded (offline, gated, missing file)."""


class ResultsConflictError(EvalError, RuntimeError):
    """An existing results file was written with different settings than this run."""
