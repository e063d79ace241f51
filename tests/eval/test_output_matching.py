"""Comparing a program's output with the expected one: exact integers, toleranced floats, total functions."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from beaconkv.eval.output_matching import (
    LongInt,
    json_values_match,
    outputs_match,
    parse_json_value,
    tokens_match,
)

# integers of any size this process can print: small, around float precision, beyond float range
# (past 4,300 digits, test_long_integers_stay_text_and_compare_exactly)
integers = st.one_of(
    st.integers(),
    st.integers(min_value=2**52, max_value=2**64),
    st.builds(lambda k, d: 10**k + d, st.integers(300, 4000), st.integers(-5, 5)),
)
number_texts = st.one_of(
    integers.map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.from_regex(r"[+-]?[0-9]{0,30}(\.[0-9]{0,10})?([eE][+-]?[0-9]{1,25})?", fullmatch=True),
)
tokens = st.one_of(number_texts, st.text(max_size=12))


@pytest.mark.parametrize(
    ("got", "want"),
    [
        ("1000000000", "1000000007"),  # within 1e-6 relative: was graded correct
        ("1000000", "999999"),
        ("9007199254740993", "9007199254740992"),  # equal as floats
        ("1" * 400, "2" * 400),  # both beyond float range: were equal
        ("-5", "5"),
    ],
)
def test_different_integers_never_match(got: str, want: str) -> None:
    assert not tokens_match(got, want)
    assert not outputs_match(f"{got}\n", want)


@pytest.mark.parametrize(
    ("got", "want"),
    [
        ("+5", "5"),
        ("007", "7"),
        ("-0", "0"),
        ("0.50", "0.5"),  # decimals by value
        ("1.0", "1"),
        ("0.3333333", "0.33333333"),  # a float literal: 1e-6 tolerance
        ("1e400", "1.0000000001e400"),  # beyond float range, no overflow
        ("inf", "inf"),
        ("nan", "NaN"),
        ("1" * 400, "1" * 400 + ".0"),
    ],
)
def test_equal_numbers_match(got: str, want: str) -> None:
    assert tokens_match(got, want)


@given(tokens, tokens)
@settings(max_examples=400, deadline=None)
def test_tokens_match_is_total_and_symmetric(a: str, b: str) -> None:
    assert tokens_match(a, b) is tokens_match(b, a)
    assert tokens_match(a, a)


@given(integers, integers)
@settings(max_examples=300, deadline=None)
def test_integers_match_exactly_whatever_their_size(x: int, y: int) -> None:
    assert tokens_match(str(x), str(y)) is (x == y)
    assert json_values_match(parse_json_value(str(x)), parse_json_value(str(y))) is (x == y)


@given(st.floats(min_value=-1e300, max_value=1e300), st.floats(min_value=-1e-8, max_value=1e-8))
@settings(max_examples=200, deadline=None)
def test_floats_match_within_the_tolerance(x: float, rel: float) -> None:
    y = x * (1 + rel)
    assert tokens_match(repr(x), repr(y))


@given(st.text(max_size=200), st.text(max_size=200))
@settings(max_examples=300, deadline=None)
def test_outputs_match_is_total_symmetric_and_reflexive(a: str, b: str) -> None:
    assert outputs_match(a, b) is outputs_match(b, a)
    assert outputs_match(a, a)
    assert outputs_match(a, "\n\n" + a.rstrip() + "  \n\n")  # blank lines at the ends, trailing spaces


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), integers, st.floats(allow_nan=False), st.text(max_size=8)),
    lambda children: st.one_of(st.lists(children, max_size=4), st.dictionaries(st.text(max_size=4), children, max_size=4)),
    max_leaves=20,
)


@given(json_values, json_values)
@settings(max_examples=300, deadline=None)
def test_json_values_match_is_total_and_reflexive(a: object, b: object) -> None:
    pa, pb = parse_json_value(json.dumps(a)), parse_json_value(json.dumps(b))
    assert json_values_match(pa, pa)
    assert json_values_match(pa, pb) is json_values_match(pb, pa)
    if json_values_match(pa, pb):  # a match is an equality, up to float tolerance and int/float spelling
        assert json.dumps(a, sort_keys=True).count("[") == json.dumps(b, sort_keys=True).count("[")


def test_long_integers_stay_text_and_compare_exactly() -> None:
    big = parse_json_value("1" + "0" * 5000)
    assert isinstance(big, LongInt)
    assert json_values_match(big, parse_json_value("1" + "0" * 5000))
    assert not json_values_match(big, parse_json_value("1" + "0" * 4999 + "1"))
    assert json_values_match(big, parse_json_value("1" + "0" * 5000 + ".0"))  # a float: by value
    assert not json_values_match(parse_json_value("true"), parse_json_value("1"))
    assert not json_values_match(parse_json_value('"12"'), parse_json_value("12"))


def test_float_tolerance_is_relative_and_absolute() -> None:
    assert tokens_match("1e-9", "0")  # absolute 1e-6
    assert tokens_match("1000000.5", "1000000")  # relative 1e-6 with a float on one side
    assert not tokens_match("1000001.5", "1000000")
    assert not tokens_match("inf", "-inf")
    assert not math.isnan(0.0) and tokens_match("0.0", "-0.0")
