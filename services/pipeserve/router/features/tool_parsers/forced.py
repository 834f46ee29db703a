"""Parsers for outputs a JSON-schema grammar forces (tools.py builds the schemas, as vLLM does).

* `RequiredParser` (tool_choice "required"): a JSON array of `{"name": ..., "parameters": ...}`
  objects, each a call whose arguments stream verbatim once its name is read (base.py).
  Anything that breaks the array before a call's name is content from there on (held text
  included); nothing after the closing `]` counts. Under the grammar neither happens.
* `NamedParser` (a named tool_choice): the whole output is the arguments of that one call; the
  call starts with the first text (or at the end, with empty arguments, if there was none).
"""

from __future__ import annotations

from pipeserve.router.features.tool_parsers.base import ToolParser
from pipeserve.router.features.tool_parsers.scan import DONE, ERROR, WS, CallScanner

_LEAD, _ELEM, _OBJ, _AFTER, _DONE, _TEXT = range(6)


class RequiredParser(ToolParser):
    def __init__(self) -> None:
        super().__init__()
        self.mode = _LEAD
        self._held: list[str] = []
        self._scan: CallScanner | None = None

    def _feed(self, c: str) -> None:
        mode = self.mode
        if mode == _TEXT:
            self.out.text(c)
        elif mode == _DONE:
            return
        elif mode == _OBJ:
            self._object(c)
        elif c in WS:
            self._held.append(c)
        elif mode == _LEAD and c == "[":
            self._held.append(c)
            self.mode = _ELEM
        elif mode == _ELEM and c == "{":
            self.mode = _OBJ
            self._scan = CallScanner(self.out, ("parameters", "arguments"))
            self._object(c)
        elif ((mode == _ELEM and self.calls == 0) or mode == _AFTER) and c == "]":
            self._held.append(c)
            self.mode = _DONE
        elif mode == _AFTER and c == ",":
            self._held.append(c)
            self.mode = _ELEM
        else:
            self._to_text(c)

    def _to_text(self, c: str) -> None:
        self.out.text("".join(self._held) + c)
        self._held = []
        self.mode = _TEXT

    def _object(self, c: str) -> None:
        scan = self._scan
        assert scan is not None
        status = scan.feed(c)
        if status == ERROR:
            if scan.committed:
                scan.close()
                self._held = []
            self._to_text(c)
        elif status == DONE and not scan.committed:
            self._to_text(c)
        elif status == DONE:
            scan.close()
            self.mode, self._held = _AFTER, []
        elif scan.committed:
            self._held = []
        else:
            self._held.append(c)

    def _end(self) -> None:
        if self.mode == _OBJ and self._scan is not None and self._scan.committed:
            self._scan.close()
        elif self.calls == 0:
            self.out.text("".join(self._held))
        self._held = []


class NamedParser(ToolParser):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def push(self, text: str) -> list:
        if text:
            if self.calls == 0:
                self.out.start(self.name)
            self.out.args(text)
        return self.out.take()

    def _end(self) -> None:
        if self.calls == 0:
            self.out.start(self.name)
            self.out.args("")
