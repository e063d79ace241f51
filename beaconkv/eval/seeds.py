"""Deterministic seeds derived from names, so that a sharded run equals an unsharded one.

A sample's seed depends only on (base seed, problem id, sample index) — never on the rank, the
number of ranks or the order in which work is done.
"""

from __future__ import annotations

import hashlib

__all__ = ["derive_seed"]


def derive_seed(*parts: object) -> int:
    """Hash the parts to a 63-bit non-negative seed (SHA-256, stable across runs and machines).

    Args:
        *parts: Values whose ``str`` identifies the purpose, e.g. ``("sample", 0, "60", 3)``.

    Returns:
        An int in ``[0, 2**63)``.
    """
    digest = hashlib.sha256("\x1f".join(str(p) for p in parts).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") >> 1
