"""The attention ↔ observer contract (:mod:`beaconkv.observation`): attention hands each layer's queries and
weights to that layer's observer; the cache only stores."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

import beaconkv
from beaconkv import CompileConfig
from beaconkv.cache import CacheCapacityError, KVCache
from beaconkv.measure.fidelity.cache_stack import CacheStack
from beaconkv.measure.fidelity.lockstep import WeightCapture
from beaconkv.observation import LayerObserver, ModelObserver
from beaconkv.policies import H2O, BeaconKV, PolicyDriver, SnapKV
from beaconkv.policies.observer import ObservedLayer, ObserverRows
from beaconkv.sampling import RowSampling, SamplingParams
from beaconkv.session import Session


class Recorder:
    """A user's observer of one layer: keeps what attention hands it."""

    def __init__(self, needs_weights: bool) -> None:
        self.needs_weights = needs_weights
        self.prompt: Tensor | None = None
        self.steps: list[tuple[Tensor, Tensor, Tensor | None]] = []

    def prefill(self, q_pre: Tensor, positions: Tensor, valid: Tensor) -> None:
        self.prompt = q_pre.clone()

    def decode(self, q_pre: Tensor, positions: Tensor, weights: Tensor | None) -> None:
        self.steps.append((q_pre.clone(), positions.clone(), None if weights is None else weights.clone()))


def _pre_rope_queries(model, ids: Tensor, valid: Tensor) -> list[Tensor]:
    """Each layer's pre-RoPE queries of a plain forward, recomputed from the attention's own input."""
    out = []

    def grab(module, args):
        x, positions, rotary = args[:3]
        out.append(module.project(x, rotary)[0])

    handles = [layer.self_attn.register_forward_pre_hook(grab) for layer in model.model.layers]
    try:
        model(ids, valid)
    finally:
        for h in handles:
            h.remove()
    return out


def test_every_observer_like_class_implements_the_protocol():
    cache = KVCache.allocate(2, 2, 2, 4, 16, 8)
    state = SnapKV(8, window=4, n_recent=1).create_state(cache, rope=None)
    rows = torch.tensor([1])
    stack = CacheStack([cache, KVCache.allocate(2, 2, 2, 4, 16, 8)], [state.observers, None])
    for observer in (state.observers[0], state.observers[0].rows(rows), stack[0], WeightCapture(None, [None], 0),
                     Recorder(False)):
        assert isinstance(observer, LayerObserver), type(observer).__name__
    assert isinstance(state.observers[0], ObservedLayer) and isinstance(state.observers[0].rows(rows), ObserverRows)
    for whole in (state.observers, stack):
        assert isinstance(whole, ModelObserver)
    assert not isinstance(object(), LayerObserver)


def test_the_cache_is_a_store_with_no_callbacks_or_queries():
    layer = KVCache.allocate(1, 1, 2, 4, 8, 8)[0]
    for name in ("prefill_hook", "attention_hook", "slot_buffers", "register_slot_buffer", "queries", "query_pos",
                 "ring", "ring_at", "track_attention", "query_window"):
        assert not hasattr(layer, name), name


@pytest.mark.parametrize("needs_weights", [False, True])
def test_attention_hands_each_layer_its_pre_rope_queries_and_weights_when_asked(llama, needs_weights):
    ids = torch.tensor([[5, 9, 13, 2, 7], [3, 4, 8, 0, 0]])
    valid = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    cfg = llama.config
    cache = KVCache.allocate(cfg.num_hidden_layers, 2, cfg.num_key_value_heads, cfg.num_attention_heads, 12,
                             cfg.head_dim)
    observers = [Recorder(needs_weights) for _ in llama.model.layers]
    plain = KVCache.allocate(cfg.num_hidden_layers, 2, cfg.num_key_value_heads, cfg.num_attention_heads, 12,
                             cfg.head_dim)
    with torch.no_grad():
        token = llama.prefill(ids, valid, cache, observers).argmax(-1)
        llama.prefill(ids, valid, plain)
        for got, want in zip(observers, _pre_rope_queries(llama, ids, valid)):
            torch.testing.assert_close(got.prompt, want)
        positions = valid.sum(-1)
        logits = llama.decode_step(token, positions, cache, observers)
        unobserved = llama.decode_step(token, positions, plain)
    # whether the observer asked for weights (explicit softmax) or not (fused kernel), the step is the same
    torch.testing.assert_close(logits, unobserved, rtol=1e-4, atol=1e-5)
    for i, rec in enumerate(observers):
        (q_pre, pos, weights), = rec.steps
        assert q_pre.shape == (2, cfg.num_attention_heads, 1, cfg.head_dim) and pos.tolist() == [5, 3]
        if not needs_weights:
            assert weights is None
            continue
        filled = (cache[i].pos >= 0).unsqueeze(2)  # (batch, kv, 1, capacity)
        assert weights.shape == (2, cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads, 12)
        assert bool((weights.masked_fill(filled, 0) == 0).all()), "empty slots carry no weight"
        torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:-1]))


def test_a_policy_observers_ring_holds_the_last_prompt_queries_and_each_decode_query(llama):
    policy = SnapKV(8, window=3, n_recent=1)
    session = Session.for_prompts(llama, policy, [5, 3], 4)
    ids, valid = torch.tensor([[5, 9, 13, 2, 7], [3, 4, 8, 0, 0]]), torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    want = _pre_rope_queries(llama, ids, valid)
    session.prefill([[5, 9, 13, 2, 7], [3, 4, 8]])
    for observer, q in zip(session.state.observers, want):
        ring = observer.ring_buffer
        assert ring.window == 3
        for b, n in enumerate((5, 3)):
            for p in range(n - 3, n):
                assert int(ring.query_pos[b, p % 3]) == p
                torch.testing.assert_close(ring.queries[b, :, p % 3], q[b, :, p])
    first = session.state.observers[0].ring_buffer
    session.step(torch.tensor([1, 2]), RowSampling.of([SamplingParams(), SamplingParams()], "cpu"))
    assert first.query_pos[0, 5 % 3] == 5 and first.query_pos[1, 3 % 3] == 3


def test_a_released_row_writes_no_query_position():
    policy = SnapKV(8, window=2, n_recent=1)
    cache = KVCache.allocate(1, 2, 1, 2, 12, 4)
    driver = PolicyDriver(policy, cache, rope=None)
    state = driver.state
    driver.admit([0], [3])  # row 1 never admitted: it does not decode
    observer = state.observers[0]
    observer.decode(torch.randn(2, 2, 1, 4), torch.tensor([3, 7]), None)
    assert observer.ring_buffer.query_pos[:, 1].tolist() == [3, -1]


def test_a_rows_view_observes_prefill_and_refuses_decode():
    cache = KVCache.allocate(1, 3, 1, 2, 12, 4)
    state = H2O(8, n_recent=1).create_state(cache, rope=None)
    observer = state.observers[0]
    acc = state.layers[0]
    acc.fill_(5.0)
    view = observer.rows(torch.tensor([2]))
    view.prefill(torch.randn(1, 2, 4, 4), torch.arange(4)[None], torch.ones(1, 4, dtype=torch.bool))
    assert acc[2].abs().sum() == 0 and bool((acc[:2] == 5.0).all()), "a prefill zeroes only its rows' slot buffers"
    with pytest.raises(CacheCapacityError, match="only prefills"):
        view.decode(torch.randn(3, 2, 1, 4), torch.tensor([4, 4, 4]), None)


def test_a_stack_hands_each_member_its_own_slots_of_the_weights():
    small, large = KVCache.allocate(1, 1, 1, 2, 6, 4), KVCache.allocate(1, 1, 1, 2, 10, 4)
    rec = [Recorder(True), Recorder(False), Recorder(True)]
    third = KVCache.allocate(1, 1, 1, 2, 8, 4)
    stack = CacheStack([small, large, third], [[rec[0]], [rec[1]], [rec[2]]])
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 1, 3, 4, generator=g)
    stack[0].write_prefill(k, k, torch.arange(3)[None], torch.ones(1, 3, dtype=torch.bool))
    step = torch.randn(3, 1, 1, 4, generator=g)
    stack[0].append(step, step, torch.tensor([3, 3, 3]))
    q = torch.randn(3, 2, 1, 4, generator=g)
    assert stack[0].needs_weights
    out, weights = stack[0].attend(q, 0.5, need_weights=True)
    stack[0].decode(q, torch.tensor([3, 3, 3]), weights)
    for member, r, part in ((small, rec[0], 0), (third, rec[2], 2)):
        alone_out, alone_w = member[0].attend(q[part:part + 1], 0.5, need_weights=True)
        (_, _, got), = r.steps
        torch.testing.assert_close(got, alone_w)
        torch.testing.assert_close(out[part:part + 1], alone_out)
    assert rec[1].steps[0][2] is None  # the member whose observer needs no weights gets none


@pytest.mark.parametrize("compile", [False, CompileConfig(backend="aot_eager")], ids=["eager", "aot_eager"])
def test_prefill_sampling_runs_through_the_states_executor(llama, compile):
    prompts = [[5, 9, 13, 2, 7, 11, 3, 8], [3, 4, 8, 6, 2]]
    policy = BeaconKV(16, n_beacon=2, n_recent=2)
    out = beaconkv.generate(llama, None, prompts, max_new_tokens=2, eos_token_ids=[], policy=policy, compile=compile)
    executor = out.policy_state.executor
    assert executor.calls["BeaconKV.observe_prefill"] == llama.config.num_hidden_layers  # once per layer, per prefill
    assert executor.compiled == bool(compile)
    if compile:
        assert executor.compile_seconds["BeaconKV.observe_prefill"] > 0  # the prompt FPS is a graph too
        eager = beaconkv.generate(llama, None, prompts, max_new_tokens=2, eos_token_ids=[], policy=policy)
        for got, want in zip(out.policy_state.layers, eager.policy_state.layers):
            assert torch.equal(got.obs.pos, want.obs.pos) and torch.equal(got.obs.valid, want.obs.valid)
            torch.testing.assert_close(got.obs.q, want.obs.q)
