"""Incremental detokenisation: each new token costs the decode of a few tokens, not of the whole text.

Decoding the whole sequence at every step makes streaming quadratic in the output length. An
:class:`IncrementalDetokenizer` instead decodes a short window — the tokens since the last emitted
text boundary — twice (with and without the new token) and emits the difference. A window that ends
inside a multi-byte character (the decoder gives U+FFFD) waits for the next token, so a character is
never emitted half. For the byte-level BPE tokenizers of the supported models the concatenated
deltas equal the decode of the whole sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

#: Decodes token ids to text (special tokens skipped).
Decode = Callable[[Sequence[int]], str]


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Args:
        decode: ``decode(ids) -> text``, e.g. :meth:`beaconkv.Tokenizer.decode`.

    Attributes:
        ids: Every token pushed so far.
        text: Every delta emitted so far, concatenated.
        decoded_tokens: Tokens handed to ``decode`` so far (the cost: O(new tokens), not O(n²)).
    """

    def __init__(self, decode: Decode) -> None:
        self._decode = decode
        self.ids: list[int] = []
        self.text = ""
        self.decoded_tokens = 0
        self._prefix = 0  # start of the decode window
        self._read = 0  # end of the tokens whose text is already emitted

    def _window(self, start: int, end: int) -> str:
        self.decoded_tokens += end - start
        return self._decode(self.ids[start:end])

    def push(self, token: int) -> str:
        """Adds one token; returns the new text it completes (possibly empty)."""
        self.ids.append(int(token))
        done = self._window(self._prefix, self._read)
        now = self._window(self._prefix, len(self.ids))
        if len(now) <= len(done) or now.endswith("\ufffd"):
            return ""  # nothing printable yet (a partial character, or a token without text)
        delta = now[len(done):]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta
