"""Decode speed from cache fill levels (:mod:`beaconkv.measure.speed.fill_levels`): the fill is the state a real
prompt of that length leaves, and the integration walks the generation's steps and evictions."""

from __future__ import annotations

import pytest
import torch

from beaconkv.measure.speed.fill_levels import FillPoint, fill_rows, integrate_generation, time_window
from beaconkv.policies import BeaconKV, FullKV
from beaconkv.session import Session

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_fill_leaves_the_state_a_prompt_of_that_length_leaves(llama):
    """Cache lengths and positions, the policy's counters and the next step's positions match a real prefill of the
    same length; only the keys and values differ (random instead of the model's)."""
    policy = BeaconKV(32, n_recent=4, n_beacon=4, n_prefix=8)
    filled = Session.for_prompts(llama, policy, [8, 8], 64)
    real = Session.for_prompts(llama, policy, [8, 8], 64)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 97, (2, 30), generator=g).tolist()
    real.prefill(prompts)
    fill_rows(filled, 30)
    assert torch.equal(filled.cache[0].length, real.cache[0].length)
    assert torch.equal(filled.cache[1].pos, real.cache[1].pos)
    assert filled.state.count == real.state.count == [22, 22] and filled.state.t == real.state.t
    assert torch.equal(filled.positions, real.positions)
    seconds, tokens = time_window(filled, 3)
    assert seconds > 0 and tokens.shape == (2,) and filled.state.t == [32, 32]
    # at the budget, the after-prefill work evicts as it would after a real prompt
    fill_rows(filled, 8 + 32)
    assert filled.state.stats.evictions == [1, 1] and filled.state.count[0] < 32
    with pytest.raises(ValueError, match="fill=999 must be in 1 .. the cache's capacity"):
        fill_rows(filled, 999)


def test_a_fill_of_fullkv_then_decoding_continues_from_there(llama):
    session = Session.for_prompts(llama, FullKV(), [4, 4, 4], 100)
    fill_rows(session, 60, chunk=16)  # four writes per layer
    assert session.cache[0].length.tolist() == [60, 60, 60] and int(session.cache[0].pos.max()) == 59
    time_window(session, 2)
    assert session.cache[1].length.tolist() == [62, 62, 62]


def test_fullkv_integration_sums_the_interpolated_steps():
    points = [FillPoint(100, 8, 10.0), FillPoint(1100, 8, 20.0)]
    est = integrate_generation(points, prompt=100, new_tokens=1001, batch=4)
    # fills 100 .. 1100: linear from 10 to 20 ms, mean 15 ms over 1001 steps
    assert est.decode_s == pytest.approx(1001 * 15.0 / 1e3) and est.evictions == 0 and est.eviction_s == 0
    assert est.tokens_per_s == pytest.approx(4 * 1001 / est.decode_s)
    assert "100, 1100" in est.method and "1001 steps" in est.method
    flat = integrate_generation([FillPoint(500, 8, 7.0)], prompt=100, new_tokens=10, batch=1)  # constant beyond
    assert flat.decode_s == pytest.approx(0.07)


def test_an_evicting_policy_integrates_its_sawtooth_and_its_evictions():
    points = [FillPoint(10 + 24, 4, 5.0), FillPoint(10 + 31, 4, 5.0)]
    est = integrate_generation(points, prompt=10, new_tokens=100, batch=2, budget=32, kept=24, eviction_ms=50.0)
    # the first eviction after 32 steps, then one every 8: 32, 40, ..., 96 -> 9 evictions within 100 steps
    assert est.evictions == 9
    assert est.decode_s == pytest.approx(100 * 5.0 / 1e3) and est.eviction_s == pytest.approx(9 * 0.05)
    assert "sawtooth" in est.method and "9 evictions of 50.0 ms" in est.method
    with pytest.raises(ValueError, match="kept=32 must be in 0 .. budget-1"):
        integrate_generation(points, prompt=10, new_tokens=100, batch=2, budget=32, kept=32)
    with pytest.raises(ValueError, match="at least one measured fill"):
        integrate_generation([], prompt=10, new_tokens=100, batch=2)
