"""Storage kinds by name, for ``generate(..., kv_storage=...)`` and the ``--kv-storage`` CLI flag."""

from __future__ import annotations

from typing import Any

import torch

from .base import KVStorage, StorageError
from .dense import DenseKV
from .int8 import Int8KV

STORAGES: dict[str, type[KVStorage]] = {"dense": DenseKV, "int8": Int8KV}
"""Name -> storage class (what ``kv_storage=`` accepts, besides a class)."""


def storage_names() -> list[str]:
    """The storage kinds :func:`make_storage` accepts."""
    return sorted(STORAGES)


def storage_class(kind: str | type[KVStorage]) -> type[KVStorage]:
    """Resolves a name (``"dense"``, ``"int8"``) or a :class:`KVStorage` subclass.

    Raises:
        StorageError: Unknown name or not a storage class.
    """
    if isinstance(kind, type) and issubclass(kind, KVStorage):
        return kind
    if isinstance(kind, str) and kind.lower() in STORAGES:
        return STORAGES[kind.lower()]
    raise StorageError(f"kv_storage={kind!r} is unknown; choose one of {', '.join(storage_names())} "
                       "(or pass a KVStorage subclass).")


def make_storage(kind: str | type[KVStorage], batch: int, n_kv_heads: int, capacity: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, storage_dtype: torch.dtype | None = None,
                 **options: Any) -> KVStorage:
    """Builds one layer's storage.

    Args:
        kind: ``"dense"``, ``"int8"`` or a :class:`KVStorage` subclass.
        batch: Sequences.
        n_kv_heads: Key/value heads.
        capacity: Slots per (sequence, KV head).
        head_dim: Width of a head.
        dtype: The compute dtype.
        device: Where the buffers live.
        storage_dtype: Buffer dtype of a dense storage (None: the compute dtype); an int8 storage
            accepts only None or ``torch.int8``.
        **options: Further constructor arguments of the class.

    Raises:
        StorageError: Unknown kind, or a ``storage_dtype`` the kind cannot hold.
    """
    cls = storage_class(kind)
    if storage_dtype is not None and storage_dtype != dtype:
        if cls is Int8KV and storage_dtype != torch.int8:
            raise StorageError(f"kv_storage='int8' stores int8; cache_dtype={storage_dtype} contradicts it.")
        if cls is DenseKV:
            options["storage_dtype"] = storage_dtype
    if cls is DenseKV and storage_dtype == torch.int8:
        raise StorageError("cache_dtype=torch.int8 needs kv_storage='int8' (per-token scales), not dense storage.")
    return cls(batch, n_kv_heads, capacity, head_dim, dtype, device, **options)
