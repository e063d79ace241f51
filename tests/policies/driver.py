"""Drives a real cache + policy state with random tensors, checking the cache invariants after every step."""

from __future__ import annotations

import torch

from beaconkv.cache import KVCache
from beaconkv.models.rope import RotaryEmbedding
from beaconkv.policies.base import EvictionPolicy
from beaconkv.policies.driver import PolicyDriver
from beaconkv.policies.schedules import AtBudget
from beaconkv.policies.state import PolicyState


def bind(policy: EvictionPolicy, cache: KVCache, rope, prompt_lengths: list[int], **kwargs) -> PolicyDriver:
    """A driver of the policy over ``cache`` with every row admitted for prompts of these lengths (``kwargs``:
    :class:`~beaconkv.policies.PolicyDriver`'s ``max_tokens`` and ``query_window``); its state is ``.state``."""
    driver = PolicyDriver(policy, cache, rope, **kwargs)
    driver.admit(list(range(len(prompt_lengths))), list(prompt_lengths))
    return driver


def drive(
    policy: EvictionPolicy,
    prompt_lengths: list[int],
    steps: int,
    n_kv: int = 2,
    group: int = 2,
    head_dim: int = 8,
    n_layers: int = 2,
    seed: int = 0,
    on_step=None,
    storage: str = "dense",
    keep: int | None = None,
    prefill_chunk: int | None = None,
) -> tuple[KVCache, PolicyState]:
    """Prefills random prompts, runs ``steps`` decode writes, asserts the invariants throughout.

    With ``prefill_chunk=N`` a prompt longer than ``N`` is written ``N`` tokens at a time, as
    :meth:`~beaconkv.session.Session.prefill` does (the first chunk as a prefill, the others through
    the cache's ``write_chunk`` and the observer's ``chunk``, the policy's ``after_chunk`` after each);
    the invariants are checked after every chunk, and right after each chunk's write (before the
    policy acts) no row holds more than ``n_prefix + budget + N`` tokens.

    Invariants checked after prefill and every step, for every layer, sequence and KV head:
    the cache holds at most ``n_prefix + budget`` tokens; positions strictly increase; every kept
    K/V vector is bit-identical to the one written at that position (dense storage; int8 storage:
    identical to its own quantisation of it); after each eviction the cache holds exactly
    ``n_prefix + B_min`` (or ``n_prefix + keep``, computed by the caller) and the prefix and the last
    ``n_recent`` positions survive. Under a head-adaptive allocation an eviction leaves the layer's
    uniform total over its KV heads, each head within its floor and ceiling.

    Returns:
        The cache and the policy's state; ``on_step(step, state)`` is called after every step.
    """
    g = torch.Generator().manual_seed(seed)
    B, H, D = len(prompt_lengths), n_kv * group, head_dim
    cap = policy.capacity(prompt_lengths, steps, prefill_chunk=prefill_chunk)
    cache = KVCache.allocate(n_layers, B, n_kv, H, cap, D, storage=storage)
    L = max(prompt_lengths)
    chunk = L if prefill_chunk is None else prefill_chunk
    first = [min(n, chunk) for n in prompt_lengths]
    driver = PolicyDriver(policy, cache, RotaryEmbedding(D), max_tokens=L + steps)
    state = driver.state
    driver.admit(list(range(B)), list(prompt_lengths), written=first)
    written = [(torch.zeros(B, n_kv, L + steps, D), torch.zeros(B, n_kv, L + steps, D)) for _ in cache.layers]
    for begin in range(0, L, chunk):  # what attention does: cache, then observer
        rows = [b for b in range(B) if prompt_lengths[b] > begin]
        rows_t = torch.tensor(rows)
        n = [min(prompt_lengths[b] - begin, chunk) for b in rows]
        width = max(n)
        valid = torch.arange(width)[None] < torch.tensor(n)[:, None]
        positions = begin + torch.arange(width).expand(len(rows), width)
        before = list(state.stats.evictions)
        for i, (layer, observer) in enumerate(zip(cache.layers, state.observers)):
            k, v = torch.randn(len(rows), n_kv, width, D, generator=g), torch.randn(len(rows), n_kv, width, D, generator=g)
            q = torch.randn(len(rows), H, width, D, generator=g)
            if begin == 0:
                layer.write_prefill(k, v, positions, valid, rows=rows_t)
                observer.rows(rows_t).prefill(q, positions, valid)
            else:
                layer.write_chunk(k, v, positions, valid, rows=rows_t)
                observer.rows(rows_t).chunk(q, positions, valid)
            if prefill_chunk is not None and policy.budget is not None:
                for j, b in enumerate(rows):
                    bound = state.prefix[b] + policy.budget + prefill_chunk
                    assert int(layer.length[b]) <= bound, f"chunk at {begin}: {int(layer.length[b])} > {bound}"
            wk, wv = written[i]
            for j, b in enumerate(rows):
                wk[b, :, begin:begin + n[j]], wv[b, :, begin:begin + n[j]] = k[j, :, :n[j]], v[j, :, :n[j]]
        if begin == 0:
            driver.after_prefill(rows)
        else:
            driver.after_chunk(rows, n)
        check(policy, state, written, evicted=[a != b for a, b in zip(state.stats.evictions, before)], keep=keep)
    for s in range(steps):
        before = list(state.stats.evictions)
        pos = torch.tensor(prompt_lengths) + s
        for i, (layer, observer) in enumerate(zip(cache.layers, state.observers)):
            k, v = torch.randn(B, n_kv, 1, D, generator=g), torch.randn(B, n_kv, 1, D, generator=g)
            layer.append(k, v, pos)
            weights = None
            if observer.needs_weights:
                logits = torch.randn(B, n_kv, group, cap, generator=g).masked_fill(~(layer.pos >= 0)[:, :, None], -1e9)
                weights = logits.softmax(-1)
            observer.decode(torch.randn(B, H, 1, D, generator=g), pos, weights)
            wk, wv = written[i]
            wk[torch.arange(B), :, pos] = k[:, :, 0]
            wv[torch.arange(B), :, pos] = v[:, :, 0]
        driver.after_decode_step()
        check(policy, state, written, evicted=[a != b for a, b in zip(state.stats.evictions, before)], keep=keep)
        if on_step is not None:
            on_step(s, state)
    return cache, state


def _stored(x: torch.Tensor, storage: str) -> torch.Tensor:
    """What a storage gives back for vectors written as ``x`` (int8: its own quantise-dequantise)."""
    if storage == "dense":
        return x
    from beaconkv.storage.int8 import dequantize, quantize

    return dequantize(*quantize(x), x.dtype)


def check(policy: EvictionPolicy, state: PolicyState, written, evicted: list[bool], keep: int | None = None) -> None:
    """Asserts the cache invariants (see :func:`drive`); ``keep``: the evictable count an eviction must
    leave (default: the policy's ``B_min`` under the default schedule; under another schedule, without
    ``keep``, the host's count is checked against the device's length)."""
    if keep is None and isinstance(policy.schedule, AtBudget):
        keep = policy.b_min
    adaptive = policy.allocation.adaptive
    cache = state.cache
    for i, layer in enumerate(cache.layers):
        wk, wv = written[i]
        storage = layer.storage.kind
        keys, values = layer.keys(), layer.values()
        pos, length = layer.pos, layer.length
        B, H, C = pos.shape
        below = (torch.arange(C)[None, None, :] < length[:, None, None]).expand(B, H, C)
        filled = pos >= 0
        if adaptive:  # heads may keep different counts: a head that kept fewer has empty slots below length
            assert not bool((filled & ~below).any()), "slots from length on are empty"
        else:
            assert torch.equal(filled, below), "slots 0 .. length-1 are filled, the others empty"
        before = pos.cummax(-1).values  # the largest position held in slots 0 .. j (empty slots hold -1)
        assert bool((pos[..., 1:] > before[..., :-1])[filled[..., 1:]].all()), "positions must strictly increase"
        at = pos.clamp(min=0)
        for got, want in ((keys, wk), (values, wv)):
            expect = _stored(torch.gather(want, 2, at[..., None].expand(-1, -1, -1, want.shape[-1])), storage)
            assert torch.equal(got[filled], expect[filled]), "kept K/V must be the values written at their positions"
        for b in range(B):
            # the protected prefix written so far (a prompt prefilled in chunks may not have reached its end)
            n, prefix, t = int(length[b]), min(state.prefix[b], state.t[b] + 1), state.t[b]
            if adaptive:  # the host counts the fullest head's worst case
                assert n <= prefix + state.count[b], f"layer {i} seq {b}: {n} slots > {prefix}+{state.count[b]}"
            else:
                assert n == prefix + state.count[b], f"layer {i} seq {b}: {n} slots, the host counts {prefix}+{state.count[b]}"
            if policy.evicts:  # never past the schedule's eviction point (``budget`` by default)
                bound = policy.evict_point(state, b)
                assert n <= prefix + bound, f"layer {i} seq {b}: {n} > {prefix}+{bound}"
            if evicted[b] and keep is not None:
                if adaptive:  # the layer's total is the uniform one; each head within its floor and ceiling
                    per_head = filled[b].sum(-1).tolist()
                    assert sum(per_head) == H * (prefix + keep), f"after eviction {per_head} != {H} x ({prefix}+{keep})"
                    floor = prefix + policy.allocation.floor_count(policy, keep)
                    ceiling = prefix + keep + policy.allocation.extra_slots(policy, keep)
                    assert all(floor <= c <= ceiling for c in per_head), f"{per_head} outside [{floor}, {ceiling}]"
                else:
                    assert n == prefix + keep, f"after eviction {n} != {prefix}+{keep}"
            if evicted[b]:
                must = set(range(prefix)) | set(range(max(t - policy.n_recent + 1, 0), t + 1))
                assert all(must <= set(pos[b, h, :n].tolist()) for h in range(H)), "prefix and recent tokens survive"


# ------------------------------------------------------- hand-checkable runs (one layer, hand-made keys)
class IdentityRope:
    """Leaves queries unrotated, so hand-made keys decide the attention."""

    def rotate(self, x, positions):
        return x


def drive_hand(policy, prompt, keys_at, steps, n_kv=2, head_dim=8, attention=None):
    """Writes ``prompt`` tokens and ``steps`` decode tokens with keys ``keys_at(p, kv)`` and every query
    ``e0``; ``attention(layer, step)`` may report decode attention (:func:`tap`). Returns the layer as the
    policy observes it (its :class:`~beaconkv.policies.observer.ObservedLayer`; the state is ``layer.state``)."""
    cap = policy.capacity([prompt], steps)
    cache = KVCache.allocate(1, 1, n_kv, n_kv, cap, head_dim)
    driver = bind(policy, cache, IdentityRope(), [prompt], max_tokens=prompt + steps)
    store, layer = cache[0], driver.state.observers[0]
    e0 = torch.eye(head_dim)[0]

    def kv(ps):
        return torch.stack([torch.stack([keys_at(p, h) for p in ps]) for h in range(n_kv)])[None]

    ps = list(range(prompt))
    q = e0.expand(1, n_kv, prompt, head_dim)
    store.write_prefill(kv(ps), kv(ps), torch.tensor([ps]), torch.ones(1, prompt, dtype=torch.bool))
    layer.prefill(q, torch.tensor([ps]), torch.ones(1, prompt, dtype=torch.bool))
    driver.after_prefill([0])
    for s in range(steps):
        p = prompt + s
        store.append(kv([p]), kv([p]), torch.tensor([p]))
        layer.decode(e0.expand(1, n_kv, 1, head_dim), torch.tensor([p]), None)
        if attention is not None:
            attention(layer, s)
        driver.after_decode_step()
    return layer


def kept(layer, kv):
    """Positions one KV head of row 0 holds (``layer``: a cache or an observed layer)."""
    store = getattr(layer, "cache", layer)
    n = int(store.length[0])
    return store.pos[0, kv, :n].tolist()


def tap(layer, weights):
    """Hands decode attention ``weights`` to the policy's hook, as the layer's observer does after a step."""
    layer.policy.observe_attention(layer.state, layer.layer_state, weights)


def dull_keys(dull: dict[int, set[int]]):
    """Keys 0 (logit 0) except ``-40 e0`` (almost no attention) at the given positions per KV head."""
    def keys_at(p, h):
        k = torch.zeros(8)
        if p in dull[h]:
            k[0] = -40.0
        return k
    return keys_at
