"""The length effect (``beaconkv lengths``): the repetition metric and the table against FullKV."""

from __future__ import annotations

import pytest

from beaconkv.measure.lengths import LengthRun, lengths_table, repeated_ngram_rate

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("tokens, n, rate", [
    ([], 4, 0.0), ([1, 2, 3], 4, 0.0), ([1, 2, 3, 4, 5], 2, 0.0),
    ([1, 2, 1, 2, 1, 2], 2, 1 - 2 / 5),  # grams (1,2),(2,1),(1,2),(2,1),(1,2): 2 distinct of 5
    ([7] * 10, 4, 1 - 1 / 7),
])
def test_repeated_ngram_rate(tokens, n, rate):
    assert repeated_ngram_rate(tokens, n) == pytest.approx(rate)


def test_repeated_ngram_rate_refuses_a_span_below_one():
    with pytest.raises(ValueError, match="n=0"):
        repeated_ngram_rate([1, 2], 0)


def test_the_table_compares_each_run_with_fullkv():
    table = lengths_table([LengthRun("full", None, [40, 40], [False, False], [0.1, 0.2], [0, 0], 1.0),
                           LengthRun("snapkv", 16, [50, 30], [True, False], [0.3, 0.1], [3, 1], 1.0),
                           LengthRun("beacon", 16, [60, 60], [False, False], [0.5, 0.5], [4, 4], 1.0)])
    assert "| full | — | 40.0 | — | 40 | 100% | 0.150 | 0.0 |" in table
    assert "| snapkv | 16 | 40.0 | +0.0% | 40 | 50% | 0.200 | 2.0 |" in table
    assert "| beacon | 16 | 60.0 | +50.0% | 60 | 100% | 0.500 | 4.0 |" in table
