"""The attention ↔ cache contract, declared once (:class:`beaconkv.cache.LayerCache`) and met by every cache."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

import beaconkv
from beaconkv.cache import CacheCapacityError, KVCache, LayerCache, LayerKVCache, LayerRows, ModelCache
from beaconkv.measure.fidelity.cache_stack import CacheStack, LayerStack


def _cache(batch=2, capacity=16) -> KVCache:
    return KVCache.allocate(2, batch, 2, 4, capacity, 8)


def test_every_cache_like_class_implements_the_protocol():
    cache = _cache()
    rows = cache.rows(torch.tensor([1]))
    stack = CacheStack([cache, _cache()])
    for layer in (cache[0], rows[0], stack[0]):
        assert isinstance(layer, LayerCache), type(layer).__name__
    assert isinstance(cache[0], LayerKVCache) and isinstance(rows[0], LayerRows) and isinstance(stack[0], LayerStack)
    for whole in (cache, rows, stack):
        assert isinstance(whole, ModelCache), type(whole).__name__
    assert not isinstance(object(), LayerCache)


def test_a_rows_view_prefills_and_refuses_to_decode():
    cache = _cache()
    view = cache.rows(torch.tensor([1]))[0]
    k = torch.randn(1, 2, 3, 8)
    view.write_prefill(k, k, torch.arange(3)[None], torch.ones(1, 3, dtype=torch.bool))
    assert cache[0].length.tolist() == [0, 3]
    one = torch.randn(2, 2, 1, 8)
    with pytest.raises(CacheCapacityError, match="only prefills"):
        view.append(one, one, torch.tensor([3, 3]))
    with pytest.raises(CacheCapacityError, match="only prefills"):
        view.attend(torch.randn(2, 4, 1, 8), 1.0)


class ListCache:
    """A cache of a few lines that knows nothing of beaconkv's: keys and values grown by concatenation."""

    def __init__(self) -> None:
        self.k = self.v = None

    def write_prefill(self, k: Tensor, v: Tensor, positions: Tensor, valid: Tensor) -> None:
        self.k, self.v = k, v

    def append(self, k: Tensor, v: Tensor, positions: Tensor) -> None:
        self.k, self.v = torch.cat([self.k, k], 2), torch.cat([self.v, v], 2)

    def attend(self, q: Tensor, scale: float, need_weights: bool = False) -> tuple[Tensor, Tensor | None]:
        group = q.shape[1] // self.k.shape[1]
        k, v = self.k.repeat_interleave(group, 1), self.v.repeat_interleave(group, 1)
        weights = torch.softmax(q @ k.transpose(-1, -2) * scale, -1)
        return weights @ v, (weights.view(q.shape[0], self.k.shape[1], group, -1) if need_weights else None)


def test_a_cache_of_ones_own_runs_the_model_through_the_declared_contract(tiny_models):
    model = beaconkv.load_model(tiny_models["llama"][0])
    ids = torch.tensor([[5, 9, 13, 2, 7]])
    valid = torch.ones_like(ids, dtype=torch.bool)
    ours = [ListCache() for _ in model.model.layers]
    assert all(isinstance(c, LayerCache) for c in ours)
    theirs = KVCache.allocate(len(ours), 1, model.config.num_key_value_heads, model.config.num_attention_heads, 16,
                              model.config.head_dim)
    a, b = model.prefill(ids, valid, ours), model.prefill(ids, valid, theirs)
    torch.testing.assert_close(a, b)
    token = a.argmax(-1)
    for position in range(5, 9):
        a = model.decode_step(token, torch.tensor([position]), ours)
        b = model.decode_step(token, torch.tensor([position]), theirs)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        token = a.argmax(-1)


def test_the_former_cache_stack_path_warns_and_gives_the_same_classes():
    import importlib
    import sys

    sys.modules.pop("beaconkv.cache_stack", None)
    with pytest.warns(DeprecationWarning, match=r"beaconkv\.measure\.fidelity\.cache_stack"):
        old = importlib.import_module("beaconkv.cache_stack")
    assert (old.CacheStack, old.LayerStack) == (CacheStack, LayerStack)
