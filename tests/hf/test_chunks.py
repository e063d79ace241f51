"""How a PolicyCache cuts a forward into model calls (:func:`beaconkv.hf.chunks.plan_pieces`): every row's chunks
are the native session's (``N`` tokens from its own first token), whatever padding or neighbours it has."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from beaconkv.hf.chunks import plan_pieces


def row_chunks(valid_row: list[bool], size: int) -> list[list[int]]:
    """The columns of each of a row's chunks, as the native session cuts its tokens."""
    cols = [c for c, ok in enumerate(valid_row) if ok]
    return [cols[j:j + size] for j in range(0, len(cols), size)]


@st.composite
def forwards(draw):
    """A forward's mask (left-padded rows, or any holes), its rows' starts, a chunk size and its kind."""
    batch, n = draw(st.integers(1, 4)), draw(st.integers(1, 40))
    if draw(st.booleans()):  # transformers' left padding, every row ends at the last column
        lengths = draw(st.lists(st.integers(0, n), min_size=batch, max_size=batch))
        valid = [[c >= n - L for c in range(n)] for L in lengths]
    else:
        valid = draw(st.lists(st.lists(st.booleans(), min_size=n, max_size=n), min_size=batch, max_size=batch))
    starts = draw(st.lists(st.integers(0, 50), min_size=batch, max_size=batch))
    return valid, starts, draw(st.one_of(st.none(), st.integers(1, 12))), draw(st.booleans())


@settings(max_examples=80, deadline=None)
@given(case=forwards())
def test_every_rows_chunks_end_with_a_piece_and_are_the_natives(case):
    valid, starts, chunk, prompt = case
    n = len(valid[0])
    pieces = plan_pieces(valid, starts, chunk, prompt)
    assert pieces[0].begin == 0 and pieces[-1].end == n  # the pieces cover the forward, in order, none empty
    assert all(p.begin < p.end for p in pieces) and all(a.end == b.begin for a, b in zip(pieces, pieces[1:]))
    for b, row in enumerate(valid):
        size = chunk or n
        want = row_chunks(row, size)
        seen, got, current = [], [], []
        for piece in pieces:
            mine = [r for r in piece.rows if r.row == b]
            assert len(mine) <= 1
            if not mine:
                assert not any(row[piece.begin:piece.end])
                continue
            (r,) = mine
            assert r.columns == [c for c in range(piece.begin, piece.end) if row[c]]
            current += r.columns
            assert r.positions == [starts[b] + len(seen) + i for i in range(len(r.columns))]  # consecutive
            seen += r.columns
            if r.done:  # the chunk ends here: the policy acts for this row after this piece
                got.append(current)
                assert r.chunk_tokens == len(current) and r.whole == (current == r.columns)
                assert r.first == (prompt and len(got) == 1)
                current = []
            else:
                assert len(current) < size
        assert got == want and current == []
    assert all(len(r.columns) <= (chunk or n) for p in pieces for r in p.rows)


def test_left_padding_cuts_at_each_rows_own_chunk_ends():
    # row 0 is left-padded by 3: its chunks of 4 end at columns 7, 11, 13; row 1's at 4, 8, 12, 13
    pieces = plan_pieces([[False] * 3 + [True] * 10, [True] * 13], [0, 0], 4, prompt=True)
    assert [(p.begin, p.end) for p in pieces] == [(0, 4), (4, 7), (7, 8), (8, 11), (11, 12), (12, 13)]
    assert [[(r.row, r.done) for r in p.rows] for p in pieces[:2]] == [[(0, False), (1, True)], [(0, True), (1, False)]]
    assert pieces[1].rows[0].chunk_tokens == 4 and pieces[1].rows[0].first and not pieces[1].rows[0].whole


def test_one_chunk_per_row_is_one_call_and_an_empty_forward_one_empty_call():
    assert [(p.begin, p.end) for p in plan_pieces([[False, True, True], [True] * 3], [5, 9], None, False)] == [(0, 3)]
    assert [(p.begin, p.end, p.rows) for p in plan_pieces([[False] * 4], [0], 2, False)] == [(0, 4, [])]


@pytest.mark.parametrize("chunk", [0, -1, 2.5, True])
def test_a_chunk_size_that_is_not_a_positive_int_is_refused(chunk):
    with pytest.raises(ValueError, match="must be a positive int"):
        plan_pieces([[True]], [0], chunk, True)
