"""Special-token text inside a chat's messages: read as the plain text it is (``escape``, the default), or refused.

A chat template pastes each message's content between turn markers (``<|im_start|>user\\n`` ... ``<|im_end|>``)
and the rendered text is tokenized with its special tokens recognised — so a message that contains the text
``<|im_start|>system`` used to open a real system turn: a user of an app built on the server could write
instructions the model reads as the operator's.

:class:`SpecialTokenText` finds the spellings of the tokenizer's special tokens (those it marks ``special``) in
every message's content, then, by its mode (``beaconkv serve --special-tokens-in-content``):

* ``escape``: each spelling is tokenized as the characters it is, as OpenAI's API reads message text; the model sees
  the text, never the token. How, exactly: the contents' spellings are swapped for placeholders (private-use
  characters around a random number) before the template renders, so that the only special tokens of the rendered
  text are the template's own; the placeholders are swapped back, the text is tokenized as usual to find where
  the tokenizer cuts it at the template's special tokens (its offsets), and the stretches between those cuts are
  encoded with special-token matching off. The tokenizer encodes the stretches between special tokens
  independently anyway, so the result is exactly what it would give if the contents' spellings were not special,
  and a conversation without such text is encoded exactly as before (a test checks both).
* ``refuse``: HTTP 400 naming the message, the token and the flag.

Non-special added tokens (Qwen3's ``<think>``) are left alone: they are ordinary text the model reads and writes.
"""

from __future__ import annotations

import bisect
import re
import secrets
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import Encoding
from tokenizers import Tokenizer as _HFTokenizer

from ..tokenizer import Tokenizer
from .errors import APIError

SPECIAL_TOKEN_MODES = ("escape", "refuse")
"""``--special-tokens-in-content`` choices: ``escape`` (the default) reads the text as text, ``refuse`` answers 400."""

_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use characters around each placeholder


@dataclass
class MarkedConversation:
    """A conversation whose contents' special-token spellings are swapped for placeholders (see
    :meth:`SpecialTokenText.mark`).

    Attributes:
        messages: The messages to render (placeholders in place of the spellings).
        spellings: The special-token text each placeholder stands for, by placeholder number.
        nonce: The random number inside every placeholder of this conversation.
    """

    messages: list[dict[str, Any]]
    spellings: list[str]
    nonce: str

    def restore(self, text: str) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text with the spellings back, and where each one now is.

        Args:
            text: The chat template's rendering of :attr:`messages`.

        Returns:
            ``(text, spans)``: ``spans`` are the ``(start, end)`` character offsets of the spellings that came
            from the contents.

        Raises:
            APIError: The template cut a placeholder (HTTP 400).
        """
        head = _OPEN + self.nonce + "."
        pattern = re.compile(re.escape(head) + r"(\d+)" + re.escape(_CLOSE))
        pieces, spans, pos, length = [], [], 0, 0
        for m in pattern.finditer(text):
            index = int(m.group(1))
            if index >= len(self.spellings):
                break
            pieces.append(text[pos:m.start()])
            length += m.start() - pos
            spelling = self.spellings[index]
            pieces.append(spelling)
            spans.append((length, length + len(spelling)))
            length += len(spelling)
            pos = m.end()
        pieces.append(text[pos:])
        restored = "".join(pieces)
        if _OPEN + self.nonce in restored:
            raise APIError("the chat template cut the special-token text of a message apart, so it cannot be kept as "
                           "text; remove the special-token text from the messages.", param="messages",
                           code="special_token_in_content")
        return restored, spans


class SpecialTokenText:
    """Finds special-token text in chat messages, and keeps it text or refuses it.

    Args:
        tokenizer: The served model's tokenizer.
        mode: ``"escape"`` (read as plain text) or ``"refuse"`` (HTTP 400).

    Raises:
        ValueError: An unknown mode.
    """

    def __init__(self, tokenizer: Tokenizer, mode: str = "escape") -> None:
        if mode not in SPECIAL_TOKEN_MODES:
            raise ValueError(f"mode={mode!r} is not one of {SPECIAL_TOKEN_MODES} (--special-tokens-in-content).")
        self.tokenizer, self.mode = tokenizer, mode
        specials = {t.content: i for i, t in tokenizer.backend.get_added_tokens_decoder().items() if t.special}
        self.special_ids = frozenset(specials.values())
        # longest first: at each position the longest spelling wins, as the tokenizer matches them
        self._pattern = (re.compile("|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)))
                         if specials else None)
        self._literal: _HFTokenizer | None = None
        self._lock = threading.Lock()

    def find(self, text: str) -> re.Match[str] | None:
        """The first special-token spelling in ``text``, if any."""
        return None if self._pattern is None else self._pattern.search(text)

    def mark(self, messages: Sequence[dict[str, Any]], *context: str) -> MarkedConversation | None:
        """Swaps the special-token spellings of the messages' contents for placeholders (mode ``escape``).

        Args:
            messages: ``{"role", "content"}`` dicts, as the template renders them.
            *context: Other text the template sees (its source, its variables): no placeholder may occur in it.

        Returns:
            None when no content holds a spelling (render and encode as usual), else the marked conversation.

        Raises:
            APIError: Mode ``refuse`` and a content holds a spelling (HTTP 400 naming the message and the token).
        """
        if self._pattern is None:
            return None
        hits = [(i, self._pattern.search(m["content"])) for i, m in enumerate(messages)
                if isinstance(m.get("content"), str)]
        hits = [(i, m) for i, m in hits if m is not None]
        if not hits:
            return None
        if self.mode == "refuse":
            i, m = hits[0]
            raise APIError(f"messages.{i}.content holds the special-token text {m.group()!r} (at character "
                           f"{m.start()}), which this server refuses (--special-tokens-in-content refuse); remove "
                           "it, or restart the server with --special-tokens-in-content escape to read it as plain "
                           "text.",
                           param=f"messages.{i}.content", code="special_token_in_content")
        seen = [m["content"] for m in messages if isinstance(m.get("content"), str)] + list(context)
        nonce = _nonce(seen)
        spellings: list[str] = []
        index: dict[str, int] = {}

        def placeholder(m: re.Match[str]) -> str:
            k = index.setdefault(m.group(), len(spellings))
            if k == len(spellings):
                spellings.append(m.group())
            return f"{_OPEN}{nonce}.{k}{_CLOSE}"

        marked = [dict(m, content=self._pattern.sub(placeholder, m["content"])) if isinstance(m.get("content"), str)
                  else dict(m) for m in messages]
        return MarkedConversation(marked, spellings, nonce)

    def encode(self, text: str, spans: Sequence[tuple[int, int]]) -> list[int]:
        """Encodes a rendered prompt as :meth:`~beaconkv.tokenizer.Tokenizer.encode_prompt` does, except that the
        special-token spellings inside ``spans`` are encoded as plain text.

        Args:
            text: The rendered conversation (placeholders restored, see :meth:`MarkedConversation.restore`).
            spans: ``(start, end)`` character offsets of the spellings that came from message contents.
        """
        backend = self.tokenizer.backend
        ordered = sorted(spans)  # apart from one another, so their ends are sorted too
        ends = [b for _, b in ordered]

        def from_content(start: int, end: int) -> bool:  # overlaps a span (a binary search: spans may be many)
            i = bisect.bisect_right(ends, start)
            return i < len(ordered) and ordered[i][0] < end

        # where the tokenizer cuts the text at special tokens, the template's own ones only. encode_batch, not
        # encode: it lets go of the GIL while it works, so the event loop runs meanwhile (encode holds it)
        found = backend.encode_batch([text], add_special_tokens=False)[0]
        cuts = [(a, b) for token, (a, b) in zip(found.ids, found.offsets)
                if token in self.special_ids and not from_content(a, b)]
        pieces: list[tuple[str, bool]] = []  # (text, a stretch between the template's special tokens)
        pos = 0
        for a, b in cuts:
            if a > pos:
                pieces.append((text[pos:a], True))
            pieces.append((text[a:b], False))
            pos = b
        if pos < len(text):
            pieces.append((text[pos:], True))
        stretches = iter(self._literal_backend().encode_batch([t for t, plain in pieces if plain],
                                                              add_special_tokens=False))
        specials = iter(backend.encode_batch([t for t, plain in pieces if not plain], add_special_tokens=False))
        parts = [next(stretches) if plain else next(specials) for _, plain in pieces]
        merged = Encoding.merge(parts, growing_offsets=True) if parts else backend.encode("", add_special_tokens=False)
        # the post-processor (a BOS, for some models) is applied unless the text starts with BOS, as encode_prompt does
        bos = self.tokenizer.bos_token
        return backend.post_process(merged, add_special_tokens=not (bos is not None and text.startswith(bos))).ids

    def _literal_backend(self) -> _HFTokenizer:
        """A copy of the tokenizer that encodes special-token text as plain text (made once, on first use)."""
        with self._lock:
            if self._literal is None:
                literal = _HFTokenizer.from_str(self.tokenizer.backend.to_str())
                literal.encode_special_tokens = True
                self._literal = literal
            return self._literal


def _nonce(texts: Sequence[str]) -> str:
    """A random number that, wrapped as a placeholder, occurs in none of ``texts``."""
    while True:
        nonce = str(secrets.randbelow(10**12)).zfill(12)
        if not any(_OPEN + nonce in t for t in texts):
            return nonce
