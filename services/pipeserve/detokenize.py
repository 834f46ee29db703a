"""Incremental detokenization and stop strings, one token at a time.

`IncrementalDetokenizer.push(id)` returns the text that token completes:
never part of a multi-byte character (a byte-level BPE splits an emoji over
several tokens; the bytes are held until the character is whole), never a
U+FFFD standing for an incomplete sequence. `flush()` at the end returns what
is still held (a sequence the model never completed decodes to U+FFFD there,
exactly as a full decode would).

Invariant: the concatenation of every `push` and the final `flush` equals
`decode(all ids)`. It holds because the decode window always starts at a
character boundary: offsets only move when the window's text ends in a whole
character, and UTF-8 decoding of a byte string split at a character boundary
is the concatenation of the two decodings. The window keeps a few tokens of
left context so decoders that treat the first token specially (SentencePiece's
leading space) decode the tail exactly as they would inside the full text.

`TextStream` adds stop strings on top: it releases text only when no stop
string can still begin in it, and when one appears it trims the stop string
and everything after it and stops. Both the streaming and the blocking paths
use it, so streamed deltas always concatenate to the blocking text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self.ids: list[int] = []
        self._prefix = 0  # window start: a character boundary a few tokens back, for context
        self._read = 0  # everything before this token index has been returned

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        new_text = self._decode(self.ids[self._prefix :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT):
            # Nothing visible yet (a special token, an empty piece) or an incomplete character.
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        if self._read == len(self.ids):
            return ""
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        new_text = self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return new_text[len(prefix_text) :]


def held_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class TextStream:
    """Detokenized text of one choice, with stop strings applied; see the module docstring."""

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str] = ()) -> None:
        self._detok = IncrementalDetokenizer(decode)
        self._stops = [s for s in stops if s]
        self._longest = max((len(s) for s in self._stops), default=0)
        self.text = ""  # decoded text so far, trimmed at a stop string once one is found
        self.sent = 0  # characters of `text` released to the caller
        self.stopped = False  # a stop string was found: no more tokens are accepted
        self.num_tokens = 0

    def push(self, token_id: int) -> str:
        """Add one generated token; returns the text that may now be released (maybe "")."""
        if self.stopped:
            raise RuntimeError("push after a stop string was found")
        self.num_tokens += 1
        return self._advance(self._detok.push(token_id), final=False)

    def finish(self) -> str:
        """No more tokens: release everything still held (after a last stop-string check)."""
        if self.stopped:
            return ""
        return self._advance(self._detok.flush(), final=True)

    def _advance(self, new: str, final: bool) -> str:
        # A match that ends in `new` starts at most longest-1 characters before it.
        start = max(0, len(self.text) - self._longest + 1)
        self.text += new
        if self._stops and new:
            hits = [i for i in (self.text.find(s, start) for s in self._stops) if i >= 0]
            if hits:
                cut = max(min(hits), self.sent)
                self.text = self.text[:cut]
                self.stopped = True
                return self._release(cut)
        end = len(self.text) if final else len(self.text) - held_suffix(self.text, self._stops)
        return self._release(max(end, self.sent))

    def _release(self, end: int) -> str:
        delta = self.text[self.sent : end]
        self.sent = end
        return delta
