"""A JSON call object `{"name": "...", "arguments": {...}}` read one character at a time.

`CallScanner.feed(c)` returns MORE, DONE (the object closed; `c` consumed) or ERROR (`c` does
not fit; not consumed). It checks the object's structure, not every JSON rule inside values: it
finds where each value ends (strings, escapes, nested brackets) and refuses a character no JSON
value holds outside a string (so `</tool_call>` ends a call even when a bracket is left open).
The arguments value (the first key among `args_keys`) is captured verbatim, as the model wrote
it; every other key but `name` is skipped. The call is *committed* once its `name` string is
read: the sink then gets `start(name)` and, from then on, every character of the arguments as
it arrives (any captured before the name are handed over at that point). What a parser does
with an uncommitted object that fails is its own rule; a committed call is never taken back.
"""

from __future__ import annotations

import json
from typing import Protocol

MORE, DONE, ERROR = 0, 1, 2
WS = " \t\r\n"
# Characters a JSON value may hold outside strings (numbers, true/false/null, punctuation).
_BARE = set("0123456789-+.eEtrufalsn")
_OPEN, _KEY, _KEYSTR, _COLON, _VALUE, _NAMESTR, _RAW, _AFTER = range(8)


class Sink(Protocol):
    def start(self, name: str) -> None: ...
    def args(self, text: str) -> None: ...


class CallScanner:
    def __init__(self, sink: Sink, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> None:
        self.sink = sink
        self.args_keys = args_keys
        self.state = _OPEN
        self.name: str | None = None
        self.args_seen = False  # an arguments value has started (only the first is captured)
        self.args_sent = False  # some argument text went to the sink
        self._pending: list[str] = []  # arguments read before the name
        self._buf: list[str] = []  # the key or name string being read
        self._esc = False
        self._key = ""
        self._capture = False
        self._stack: list[str] = []  # open brackets of the raw value
        self._in_str = False
        self._scalar = False

    @property
    def committed(self) -> bool:
        return self.name is not None

    def _arg(self, text: str) -> None:
        if self.name is None:
            self._pending.append(text)
        else:
            self.sink.args(text)
            self.args_sent = True

    def close(self) -> None:
        """A committed call ends: `{}` when it never had arguments (OpenAI's empty object)."""
        if self.name is not None and not self.args_sent:
            self.sink.args("{}")
            self.args_sent = True

    def _string(self, c: str) -> bool:
        """Read one character of a key/name string; True once its closing quote is read."""
        if self._esc:
            self._esc = False
        elif c == "\\":
            self._esc = True
        elif c == '"':
            return True
        self._buf.append(c)
        return False

    def _decoded(self) -> str | None:
        try:
            value = json.loads('"' + "".join(self._buf) + '"')
        except ValueError:
            return None
        self._buf = []
        return value if isinstance(value, str) else None

    def feed(self, c: str) -> int:
        st = self.state
        if st == _RAW:
            return self._raw(c)
        if st == _KEYSTR or st == _NAMESTR:
            if not self._string(c):
                return MORE
            text = self._decoded()
            if text is None:
                return ERROR
            if st == _KEYSTR:
                self._key, self.state = text, _COLON
                return MORE
            self.name, self.state = text, _AFTER
            self.sink.start(text)
            if self._pending:
                self.sink.args("".join(self._pending))
                self.args_sent, self._pending = True, []
            return MORE
        if c in WS:
            return MORE
        if st == _OPEN:
            if c != "{":
                return ERROR
            self.state = _KEY
        elif st == _KEY:
            if c == '"':
                self.state = _KEYSTR
            elif c == "}":
                return DONE
            else:
                return ERROR
        elif st == _COLON:
            if c != ":":
                return ERROR
            self.state = _VALUE
        elif st == _VALUE:
            if self._key == "name" and self.name is None:
                if c != '"':
                    return ERROR
                self.state = _NAMESTR
                return MORE
            self._capture = self._key in self.args_keys and not self.args_seen
            self.args_seen = self.args_seen or self._capture
            self.state = _RAW
            self._stack, self._in_str, self._scalar = [], False, False
            return self._raw(c)
        elif st == _AFTER:
            if c == ",":
                self.state = _KEY
            elif c == "}":
                return DONE
            else:
                return ERROR
        return MORE

    def _raw(self, c: str) -> int:
        """One character of a skipped or captured value."""
        if self._in_str:
            if self._esc:
                self._esc = False
            elif c == "\\":
                self._esc = True
            elif c == '"':
                self._in_str = False
                if not self._stack:
                    return self._value_end(c)
            if self._capture:
                self._arg(c)
            return MORE
        if self._scalar and not self._stack and (c in WS or c in ",}"):
            self.state = _AFTER  # a number or literal ends before its terminator
            return self.feed(c)
        if c == '"':
            self._in_str = True
        elif c in "{[":
            self._stack.append("}" if c == "{" else "]")
        elif c in "}]":
            if not self._stack or self._stack.pop() != c:
                return ERROR
            if not self._stack:
                return self._value_end(c)
        elif c in _BARE:
            self._scalar = not self._stack
        elif c not in WS and c not in ",:":
            return ERROR
        elif not self._stack:  # a separator where a value should begin
            return ERROR
        if self._capture:
            self._arg(c)
        return MORE

    def _value_end(self, c: str) -> int:
        if self._capture:
            self._arg(c)
        self.state = _AFTER
        return MORE
