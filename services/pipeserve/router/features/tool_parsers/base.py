"""What a tool-call parser gives: events, pushed text in, the same result however it was split.

A parser reads one choice's generated text incrementally: `push(text)` and, at the end,
`finish()` each return a list of events:
* `Text(text)`: ordinary content;
* `CallStart(index, name)`: call `index` (0, 1, ...) begins, its name whole;
* `CallArgs(index, text)`: the next piece of that call's arguments (a JSON text once whole).
Rule every parser keeps: a decision is taken on the text read so far and never revised, and text
that may still turn into a call is held back (never released as content first), so the events of
any split of the text, merged (`merge`), equal those of one push.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass


@dataclass
class Text:
    text: str


@dataclass
class CallStart:
    index: int
    name: str


@dataclass
class CallArgs:
    index: int
    text: str


Event = Text | CallStart | CallArgs


class EventSink:
    """Collects a parser's events, merging adjacent text and argument pieces (CallScanner's sink).

    Pieces gather in a list and are joined when the kind of event changes (or on `take`): a parser
    adds one character at a time, and growing a string per character would be quadratic."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.calls = 0  # calls started so far
        self._kind: str | None = None  # "text" | "args": what `_parts` are pieces of
        self._parts: list[str] = []

    def _flush(self) -> None:
        if self._parts:
            joined = "".join(self._parts)
            self.events.append(Text(joined) if self._kind == "text" else CallArgs(self.calls - 1, joined))
        self._parts, self._kind = [], None

    def text(self, text: str) -> None:
        if text:
            if self._kind != "text":
                self._flush()
                self._kind = "text"
            self._parts.append(text)

    def start(self, name: str) -> None:
        self._flush()
        self.events.append(CallStart(self.calls, name))
        self.calls += 1

    def args(self, text: str) -> None:
        if self._kind != "args":
            self._flush()
            self._kind = "args"
        self._parts.append(text)

    def take(self) -> list[Event]:
        self._flush()
        out, self.events = self.events, []
        return out


class ToolParser:
    """Base of the incremental parsers: subclasses implement `_feed(c)` and `_end()`."""

    # Tags the parser reads that a tokenizer may mark special: the detokenizer keeps them.
    tags: tuple[str, ...] = ()

    @staticmethod
    def new_id() -> str:
        """A call's id, as the model's family wants it (OpenAI's `call_<hex>` form by default)."""
        return f"call_{uuid.uuid4().hex[:24]}"

    def __init__(self) -> None:
        self.out = EventSink()

    @property
    def calls(self) -> int:
        return self.out.calls

    def push(self, text: str) -> list[Event]:
        for c in text:
            self._feed(c)
        return self.out.take()

    def finish(self) -> list[Event]:
        self._end()
        return self.out.take()

    def _feed(self, c: str) -> None:
        raise NotImplementedError

    def _end(self) -> None:
        raise NotImplementedError


def merge(events: list[Event]) -> tuple[str, list[tuple[str, str]]]:
    """The result the events add up to: (content, [(name, arguments), ...])."""
    content: list[str] = []
    calls: list[list[str]] = []
    for e in events:
        if isinstance(e, Text):
            content.append(e.text)
        elif isinstance(e, CallStart):
            assert e.index == len(calls), "calls start in order"
            calls.append([e.name, ""])
        else:
            calls[e.index][1] += e.text
    return "".join(content), [(n, a) for n, a in calls]
