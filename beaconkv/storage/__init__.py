"""KV storage: how one layer's keys and values are held in memory, behind one documented contract.

:class:`KVStorage` is the contract (write, read for scoring, attend, move on compaction);
:class:`DenseKV` stores them as they are (in any floating dtype), :class:`Int8KV` as int8 with one
scale per token and KV head. :func:`make_storage` builds one by name (``"dense"``, ``"int8"``) for
:meth:`beaconkv.cache.KVCache.allocate`.
"""

from .base import KVStorage, StorageError
from .dense import DenseKV
from .int8 import Int8KV
from .registry import STORAGES, make_storage, storage_names

__all__ = ["DenseKV", "Int8KV", "KVStorage", "STORAGES", "StorageError", "make_storage", "storage_names"]
