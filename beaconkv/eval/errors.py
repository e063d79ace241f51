"""Exceptions raised by the evaluation harness.

Every error names the offending value and says how to fix it, so that a failed
``beaconkv eval`` run can be corrected from its last line of output. :class:`EvalError` is a
:class:`ValueError`: the ``beaconkv`` command line (:func:`beaconkv.command.run_command`) reports
every one of them as a user error, in one line with exit status 2.
"""

from __future__ import annotations

from ..errors import BeaconKVError

__all__ = [
    "DatasetAccessError",
    "DatasetFormatError",
    "EvalError",
    "MissingFieldError",
    "ResultsConflictError",
    "ResultsFileError",
    "UnknownBenchmarkError",
]


class EvalError(BeaconKVError, ValueError):
    """Base class of every error raised by :mod:`beaconkv.eval`: wrong input, reported in one line."""


class UnknownBenchmarkError(EvalError):
    """A benchmark name that is not registered in :data:`beaconkv.eval.benchmarks.BENCHMARKS`."""


class DatasetFormatError(EvalError):
    """A data file that cannot be used: unknown suffix, malformed line, wrong layout, no records."""


class MissingFieldError(EvalError, KeyError):
    """A record lacks a field that the benchmark's field map requires."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


class DatasetAccessError(EvalError, RuntimeError):
    """A hub dataset could not be downloaded (offline, gated, missing file)."""


class ResultsConflictError(EvalError, RuntimeError):
    """An existing results file was written with different settings than this run."""


class ResultsFileError(DatasetFormatError):
    """A results file that cannot be used: a symlink or other non-regular file where a results file
    belongs, a line that is not a record, or a record with a missing or mistyped key field."""
