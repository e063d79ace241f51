"""Decide whether a program's output equals the expected output, exactly where exactness is due.

The code grader (:mod:`beaconkv.eval.code_grading`) compares two kinds of output:

* **stdin tests**: the program's stdout against the expected text, line by line (split on ``"\\n"``,
  trailing whitespace of each line and blank lines at either end ignored). A line that differs
  matches only if its whitespace-separated tokens match one by one (:func:`tokens_match`).
* **functional tests**: the JSON value the program's function returned against the expected JSON
  value (:func:`json_values_match`); lists and objects element by element, tuples having become
  lists.

Numbers follow LiveCodeBench: **integers compare exactly** (``1000000000`` is not ``1000000007``,
however close their ratio), decimals compare by value (``0.50`` equals ``0.5``, ``1.0`` equals
``1``), and a tolerance of 1e-6 (relative or absolute) applies only when either side is written as a
float (a ``.``, an exponent, ``inf`` or ``nan``; ``nan`` matches ``nan``). The arithmetic is :mod:`decimal`'s, with an
exponent range wide enough for any literal, so no number overflows (``2**1100`` and ``1e400`` compare
like any other) and integers are never converted to Python ``int`` beyond a few thousand digits
(Python refuses to, and the conversion is quadratic).

Everything here is total: for any pair of strings or JSON texts it returns ``True`` or ``False``
and never raises, and it holds at most one line of each output in extra memory (the inputs are
walked, never split into lists), so a program printing millions of short lines cannot exhaust the
grader's memory.
"""

from __future__ import annotations

import decimal
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["LongInt", "json_values_match", "outputs_match", "parse_json_value", "tokens_match"]

#: Relative and absolute tolerance between two numbers when either is written as a float.
TOLERANCE = decimal.Decimal("1e-6")

#: Integers longer than this (in digits) stay text (:class:`LongInt`): Python's ``int`` refuses
#: longer ones by default (4300 digits) and converts them in quadratic time.
_LONG_INT_DIGITS = 4000

_INTEGER = re.compile(r"[+-]?[0-9]+")
_FLOAT_MARK = re.compile(r"[.eEiInN]")  # a point, an exponent, inf or nan: written as a float

# Exact comparison needs no precision; the tolerance test needs a few digits and room for any
# exponent a literal can carry. Traps off: an invalid operation gives NaN, which compares False.
_CONTEXT = decimal.Context(
    prec=40, Emax=decimal.MAX_EMAX, Emin=decimal.MIN_EMIN, traps=[], flags=[]
)


@dataclass(frozen=True)
class LongInt:
    """A JSON integer too long for Python's ``int``, kept as its canonical decimal text.

    Attributes:
        text: The digits with an optional leading ``-``, no leading zeros (``"-0"`` is ``"0"``).
    """

    text: str

    @classmethod
    def parse(cls, literal: str) -> LongInt | int:
        """An integer literal as ``int`` when short, else as a :class:`LongInt`.

        Args:
            literal: Digits with an optional sign.

        Returns:
            The value.
        """
        if len(literal) <= _LONG_INT_DIGITS:
            return int(literal)
        return cls(_canonical_integer(literal))


def _canonical_integer(literal: str) -> str:
    digits = literal.lstrip("+-").lstrip("0")
    if not digits:
        return "0"  # "-0", "+000"
    return ("-" if literal.startswith("-") else "") + digits


def _decimal(text: str) -> decimal.Decimal | None:
    """``text`` as a Decimal, or ``None`` if it is not a number literal."""
    try:
        value = decimal.Decimal(text.strip())
    except (decimal.InvalidOperation, ValueError):
        return None
    return None if value.is_snan() else value


def _close(a: decimal.Decimal, b: decimal.Decimal) -> bool:
    """Whether two numbers agree within :data:`TOLERANCE`, relative or absolute."""
    if a == b or (a.is_nan() and b.is_nan()):
        return True  # nan matches nan, as the text "nan" matches itself
    if not (a.is_finite() and b.is_finite()):
        return False  # inf only equals inf of its sign (above)
    with decimal.localcontext(_CONTEXT):
        scale = max(abs(a), abs(b))
        return abs(a - b) <= max(TOLERANCE, TOLERANCE * scale)


def tokens_match(got: str, want: str) -> bool:
    """Whether two whitespace-free tokens of output match.

    Equal texts match; two integers match when their values are equal (exactly, ``+5`` and
    ``005`` equal ``5``); other numbers when their decimal values are equal, or within 1e-6 when
    either side is written as a float. Anything else must be equal as text.

    Args:
        got: A token of the program's output.
        want: The token expected there.

    Returns:
        ``True`` if they match; never raises.
    """
    if got == want:
        return True
    if _INTEGER.fullmatch(got) and _INTEGER.fullmatch(want):
        return _canonical_integer(got) == _canonical_integer(want)
    a, b = _decimal(got), _decimal(want)
    if a is None or b is None:
        return False
    if a == b:
        return True
    if _FLOAT_MARK.search(got) or _FLOAT_MARK.search(want):
        return _close(a, b)
    return False


def _content_end(text: str) -> int:
    """The length of ``text`` without its trailing whitespace, found without copying the text."""
    end = len(text)
    while end > 0:
        start = max(0, end - 4096)
        kept = len(text[start:end].rstrip())
        if kept:
            return start + kept
        end = start
    return 0


def _lines(text: str) -> Iterator[str]:
    """The lines of ``text`` without trailing whitespace and without blank lines at either end.

    Walks the text a block of about 16 K characters at a time (cut at a newline): one block's lines are held,
    never a list of all of them.
    """
    end = _content_end(text)
    start = 0
    leading = True  # still skipping the blank lines at the start
    while start < end:
        cut = text.find("\n", min(start + _BLOCK_CHARS, end), end)
        stop = end if cut < 0 else cut
        for line in text[start:stop].split("\n"):
            line = line.rstrip()
            if leading and not line:
                continue
            leading = False
            yield line
        start = stop + 1


_BLOCK_CHARS = 1 << 14
_MISSING = object()


def outputs_match(got: str, want: str) -> bool:
    """Compare a program's stdout with the expected output of a stdin test.

    Lines are split on ``"\\n"``, compared after stripping trailing whitespace, with blank lines
    at the start and end ignored; a line that differs as text matches when its whitespace-separated
    tokens match one by one (:func:`tokens_match`: integers exactly, floats within 1e-6).
    Memory beyond the two texts stays at one line of each.

    Args:
        got: Actual stdout.
        want: Expected stdout.

    Returns:
        ``True`` if they match; never raises.
    """
    want_lines = _lines(want)
    for g in _lines(got):
        w = next(want_lines, _MISSING)
        if w is _MISSING:
            return False  # more lines than expected
        assert isinstance(w, str)
        if g == w:
            continue
        gt, wt = g.split(), w.split()
        if len(gt) != len(wt) or not all(tokens_match(a, b) for a, b in zip(gt, wt)):
            return False
    return next(want_lines, _MISSING) is _MISSING


def _json_constant(name: str) -> decimal.Decimal:
    return decimal.Decimal({"NaN": "NaN", "Infinity": "Infinity", "-Infinity": "-Infinity"}[name])


def parse_json_value(text: str) -> Any:
    """Parse a JSON text with exact numbers: integers as ``int`` (:class:`LongInt` past 4000
    digits), other numbers, ``NaN`` and ``Infinity`` as :class:`decimal.Decimal`.

    Args:
        text: A JSON text.

    Returns:
        The value.

    Raises:
        ValueError: The text is not JSON.
        RecursionError: It nests deeper than the interpreter's recursion limit.
    """
    return json.loads(
        text, parse_int=LongInt.parse, parse_float=decimal.Decimal, parse_constant=_json_constant
    )


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, decimal.Decimal, LongInt)) and not isinstance(value, bool)


def _as_decimal(value: int | decimal.Decimal | LongInt) -> decimal.Decimal:
    if isinstance(value, LongInt):
        return decimal.Decimal(value.text)
    return value if isinstance(value, decimal.Decimal) else decimal.Decimal(value)


def _numbers_match(got: Any, want: Any) -> bool:
    if isinstance(got, decimal.Decimal) or isinstance(want, decimal.Decimal):
        return _close(_as_decimal(got), _as_decimal(want))  # a float on either side: tolerance
    return got == want  # int or LongInt: exact (a LongInt never equals a short int)


def json_values_match(got: Any, want: Any) -> bool:
    """Compare a function's returned value with the expected one, both from :func:`parse_json_value`.

    Booleans match only booleans; integers match exactly; a number written as a float on either
    side matches within 1e-6 (relative or absolute); lists element by element (same length);
    objects by equal keys and matching values; anything else by equality. Nesting is walked with
    an explicit stack, so a deep value cannot exhaust the recursion limit.

    Args:
        got: The returned value.
        want: The expected value.

    Returns:
        ``True`` if they match; never raises.
    """
    stack = [(got, want)]
    while stack:
        g, w = stack.pop()
        if isinstance(g, bool) or isinstance(w, bool):
            if g is not w:
                return False
        elif _is_number(g) and _is_number(w):
            if not _numbers_match(g, w):
                return False
        elif isinstance(g, list) and isinstance(w, list):
            if len(g) != len(w):
                return False
            stack.extend(zip(g, w))
        elif isinstance(g, dict) and isinstance(w, dict):
            if g.keys() != w.keys():
                return False
            stack.extend((g[k], w[k]) for k in g)
        elif type(g) is not type(w) or g != w:
            return False
    return True
