"""A toy device function and the object it writes, shared by the graph strategy's tests."""

from __future__ import annotations

import torch


class Store:
    """An object whose tensors a device function writes in place (a cache's stand-in), with a host flag."""

    def __init__(self, n: int = 6) -> None:
        self.buf = torch.zeros(n)
        self.count = torch.zeros((), dtype=torch.long)
        self.doubled = False
        self.steps = 0  # a host counter: a device function must not read it


def write_and_read(store: Store, x: torch.Tensor, scale: float) -> torch.Tensor:
    """A device function: writes ``x`` into the store's buffer in place, advances a device counter and returns a
    fresh tensor computed from both (branching on a host flag)."""
    store.buf.mul_(0.5).add_(x.sum() * scale)
    store.count.add_(1)
    out = store.buf * (2.0 if store.doubled else 1.0) + store.count
    return out + x.mean()
