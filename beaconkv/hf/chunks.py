"""How a :class:`~beaconkv.hf.PolicyCache` cuts a multi-token forward into model calls: each row's chunks.

A forward's tokens reach the cache in transformers' layout: ``(batch, columns)``, a 2D ``attention_mask``
marking each row's real tokens (left padding, or any other holes). The native session writes a row's
tokens ``N`` at a time from the row's own first token (:meth:`~beaconkv.session.Session.prefill` with
``chunk=N``), the policy acting after each chunk. The columns of one forward are shared by every row, so a
left-padded row's chunks end at other columns than its neighbours': :func:`plan_pieces` cuts the forward
at every column where some row's chunk ends. Each **piece** (a column range) is then one model call, no
piece holds tokens of two chunks of a row, and a row's chunk ends exactly at the end of a piece, where
the policy acts for that row. A row's chunks are therefore the native's whatever batch it is in; a chunk
may span several pieces (its row's neighbours were cut there), and is observed once it is whole.

Pure host arithmetic over the mask, so the cut is tested on its own (``tests/hf/test_chunks.py``).
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass


@dataclass(frozen=True)
class RowPiece:
    """One row's tokens in one piece.

    Attributes:
        row: The row.
        columns: The forward's columns holding them, in order.
        positions: Their positions (consecutive: the row's tokens are numbered from its start).
        whole: Whether they are the row's whole chunk (it neither began in an earlier piece nor goes on).
        done: Whether the row's chunk ends with this piece (the policy then acts for the row).
        chunk_tokens: Tokens of the chunk these belong to (the piece's and its earlier pieces').
        first: Whether that chunk is the first of a prompt (written and observed as its prefill).
    """

    row: int
    columns: list[int]
    positions: list[int]
    whole: bool
    done: bool
    chunk_tokens: int
    first: bool


@dataclass(frozen=True)
class Piece:
    """Columns ``begin .. end - 1`` of a forward, run as one model call.

    Attributes:
        begin: First column.
        end: One past the last column.
        rows: The rows with tokens in it (ascending).
    """

    begin: int
    end: int
    rows: list[RowPiece]

    @property
    def done(self) -> list[RowPiece]:
        """The rows whose chunk ends with this piece."""
        return [r for r in self.rows if r.done]


def plan_pieces(valid: list[list[bool]], starts: list[int], chunk: int | None, prompt: bool) -> list[Piece]:
    """Cuts a forward's columns into pieces so that every row's chunks end at a piece's end.

    Row ``b``'s real tokens (``valid[b][c]``) are numbered ``starts[b], starts[b] + 1, ...`` in column order
    and grouped ``chunk`` at a time from its first one (its last chunk may be shorter). The cuts are the
    columns after each chunk's last token; the last piece runs to the forward's end. A forward whose rows
    all fit one chunk is one piece.

    Args:
        valid: ``(batch, columns)`` whether each column holds a real token of the row.
        starts: The position of each row's first token of this forward.
        chunk: Tokens per chunk (None: all of a row's tokens are one chunk).
        prompt: Whether the forward is a prompt's (the rows' first chunks are their prefills).

    Returns:
        The pieces, in column order, covering every column (a forward of no real token: one empty piece).

    Raises:
        ValueError: ``chunk`` is not a positive int, or ``starts`` has another length than ``valid``.
    """
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"chunk={chunk!r} must be a positive int (tokens per chunk) or None.")
    if len(starts) != len(valid):
        raise ValueError(f"{len(starts)} starts for {len(valid)} rows; give one start position per row.")
    n = len(valid[0]) if valid else 0
    columns = [[c for c, ok in enumerate(row) if ok] for row in valid]
    size = chunk if chunk is not None else max(n, 1)
    ends = sorted({cols[min(j + size, len(cols)) - 1] + 1 for cols in columns for j in range(0, len(cols), size)})
    cuts = [*ends[:-1], n] if ends else [n]  # the last piece runs to the forward's end (trailing padding)
    pieces, begin = [], 0
    for end in cuts:
        rows = []
        for b, cols in enumerate(columns):
            inside = range(bisect_left(cols, begin), bisect_left(cols, end))  # ranks of the row's tokens here
            if not inside:
                continue
            j = inside[0] // size  # the chunk they belong to (a piece never holds two chunks of a row)
            lo, hi = j * size, min((j + 1) * size, len(cols)) - 1  # the chunk's first and last ranks
            rows.append(RowPiece(
                row=b, columns=[cols[i] for i in inside], positions=[starts[b] + i for i in inside],
                whole=cols[lo] >= begin and cols[hi] < end, done=cols[hi] < end, chunk_tokens=hi - lo + 1,
                first=prompt and j == 0))
        pieces.append(Piece(begin, end, rows))
        begin = end
    return pieces
