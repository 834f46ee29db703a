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

Stop strings cost linear time: a `StopMatcher` (Aho-Corasick over the stop
strings) scans each new character once, and its state is the held suffix, so
no token rescans the text or the stop strings (vLLM bounds its search to a
tail window the same way). A request carries at most MAX_STOP_STRINGS stop
strings of MAX_STOP_CHARS characters in all (the automaton's size).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"
# Caps on a request's stop strings (SamplingParams.validate enforces them): matching is linear in the
# generated text whatever the stops, but building the automaton costs time and memory per character.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 8192  # total characters over all stop strings


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
    """Length of the longest suffix of `text` that is a proper prefix of some stop string.

    The plain definition, O(len(stops) x longest^2) per call: the reference the tests check
    StopMatcher against. Streams use StopMatcher, which keeps the same answer incrementally.
    """
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class StopMatcher:
    """An Aho-Corasick automaton over the stop strings; immutable once built, so streams share it.

    A state is a trie node, standing for the longest suffix of the text scanned so far that is a
    prefix of some stop string (`depth[state]` characters: exactly `held_suffix`). `scan` takes one
    transition per character plus failure steps, and failure steps never outnumber the characters
    scanned before them, so a stream's whole matching work is linear in its text, whatever the stop
    strings. Transitions live in one dict keyed by (node << 21 | code point): ~100 bytes a node.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.next: dict[int, int] = {}
        self.depth = [0]
        self.done = [0]  # 0, or the length of the longest stop string ending at this node
        children: list[list[tuple[int, int]]] = [[]]
        for s in stops:
            node = 0
            for ch in s:
                key = node << 21 | ord(ch)
                child = self.next.get(key)
                if child is None:
                    child = self.next[key] = len(self.depth)
                    children[node].append((ord(ch), child))
                    children.append([])
                    self.depth.append(self.depth[node] + 1)
                    self.done.append(0)
                node = child
            self.done[node] = len(s)
        self.fail = [0] * len(self.depth)
        order = [child for _, child in children[0]]
        for u in order:  # breadth first: a failure target is shallower, so it is final before it is read
            for c, v in children[u]:
                f = self.fail[u]
                while f and (f << 21 | c) not in self.next:
                    f = self.fail[f]
                self.fail[v] = self.next.get(f << 21 | c, 0)
                if not self.done[v]:
                    self.done[v] = self.done[self.fail[v]]  # a shorter stop string ends here
                order.append(v)

    def scan(self, state: int, text: str, begin: int) -> tuple[int, int, int]:
        """Walk text[begin:] from `state`. Returns (the new state, the earliest start of a stop string
        ending in text[begin:] or -1, the transitions taken)."""
        nxt, fail, done = self.next, self.fail, self.done
        first = -1
        steps = 0
        for i in range(begin, len(text)):
            c = ord(text[i])
            while state and (state << 21 | c) not in nxt:
                state = fail[state]
                steps += 1
            state = nxt.get(state << 21 | c, 0)
            steps += 1
            if done[state]:
                # The longest stop string ending here starts earliest; one ending later may start earlier.
                start = i + 1 - done[state]
                first = start if first < 0 else min(first, start)
        return state, first, steps


@functools.lru_cache(maxsize=16)  # identical stop lists (a client's retries, a batch) build once
def stop_matcher(stops: tuple[str, ...]) -> StopMatcher:
    return StopMatcher(stops)


class TextStream:
    """Detokenized text of one choice, with stop strings applied; see the module docstring."""

    def __init__(
        self, decode: Callable[[list[int]], str], stops: Sequence[str] = (), min_tokens: int = 0
    ) -> None:
        self._detok = IncrementalDetokenizer(decode)
        stops = tuple(s for s in stops if s)
        self._matcher = stop_matcher(stops) if stops else None
        # vLLM's min_tokens: no stop string is looked for before that many tokens; the first scan
        # after starts a longest-stop-minus-one back, so a stop string ending in the new text is found.
        self._min_tokens = min_tokens
        self._lookback = max((len(s) for s in stops), default=1) - 1
        self._state = 0  # the matcher's state after `text`
        self.steps = 0  # matcher transitions taken so far: linear in len(text) (tests bound it)
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
        begin = len(self.text)
        self.text += new
        held = 0
        if self._matcher is not None and self.num_tokens < self._min_tokens:
            # No stop string yet, but its start may be here: hold back what the first scan may cut.
            return self._release(len(self.text) if final else max(self.sent, len(self.text) - self._lookback))
        if self._matcher is not None:
            if self._min_tokens and self.num_tokens == self._min_tokens and not final:
                self._state, begin = 0, max(0, begin - self._lookback)
            # Only `new` is scanned: the state carries what the text before it can still contribute.
            self._state, hit, steps = self._matcher.scan(self._state, self.text, begin)
            self.steps += steps
            if hit >= 0:
                cut = max(hit, self.sent)
                self.text = self.text[:cut]
                self.stopped = True
                return self._release(cut)
            held = self._matcher.depth[self._state]
        end = len(self.text) if final else len(self.text) - held
        return self._release(max(end, self.sent))

    def _release(self, end: int) -> str:
        delta = self.text[self.sent : end]
        self.sent = end
        return delta
