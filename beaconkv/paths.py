"""Where the project's own data lives: ``data/`` at the repository root (AIME24, MATH-500, the R1 traces).

The files ship with the repository (see ``data/SOURCE.md`` for their source and Apache-2.0 licence),
so every default — ``beaconkv fidelity`` and ``analyze`` traces, ``beaconkv eval`` problems, the
tests — works from a clone with nothing beside it. ``$BEACONKV_DATA`` points elsewhere.
"""

from __future__ import annotations

import os
from pathlib import Path

#: The repository root (``beaconkv/paths.py`` -> ``<repo>``).
REPO_ROOT = Path(__file__).resolve().parents[1]


def data_dir() -> Path:
    """``$BEACONKV_DATA`` if set, else ``<repo>/data``."""
    return Path(os.environ.get("BEACONKV_DATA") or REPO_ROOT / "data")


def traces_path() -> Path:
    """The default reasoning traces: ``<data>/traces`` (a directory of JSONL files)."""
    return data_dir() / "traces"


def benchmark_file(name: str) -> Path:
    """The project's copy of a benchmark's problems: ``<data>/aime24.jsonl``, ``<data>/math500.jsonl``."""
    return data_dir() / f"{name}.jsonl"
