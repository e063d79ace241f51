"""Dense KV storage: keys and values kept as they are, in the compute dtype or another float dtype."""

from __future__ import annotations

import torch
from torch import Tensor

from ..inplace import scatter_
from ..kernels.attention import mixed_attention_applies, mixed_attention_op
from .base import KVStorage, StorageError, gather_slots, put_front, token_index


class DenseKV(KVStorage):
    """Keys and values in ``storage_dtype`` (default: the compute dtype), cast at attention when they differ.

    A bf16 cache under float32 compute on the CPU (the ``bf16w`` kernels' sessions) is attended
    without the cast: :func:`~beaconkv.kernels.attention.mixed_attention` reads the bf16 slots once
    and computes in float32, where the CPU kernels can be built.

    Args:
        batch: Sequences.
        n_kv_heads: Key/value heads.
        capacity: Slots per (sequence, KV head).
        head_dim: Width of a head.
        dtype: The compute dtype (what reads return).
        device: Where the buffers live.
        storage_dtype: Dtype of the buffers (e.g. ``torch.bfloat16`` under a float32 model, which halves
            the cache); None = the compute dtype, and then :meth:`keys` returns the buffer itself.

    Raises:
        StorageError: ``storage_dtype`` is not a floating dtype.
    """

    kind = "dense"

    def __init__(self, batch: int, n_kv_heads: int, capacity: int, head_dim: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", storage_dtype: torch.dtype | None = None) -> None:
        super().__init__(batch, n_kv_heads, capacity, head_dim, dtype, device)
        storage_dtype = storage_dtype or dtype
        if not storage_dtype.is_floating_point:
            raise StorageError(f"storage_dtype={storage_dtype} is not a floating dtype; use kv_storage='int8' "
                               "for an integer cache.")
        self.storage_dtype = storage_dtype
        shape = (batch, n_kv_heads, capacity, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=storage_dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=storage_dtype, device=device), persistent=False)
        self.mixed = storage_dtype != dtype and mixed_attention_applies(dtype, storage_dtype, head_dim, self.device)

    def write(self, rows: Tensor, slots: Tensor, k: Tensor, v: Tensor) -> None:
        index = token_index(rows, slots, self.n_kv_heads)
        self.k[index] = k.to(self.storage_dtype)
        self.v[index] = v.to(self.storage_dtype)

    def append(self, slot: Tensor, k: Tensor, v: Tensor) -> None:
        B, H, _, D = k.shape
        idx = slot.view(B, 1, 1, 1).expand(B, H, 1, D)
        scatter_(self.k, 2, idx, k.to(self.storage_dtype))
        scatter_(self.v, 2, idx, v.to(self.storage_dtype))

    def _read(self, buf: Tensor, rows: Tensor | None) -> Tensor:
        out = buf if rows is None else buf[rows]
        return out if out.dtype == self.dtype else out.to(self.dtype)

    def keys(self, rows: Tensor | None = None) -> Tensor:
        return self._read(self.k, rows)

    def values(self, rows: Tensor | None = None) -> Tensor:
        return self._read(self.v, rows)

    def attend(self, q: Tensor, mask: Tensor, scale: float, need_weights: bool = False) -> tuple[Tensor, Tensor | None]:
        if self.mixed and not need_weights and q.dtype == self.dtype:
            # self.mixed says the kernel is loaded (a compiled step cannot trace the build check)
            return mixed_attention_op(q, self.k, self.v, mask, scale), None
        return super().attend(q, mask, scale, need_weights)

    def compact(self, rows: Tensor, keep: Tensor) -> None:
        for buf in (self.k, self.v):
            put_front(buf, rows, gather_slots(buf, rows, keep))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, storage_dtype={self.storage_dtype}"
