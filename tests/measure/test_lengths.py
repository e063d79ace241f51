"""The length effect (``beaconkv lengths``): the repetition metric and the table against FullKV."""

from __future__ import annotations

import pytest

from beaconkv.measure.lengths import (
    LengthRun,
    length_change_interval,
    lengths_table,
    read_length_runs,
    repeated_ngram_rate,
)

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
    assert "| full | — | 40.0 | — | — | 40 | 100% | 0.150 | 0.0 |" in table
    assert "| snapkv | 16 | 40.0 | +0.0% | -25% to +25% | 40 | 50% | 0.200 | 2.0 |" in table
    assert "| beacon | 16 | 60.0 | +50.0% | +50% to +50% | 60 | 100% | 0.500 | 4.0 |" in table


def _run(lengths, policy="snapkv"):
    return LengthRun(policy, 16, list(lengths), [True] * len(lengths), [0.0] * len(lengths), [0] * len(lengths), 0.0)


def test_the_interval_is_paired_and_covers_the_change():
    ref = _run(range(100, 3300, 100), "full")  # 32 prompts of very different lengths
    shifted = _run([n + 10 for n in ref.lengths])  # every prompt 10 tokens longer: little doubt
    low, high = length_change_interval(shifted, ref)
    change = shifted.mean_length / ref.mean_length - 1
    assert 0 < low <= change <= high < 0.02  # pairing removes the spread between prompts
    noisy = _run([n + (300 if i % 2 else -300) for i, n in enumerate(ref.lengths)])
    low, high = length_change_interval(noisy, ref)
    assert low < 0 < high  # an even mix of longer and shorter: no effect can be claimed
    assert length_change_interval(noisy, ref) == (low, high)  # seeded
    with pytest.raises(ValueError, match="32 and 2 prompts"):
        length_change_interval(shifted, _run([1, 2]))
    with pytest.raises(ValueError, match="level=1.5"):
        length_change_interval(shifted, ref, level=1.5)


def test_the_csv_reads_back_into_the_same_table(tmp_path):
    path = tmp_path / "lengths.csv"
    path.write_text("policy,budget,problem,length,stopped,rep4,evictions\n"
                    "full,,a,40,0,0.1000,0\nfull,,b,40,0,0.2000,0\n"
                    "snapkv,16,a,50,1,0.3000,3\nsnapkv,16,b,30,0,0.1000,1\n")
    runs = read_length_runs(path)
    assert [(r.policy, r.budget, r.lengths, r.stopped, r.evictions) for r in runs] == [
        ("full", None, [40, 40], [False, False], [0, 0]), ("snapkv", 16, [50, 30], [True, False], [3, 1])]
    assert runs[1].rep == [0.3, 0.1]
    assert "| snapkv | 16 | 40.0 | +0.0% |" in lengths_table(runs)
    bad = tmp_path / "other.csv"
    bad.write_text("x,y\n1,2\n")
    with pytest.raises(ValueError, match="not a lengths.csv"):
        read_length_runs(bad)


def test_the_plot_draws_every_run_with_its_interval(tmp_path):
    from beaconkv.measure.lengths import plot_lengths

    runs = [_run([40, 80, 120], "full"), _run([50, 70, 130]), LengthRun("snapkv", 32, [45, 85, 110], [True] * 3,
                                                                     [0.1] * 3, [1] * 3, 0.0)]
    path = plot_lengths(runs, tmp_path / "lengths.png")
    assert path.stat().st_size > 10_000 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
