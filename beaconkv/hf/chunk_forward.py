"""One multi-token forward of a :class:`~beaconkv.hf.PolicyCache` after (or instead of) a whole-prompt prefill.

What the native session does with :meth:`~beaconkv.session.Session.extend` and a chunked
:meth:`~beaconkv.session.Session.prefill`, inside transformers' forward: the forward's columns are cut into
pieces (:func:`~beaconkv.hf.chunks.plan_pieces`), each one model call; in each piece every policy layer

1. writes each row's tokens after the row's held slots (:meth:`~beaconkv.cache.LayerKVCache.write_chunk`,
   the row's real tokens packed to the front: left padding and holes are not written);
2. attends over every held slot whose position is no later than the query's
   (:meth:`~beaconkv.cache.LayerKVCache.attend_chunk`, or with gpt-oss's sinks and a soft-cap as the model's
   eager attention applies them) — transformers' mask describes logical columns and is not used here;
3. hands the pre-RoPE queries to the layer's observer: a row's first prompt chunk as its prefill
   (:meth:`~beaconkv.policies.observer.ObservedLayer.prefill`), any later chunk as a chunk
   (:meth:`~beaconkv.policies.observer.ObservedLayer.chunk`). A chunk cut over several pieces (its row's
   neighbours were cut there) is kept until it is whole, then observed at once, as the native session does.

After the piece, the policy acts for the rows whose chunk ended there
(:meth:`~beaconkv.policies.PolicyDriver.after_prefill` for a first chunk,
:meth:`~beaconkv.policies.PolicyDriver.after_chunk` for the others): its bookkeeping, then the evictions
due, so the next chunk finds room. Eager work: every piece reads the rows' lengths on the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..cache import KVCache
from ..policies import PolicyDriver
from .chunks import Piece, RowPiece
from .errors import PolicyCacheError
from .rotary import Layout, invert_rotary


@dataclass
class PieceTensors:
    """The current piece on the device: each row's tokens packed to the front (right-padded).

    Attributes:
        piece: The piece.
        rows: ``(r,)`` the rows with tokens in it.
        columns: ``(r, w)`` the columns (relative to the piece's first) holding each row's tokens.
        positions: ``(r, w)`` their positions (padding goes on counting, as the native chunk's).
        valid: ``(r, w)`` False on padding.
    """

    piece: Piece
    rows: Tensor
    columns: Tensor
    positions: Tensor
    valid: Tensor

    @classmethod
    def build(cls, piece: Piece, device: torch.device) -> PieceTensors:
        """Packs ``piece``'s rows onto ``device``."""
        w = max((len(r.columns) for r in piece.rows), default=0)

        # padding repeats a row's last column: gathered, then never written (invalid) nor scattered back
        columns = [[c - piece.begin for c in r.columns] + [r.columns[-1] - piece.begin] * (w - len(r.columns))
                   for r in piece.rows]
        positions = [[r.positions[0] + i for i in range(w)] for r in piece.rows]  # a row's tokens are consecutive
        valid = [[True] * len(r.columns) + [False] * (w - len(r.columns)) for r in piece.rows]
        as_tensor = lambda x, dtype: torch.tensor(x, dtype=dtype, device=device).view(len(piece.rows), w)  # noqa: E731
        return cls(piece, torch.tensor([r.row for r in piece.rows], dtype=torch.long, device=device),
                   as_tensor(columns, torch.long), as_tensor(positions, torch.long), as_tensor(valid, torch.bool))

    def gather(self, x: Tensor) -> Tensor:
        """``x`` ``(batch, heads, columns, width)`` as ``(r, heads, w, width)``: each row's tokens, packed."""
        x = x[self.rows]
        index = self.columns[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3])
        return torch.gather(x, 2, index)

    def scatter(self, packed: Tensor, batch: int, width: int) -> Tensor:
        """The inverse of :meth:`gather` on the real tokens: ``(batch, heads, width, d)``, zero elsewhere."""
        out = packed.new_zeros(batch, packed.shape[1], width, packed.shape[3])
        i, j = self.valid.nonzero(as_tuple=True)
        out[self.rows[i], :, self.columns[i, j]] = packed[i, :, j]
        return out


def attend_chunk_with_sinks(q: Tensor, keys: Tensor, values: Tensor, visible: Tensor, scale: float,
                            sinks: Tensor | None, softcap: float | None) -> Tensor:
    """A chunk's attention over a store, as transformers' eager attention computes it with attention sinks
    (gpt-oss) and logit soft-capping.

    Args:
        q: ``(b, kv_heads, group, L, head_dim)`` post-RoPE queries.
        keys: ``(b, kv_heads, capacity, head_dim)``.
        values: Same shape.
        visible: ``(b, kv_heads, L, capacity)`` the slots each query sees.
        scale: Logit scale.
        sinks: ``(heads,)`` per-head sink logits (None: no sink).
        softcap: ``tanh`` soft-cap of the logits (None: none).

    Returns:
        ``(b, kv_heads, group, L, head_dim)``.
    """
    logits = torch.matmul(q, keys[:, :, None].transpose(-1, -2)) * scale  # (b, kv_heads, group, L, capacity)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.masked_fill(~visible[:, :, None], torch.finfo(logits.dtype).min)
    if sinks is not None:
        B, kv, g, L, _ = logits.shape
        sink = sinks.to(logits.dtype).view(1, kv, g, 1, 1).expand(B, kv, g, L, 1)
        logits = torch.cat([logits, sink], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        weights = logits.softmax(-1)[..., :-1]
    else:
        weights = logits.softmax(-1)
    return torch.matmul(weights.to(values.dtype), values[:, :, None])


class ChunkedForward:
    """A multi-token forward of a :class:`~beaconkv.hf.PolicyCache`, piece by piece (see the module docstring).

    Args:
        pieces: The forward's pieces (:func:`~beaconkv.hf.chunks.plan_pieces`).
        store: The policy layers' store.
        observers: Each policy layer's observer (``prefill`` and ``chunk`` with a ``rows`` argument, as
            :class:`~beaconkv.policies.observer.ObservedLayer`'s).
        driver: The :class:`~beaconkv.policies.PolicyDriver` running the policy over ``store``.
        layout: The model's rotary layout (to undo the rotation of the queries).
    """

    def __init__(self, pieces: list[Piece], store: KVCache, observers: list[Any], driver: PolicyDriver,
                 layout: Layout) -> None:
        self.pieces, self.store, self.observers = pieces, store, observers
        self.driver, self.layout = driver, layout
        self.current: PieceTensors | None = None
        self._index = -1
        self._pending: dict[tuple[int, int], list[Tensor]] = {}  # (layer, row) -> its chunk's queries so far

    @property
    def columns(self) -> list[tuple[int, int]]:
        """Each piece's columns ``(begin, end)``."""
        return [(p.begin, p.end) for p in self.pieces]

    def begin(self, k: int) -> None:
        """Starts piece ``k``.

        Raises:
            PolicyCacheError: A row has no room for the piece's tokens (its store would overflow).
        """
        piece = self.pieces[k]
        self._index = k
        if piece.rows:
            held = torch.stack([layer.length for layer in self.store.layers]).amax(0).tolist()
            over = [(r.row, held[r.row], len(r.columns)) for r in piece.rows
                    if held[r.row] + len(r.columns) > self.store.capacity]
            if over:
                b, n, more = over[0]
                raise PolicyCacheError(
                    f"row {b} holds {n} of its {self.store.capacity} slots and this forward writes {more} more tokens "
                    "to it before the policy can act: pass a larger max_new_tokens (it counts every token after the "
                    "prompt, a question's included) or prefill_chunk=N (a long forward is then written N tokens at a "
                    "time, the policy evicting between). The cache is half-written: reset() it.")
        self.current = PieceTensors.build(piece, self.store.device)

    def write(self, index: int, keys: Tensor, values: Tensor) -> None:
        """Writes policy layer ``index``'s keys and values ``(batch, kv_heads, columns, head_dim)`` of the piece
        after each row's held slots."""
        p = self.current
        if p.piece.rows:
            self.store[index].write_chunk(p.gather(keys), p.gather(values), p.positions, p.valid, rows=p.rows)

    def attend(self, index: int, query: Tensor, cos: Tensor, sin: Tensor, scaling: float,
               sinks: Tensor | None = None, softcap: float | None = None) -> Tensor:
        """Policy layer ``index``'s attention of the piece over its store; its observer sees the queries.

        Args:
            index: The policy layer.
            query: ``(batch, heads, columns, head_dim)`` post-RoPE queries.
            cos: The layer's rotary ``cos`` ``(batch or 1, columns, width)``.
            sin: Its ``sin``.
            scaling: Logit scale.
            sinks: ``(heads,)`` attention-sink logits (gpt-oss), or None.
            softcap: Logit soft-cap, or None.

        Returns:
            ``(batch, columns, heads, head_dim)``, transformers' layout of an attention output (zero on
            padding).
        """
        p = self.current
        B, H, width, d = query.shape
        if not p.piece.rows:
            return query.new_zeros(B, width, H, d)
        layer = self.store[index]
        q = p.gather(query)  # (r, heads, w, head_dim)
        if sinks is None and softcap is None:
            out = layer.attend_chunk(q, p.positions, scaling, rows=p.rows)  # the native chunk's own attention
        else:
            pos = layer.positions(p.rows)  # (r, kv_heads, capacity)
            visible = (pos[:, :, None, :] >= 0) & (pos[:, :, None, :] <= p.positions[:, None, :, None])
            r, w = q.shape[0], q.shape[2]
            qg = q.view(r, layer.n_kv_heads, layer.group, w, d)  # r (kv g) w d -> r kv g w d
            out = attend_chunk_with_sinks(qg, layer.keys(p.rows), layer.values(p.rows), visible, scaling, sinks,
                                          softcap).reshape(r, H, w, d)
        tables = [p.gather(t.expand(B, -1, -1)[:, None]) for t in (cos, sin)]  # (r, 1, w, width)
        self._observe(index, invert_rotary(q, *tables, self.layout))
        return p.scatter(out, B, width).transpose(1, 2)

    def end(self) -> None:
        """Observes the chunks that became whole in the piece (cut over several pieces)."""
        done = [r for r in self.pieces[self._index].rows if r.done and not r.whole]
        for index in range(len(self.observers)):
            for first in (True, False):
                rows = [r for r in done if r.first == first]
                if not rows:
                    continue
                parts = [torch.cat(self._pending.pop((index, r.row)), dim=1) for r in rows]  # (heads, n, head_dim)
                w = max(q.shape[1] for q in parts)
                q = torch.stack([torch.nn.functional.pad(q, (0, 0, 0, w - q.shape[1])) for q in parts])
                device = q.device
                n = torch.tensor([r.chunk_tokens for r in rows], device=device)
                start = torch.tensor([r.positions[-1] + 1 - r.chunk_tokens for r in rows], device=device)
                steps = torch.arange(w, device=device)
                self._tell(index, first, torch.tensor([r.row for r in rows], device=device), q,
                           start[:, None] + steps, steps[None] < n[:, None])

    def act(self) -> None:
        """The policy's work for the rows whose chunk ended with the piece: its bookkeeping, then evictions."""
        done = self.pieces[self._index].done
        firsts = [r.row for r in done if r.first]
        later = [r for r in done if not r.first]
        if firsts:
            self.driver.after_prefill(firsts)
        if later:
            self.driver.after_chunk([r.row for r in later], [r.chunk_tokens for r in later])

    # ------------------------------------------------------------------------------- internals
    def _observe(self, index: int, q_pre: Tensor) -> None:
        """Hands a whole chunk's queries to the observer now; keeps a partial chunk's until it is whole."""
        p = self.current
        rows: list[RowPiece] = p.piece.rows
        for first in (True, False):
            local = [i for i, r in enumerate(rows) if r.whole and r.first == first]
            if local:
                at = torch.tensor(local, device=q_pre.device)
                self._tell(index, first, p.rows[at], q_pre[at], p.positions[at], p.valid[at])
        for i, r in enumerate(rows):
            if not r.whole:
                self._pending.setdefault((index, r.row), []).append(q_pre[i, :, :len(r.columns)])

    def _tell(self, index: int, first: bool, rows: Tensor, q_pre: Tensor, positions: Tensor, valid: Tensor) -> None:
        """One observer call: a prompt's first chunk as its prefill, any other as a chunk."""
        observer = self.observers[index]
        if first:
            observer.prefill(q_pre, positions, valid, rows)
        else:
            observer.chunk(q_pre, positions, valid, rows)
