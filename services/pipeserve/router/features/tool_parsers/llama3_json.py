"""`llama3_json`: Llama 3.1/3.2 JSON calls, `<|python_tag|>{"name": ..., "parameters": {...}}; {...}`.

Rules (a function of the whole text, however it arrives; base.py):
* The output is calls only if, after leading whitespace, it begins with `{` or with
  `<|python_tag|>` then `{` (the tag is optional: it is a special token, which detokenization
  drops). Otherwise all of it is content, as vLLM's parser decides.
* Calls are JSON objects with `name` and `parameters` (or `arguments`), separated by `;` and/or
  whitespace. A call's arguments stream verbatim once its name is read (committed, base.py).
* An object that fails before its name is read is content from there on, with what was held
  before it; text after the calls that is not another object is content too (the separators
  before it included); a trailing separator is dropped.
"""

from __future__ import annotations

from pipeserve.router.features.tool_parsers.base import ToolParser
from pipeserve.router.features.tool_parsers.scan import DONE, ERROR, WS, CallScanner

TAG = "<|python_tag|>"
_LEAD, _OBJ, _SEP, _TEXT = range(4)


class Llama3JsonParser(ToolParser):
    def __init__(self) -> None:
        super().__init__()
        self.mode = _LEAD
        self._held: list[str] = []  # text that is not content yet (lead, separators, an open object)
        self._tag = ""  # the part of TAG read (lead only)
        self._scan: CallScanner | None = None

    def _feed(self, c: str) -> None:
        mode = self.mode
        if mode == _TEXT:
            self.out.text(c)
        elif mode == _OBJ:
            self._object(c)
        elif mode == _LEAD and self._tag and self._tag != TAG:
            if TAG.startswith(self._tag + c):
                self._tag += c
                self._held.append(c)
            else:
                self._to_text(c)
        elif c in WS or (mode == _SEP and c == ";"):
            self._held.append(c)
        elif mode == _LEAD and c == "<" and not self._tag:
            self._tag = c
            self._held.append(c)
        elif c == "{":
            self.mode = _OBJ
            self._scan = CallScanner(self.out)
            self._object(c)
        else:
            self._to_text(c)

    def _to_text(self, c: str) -> None:
        """Content from here on: what was held, then `c`."""
        self.out.text("".join(self._held))
        self._held = []
        self.mode = _TEXT
        self.out.text(c)

    def _object(self, c: str) -> None:
        scan = self._scan
        assert scan is not None
        status = scan.feed(c)
        if status == ERROR:
            if scan.committed:
                scan.close()
                self._held = []
            self.mode = _TEXT
            self._to_text(c)
        elif status == DONE and not scan.committed:
            self._held.append(c)
            self._to_text("")
        elif status == DONE:
            scan.close()
            self.mode, self._held = _SEP, []
        elif scan.committed:
            self._held = []
        else:
            self._held.append(c)

    def _end(self) -> None:
        if self.mode == _OBJ and self._scan is not None and self._scan.committed:
            self._scan.close()
        elif self.mode != _SEP:
            self.out.text("".join(self._held))
        self._held = []
