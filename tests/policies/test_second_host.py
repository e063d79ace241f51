"""A policy written for beaconkv's cache runs unchanged on another host: a plain-tensor store of a few dozen
lines (keys in plain tensors, written and compacted by Python loops) drives BeaconKV, SnapKV and H2O and
gets the kept positions of the real cache at every step.

The host only stores: sizes, ``keys`` / ``values`` / ``positions``, ``compact`` (with the policy's
per-slot tensors as ``carry``) and ``last_slot``; the model-level cache gives ``layers``, ``batch``,
``device`` and ``active``. Everything the policies observe — the pre-RoPE query ring, H2O's accumulated
attention — is the policy's own (its state's observers), and the host hands it the queries and weights
exactly as attention does: ``observer.prefill(...)`` after the prompt is written, ``observer.decode(...)``
after each step. The transformers integration drives the same policy objects through such a host.
"""

from __future__ import annotations

import pytest
import torch

from beaconkv.cache import KVCache
from beaconkv.models.rope import RotaryEmbedding
from beaconkv.policies import H2O, BeaconKV, Buffered, SnapKV

from .driver import bind


class PlainLayer:
    """One layer's keys, values and positions as plain tensors, written and moved by Python loops."""

    def __init__(self, batch: int, n_kv: int, n_heads: int, capacity: int, head_dim: int) -> None:
        self.batch, self.n_kv_heads, self.n_heads, self.head_dim = batch, n_kv, n_heads, head_dim
        self.capacity, self.dtype = capacity, torch.float32
        self.k = torch.zeros(batch, n_kv, capacity, head_dim)
        self.v = torch.zeros_like(self.k)
        self.pos = torch.full((batch, n_kv, capacity), -1)
        self.length = torch.zeros(batch, dtype=torch.long)

    def write_prefill(self, k, v, positions, valid) -> None:  # every row, right-padded prompts
        L = k.shape[2]
        self.k[:, :, :L], self.v[:, :, :L] = k, v
        self.pos[:, :, :L] = torch.where(valid, positions, -1)[:, None]
        self.length[:] = valid.sum(-1)

    def append(self, k, v, positions) -> None:
        for b in range(self.batch):
            n = int(self.length[b])
            self.k[b, :, n], self.v[b, :, n], self.pos[b, :, n] = k[b, :, 0], v[b, :, 0], int(positions[b])
        self.length += 1

    def last_slot(self):
        return self.length - 1

    def keys(self, rows=None):
        return self.k if rows is None else self.k[rows]

    def values(self, rows=None):
        return self.v if rows is None else self.v[rows]

    def positions(self, rows=None):
        return self.pos if rows is None else self.pos[rows]

    def compact(self, rows, keep, keep_valid, carry=()) -> None:
        for b, kept, ok in zip(rows.tolist(), keep, keep_valid):
            for h in range(self.n_kv_heads):
                slots = kept[h][ok[h]].tolist()
                for buf, empty in ((self.k, 0), (self.v, 0), (self.pos, -1), *((c, 0) for c in carry)):
                    moved = buf[b, h, slots].clone()
                    buf[b, h] = empty
                    buf[b, h, :len(slots)] = moved
            self.length[b] = int(ok[0].sum())


class PlainCache:
    """The model-level host: its layers, and which rows decode."""

    def __init__(self, layers: list[PlainLayer]) -> None:
        self.layers, self.batch, self.device = layers, layers[0].batch, torch.device("cpu")
        self.active = torch.ones(self.batch, dtype=torch.bool)

    def __getitem__(self, i):
        return self.layers[i]

    def __len__(self):
        return len(self.layers)


def _run(cache, policy, prompts, steps, seed=0):
    """The same tensors into either host; the positions every layer holds after the prefill and each step."""
    g = torch.Generator().manual_seed(seed)
    B, L, first = len(prompts), max(prompts), cache[0]
    H, kv, D = first.n_heads, first.n_kv_heads, first.head_dim
    driver = bind(policy, cache, RotaryEmbedding(D), prompts, max_tokens=max(prompts) + steps)
    state = driver.state
    valid, positions = torch.arange(L)[None] < torch.tensor(prompts)[:, None], torch.arange(L).expand(B, L)
    for layer, observer in zip(cache.layers, state.observers):
        k, v, q = torch.randn(B, kv, L, D, generator=g), torch.randn(B, kv, L, D, generator=g), torch.randn(B, H, L, D, generator=g)
        layer.write_prefill(k, v, positions, valid)
        observer.prefill(q, positions, valid)
    driver.after_prefill(list(range(B)))
    held = [[layer.positions().clone() for layer in cache.layers]]
    for s in range(steps):
        pos = torch.tensor(prompts) + s
        for layer, observer in zip(cache.layers, state.observers):
            k, v, q = torch.randn(B, kv, 1, D, generator=g), torch.randn(B, kv, 1, D, generator=g), torch.randn(B, H, 1, D, generator=g)
            logits = torch.randn(B, kv, H // kv, layer.capacity, generator=g)
            layer.append(k, v, pos)
            weights = logits.masked_fill(~(layer.positions() >= 0)[:, :, None], -1e9).softmax(-1)
            observer.decode(q, pos, weights if observer.needs_weights else None)
        driver.after_decode_step()
        held.append([layer.positions().clone() for layer in cache.layers])
    return held, state


@pytest.mark.parametrize("make", [
    lambda: BeaconKV(32, n_recent=4, n_beacon=4, n_prefix=2),
    lambda: SnapKV(32, n_recent=4, window=8),
    lambda: H2O(32, n_recent=4, schedule=Buffered(buffer=8)),
], ids=["beacon", "snapkv", "h2o-buffered"])
def test_a_plain_tensor_host_keeps_the_positions_of_the_real_cache(make):
    prompts, steps, n_layers, kv, H, D = [7, 12], 90, 2, 2, 4, 8
    policy = make()
    cap = policy.capacity(prompts, steps)
    real = KVCache.allocate(n_layers, len(prompts), kv, H, cap, D)
    plain = PlainCache([PlainLayer(len(prompts), kv, H, cap, D) for _ in range(n_layers)])
    want, real_state = _run(real, policy, prompts, steps)
    got, plain_state = _run(plain, policy, prompts, steps)
    assert min(real_state.stats.evictions) >= 3 and real_state.stats.evictions == plain_state.stats.evictions
    for step, (a, b) in enumerate(zip(want, got)):
        for i, (x, y) in enumerate(zip(a, b)):
            assert torch.equal(x, y), f"step {step}, layer {i}: the hosts keep different positions"
