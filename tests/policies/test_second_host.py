"""A policy written for beaconkv's cache runs unchanged on another host: a plain-tensor cache of a few dozen
lines, with another layout (keys kept in plain tensors, *every* query kept by position instead of a ring),
drives BeaconKV and SnapKV and gets the kept positions of the real cache at every step.

What the policies read and move is only the layer's public surface: ``keys``, ``positions``, ``ring``,
``ring_at``, ``compact``, ``register_slot_buffer``, the sizes, and the two observation taps a policy
installs (``prefill_hook``, ``attention_hook``); the model-level cache gives ``layers``, ``batch``,
``device`` and ``active``. The transformers integration drives the same policy objects through such a host.
"""

from __future__ import annotations

import pytest
import torch

from beaconkv.cache import KVCache
from beaconkv.models.rope import RotaryEmbedding
from beaconkv.policies import H2O, BeaconKV, Buffered, SnapKV

from .driver import bind


class PlainLayer:
    """One layer's keys, values and positions as plain tensors, and every query by its position."""

    def __init__(self, batch: int, n_kv: int, n_heads: int, capacity: int, head_dim: int, max_tokens: int) -> None:
        self.batch, self.n_kv_heads, self.n_heads, self.head_dim = batch, n_kv, n_heads, head_dim
        self.capacity, self.query_window, self.dtype = capacity, max_tokens, torch.float32
        self.k = torch.zeros(batch, n_kv, capacity, head_dim)
        self.v = torch.zeros_like(self.k)
        self.pos = torch.full((batch, n_kv, capacity), -1)
        self.length = torch.zeros(batch, dtype=torch.long)
        self.history = torch.zeros(batch, n_heads, max_tokens, head_dim)  # query of position p at index p
        self.written = torch.zeros(batch, max_tokens, dtype=torch.bool)
        self.slot_buffers: dict[str, torch.Tensor] = {}
        self.prefill_hook = self.attention_hook = None

    def write_prefill(self, k, v, q_pre, positions, valid) -> None:  # every row, right-padded prompts
        L, rows = k.shape[2], torch.arange(self.batch)
        self.k[:, :, :L], self.v[:, :, :L] = k, v
        self.pos[:, :, :L] = torch.where(valid, positions, -1)[:, None]
        self.length[:] = valid.sum(-1)
        self.history[:, :, :L] = q_pre
        self.written[:, :L] = valid
        if self.prefill_hook is not None:
            self.prefill_hook(q_pre, positions, valid, rows)

    def append(self, k, v, q_pre, positions, weights=None) -> None:
        for b in range(self.batch):
            n, p = int(self.length[b]), int(positions[b])
            self.k[b, :, n], self.v[b, :, n], self.pos[b, :, n] = k[b, :, 0], v[b, :, 0], p
            for buf in self.slot_buffers.values():
                buf[b, :, n] = 0
            self.history[b, :, p], self.written[b, p] = q_pre[b, :, 0], True
        self.length += 1
        if weights is not None and self.attention_hook is not None:
            self.attention_hook(weights(self.pos))

    def keys(self, rows=None):
        return self.k if rows is None else self.k[rows]

    def positions(self, rows=None):
        return self.pos if rows is None else self.pos[rows]

    def ring(self, rows, lo, hi):
        qpos = torch.arange(self.query_window).expand(len(rows), -1)
        mask = self.written[rows] & (qpos > lo[:, None]) & (qpos <= hi[:, None])
        return self.history[rows], torch.where(mask, qpos, -1), mask

    def ring_at(self, rows, positions):
        rows = torch.arange(self.batch) if rows is None else rows
        at = positions.clamp(0, self.query_window - 1)
        held = (positions >= 0) & torch.gather(self.written[rows], 1, at)
        return torch.gather(self.history[rows], 2, at[:, None, :, None].expand(-1, self.n_heads, -1, self.head_dim)), held

    def compact(self, rows, keep, keep_valid) -> None:
        for name in ("k", "v"):
            buf = getattr(self, name)
            moved = torch.gather(buf[rows], 2, keep[..., None].expand(-1, -1, -1, self.head_dim))
            buf[rows] = 0
            buf[rows, :, :keep.shape[-1]] = moved * keep_valid[..., None]
        for buf, empty in ((self.pos, -1), *((b, 0) for b in self.slot_buffers.values())):
            moved = torch.where(keep_valid, torch.gather(buf[rows], 2, keep), empty)
            buf[rows] = empty
            buf[rows, :, :keep.shape[-1]] = moved
        self.length[rows] = keep_valid[:, 0].sum(-1)

    def register_slot_buffer(self, name, dtype=torch.float32):
        self.slot_buffers[name] = torch.zeros(self.pos.shape, dtype=dtype)
        return self.slot_buffers[name]


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
    state = bind(policy, cache, RotaryEmbedding(D), prompts)
    valid = torch.arange(L)[None] < torch.tensor(prompts)[:, None]
    for layer in cache.layers:
        k, v, q = torch.randn(B, kv, L, D, generator=g), torch.randn(B, kv, L, D, generator=g), torch.randn(B, H, L, D, generator=g)
        layer.write_prefill(k, v, q, torch.arange(L).expand(B, L), valid)
    policy.after_prefill(state, list(range(B)))
    held = [[layer.positions().clone() for layer in cache.layers]]
    for s in range(steps):
        pos = torch.tensor(prompts) + s
        for layer in cache.layers:
            k, v, q = torch.randn(B, kv, 1, D, generator=g), torch.randn(B, kv, 1, D, generator=g), torch.randn(B, H, 1, D, generator=g)
            logits = torch.randn(B, kv, H // kv, layer.capacity, generator=g)
            if isinstance(layer, PlainLayer):
                layer.append(k, v, q, pos, weights=lambda p: logits.masked_fill(~(p >= 0)[:, :, None], -1e9).softmax(-1))
            else:
                layer.append(k, v, q, pos)
                if layer.track_attention:
                    layer.attention_hook(logits.masked_fill(~(layer.pos >= 0)[:, :, None], -1e9).softmax(-1))
        policy.after_decode_step(state)
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
    cap, window = policy.capacity(prompts, steps), policy.query_window(max(prompts) + steps)
    real = KVCache.allocate(n_layers, len(prompts), kv, H, cap, D, query_window=window,
                            track_attention=policy.track_attention)
    plain = PlainCache([PlainLayer(len(prompts), kv, H, cap, D, max(prompts) + steps) for _ in range(n_layers)])
    want, real_state = _run(real, policy, prompts, steps)
    got, plain_state = _run(plain, policy, prompts, steps)
    assert min(real_state.stats.evictions) >= 3 and real_state.stats.evictions == plain_state.stats.evictions
    for step, (a, b) in enumerate(zip(want, got)):
        for i, (x, y) in enumerate(zip(a, b)):
            assert torch.equal(x, y), f"step {step}, layer {i}: the hosts keep different positions"
