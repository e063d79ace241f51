"""Sampling parameters: every bad value is rejected with a message naming it and the allowed range."""

from __future__ import annotations

import math

import pytest

from beaconkv.sampling import SamplingParams


@pytest.mark.parametrize("kwargs,fragment", [
    ({"temperature": math.nan}, "temperature=nan must be a finite number (>= 0; 0 = greedy)"),
    ({"temperature": math.inf}, "temperature=inf must be a finite number"),
    ({"temperature": -math.inf}, "temperature=-inf must be a finite number"),
    ({"temperature": -0.1}, "temperature=-0.1 must be >= 0 (0 = greedy)"),
    ({"top_p": math.nan}, "top_p=nan must be a finite number (in (0, 1]; 1 = off)"),
    ({"top_p": 0.0}, "top_p=0.0 must lie in (0, 1]"),
    ({"top_p": 1.5}, "top_p=1.5 must lie in (0, 1]"),
    ({"top_k": -1}, "top_k=-1 must be >= 0 (0 = off)"),
    ({"top_k": 2.5}, "top_k=2.5 must be an int >= 0"),
    ({"temperature": "0.7"}, "temperature='0.7' must be a finite number"),
])
def test_bad_sampling_parameters_are_rejected(kwargs, fragment):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert fragment in str(err.value)


def test_good_sampling_parameters():
    assert SamplingParams().greedy and SamplingParams(0.6, 0.95, 0).temperature == 0.6
    assert SamplingParams(1.0, 1.0, 1).greedy  # top_k=1 is an argmax
