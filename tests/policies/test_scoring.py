"""``merge_near_ties``: scores a rounding step apart become one score, every other order is kept."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from beaconkv.policies.scoring import merge_near_ties

RTOL = 1e-6

finite = st.floats(-1e6, 1e6, allow_nan=False, width=32)
rows = st.lists(st.one_of(finite, st.sampled_from([math.inf, -math.inf, math.nan])), min_size=1, max_size=24)


def nudged(x: float, steps: int) -> float:
    """``x`` moved ``steps`` float32 rounding steps up (negative: down)."""
    t = torch.tensor(x, dtype=torch.float32)
    toward = torch.tensor(math.inf if steps > 0 else -math.inf)
    for _ in range(abs(steps)):
        t = torch.nextafter(t, toward)
    return float(t)


@settings(max_examples=200, deadline=None)
@given(rows)
def test_merged_scores_keep_every_order_and_are_input_values(values):
    s = torch.tensor(values, dtype=torch.float32)
    m = merge_near_ties(s[None, None], RTOL)[0, 0]
    assert m.dtype == torch.float32 and m.shape == s.shape
    assert torch.equal(m.isnan(), s.isnan())  # NaN stays NaN and never absorbs a number
    real = ~s.isnan()
    for i in range(len(values)):
        if not real[i]:
            continue
        assert float(m[i]) in values  # a group takes one of its members' scores: its highest
        assert m[i] >= s[i]
        for j in range(len(values)):
            if real[j] and s[i] >= s[j]:
                assert m[i] >= m[j]  # merging never inverts two scores


@settings(max_examples=200, deadline=None)
@given(finite, st.lists(st.integers(-4, 4), min_size=2, max_size=8), st.randoms(use_true_random=False))
def test_copies_a_few_rounding_steps_apart_tie_in_any_order(x, steps, rnd):
    copies = [nudged(x, k) for k in steps]
    far = torch.tensor([x + 1e3 * (2 + abs(x)), x - 1e3 * (2 + abs(x))]).tolist()  # far outside the tolerance
    values = copies + far
    rnd.shuffle(values)
    m = merge_near_ties(torch.tensor(values)[None, None], RTOL)[0, 0].tolist()
    assert len({m[values.index(c)] for c in copies}) == 1
    assert m[values.index(max(copies))] == max(copies)
    for f in far:
        assert m[values.index(f)] == f


def test_scores_beyond_the_tolerance_are_left_alone_and_rtol_zero_is_the_identity():
    s = torch.tensor([[[3.0, 2.0, 1.0, 1.0 - 1e-7, -5.0, -math.inf]]])
    assert torch.equal(merge_near_ties(s, 0.0), s)
    assert merge_near_ties(s, RTOL).tolist() == [[[3.0, 2.0, 1.0, 1.0, -5.0, -math.inf]]]


@pytest.mark.parametrize("shape", [(2, 3, 5), (1, 1, 2), (3, 2, 0)])
def test_every_row_and_head_is_merged_alone(shape):
    g = torch.Generator().manual_seed(0)
    s = torch.randn(shape, generator=g)
    if shape[-1]:
        s[..., 0] = 1.0
        s[0, 0, -1] = nudged(1.0, -1)  # ties with slot 0 in (0, 0) only
    m = merge_near_ties(s, RTOL)
    want = s.clone()
    if shape[-1]:
        want[0, 0, -1] = 1.0
    assert torch.equal(m, want)
