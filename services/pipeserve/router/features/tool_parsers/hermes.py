"""`hermes`: Qwen2.5 / Hermes-2-Pro style calls, `<tool_call>{"name": ..., "arguments": ...}</tool_call>`.

Rules (a function of the whole text, however it arrives; base.py):
* A block runs from `<tool_call>` to `</tool_call>` (or the end of the text); several blocks
  are parallel calls. Text outside blocks is content, except whitespace next to a block (the
  newlines between and around blocks), which is dropped. Text that may begin `<tool_call>`
  is held until it cannot.
* A block whose JSON object has its `name` read is a call (committed, base.py): its arguments
  stream verbatim; what follows the object inside the block is dropped; an object cut short
  (end of text, a stray `</tool_call>`) keeps the arguments read so far (`{}` if none).
* A block that fails before its name is read (not JSON, no `name`) is content, tags included:
  the text is passed through up to and with its `</tool_call>`.
vLLM's hermes parser differs on malformed text: it returns the whole output as content.
"""

from __future__ import annotations

from pipeserve.router.features.tool_parsers.base import ToolParser
from pipeserve.router.features.tool_parsers.scan import DONE, ERROR, WS, CallScanner

START = "<tool_call>"
END = "</tool_call>"
_TEXT, _BLOCK, _SKIP, _PASS = range(4)


class HermesParser(ToolParser):
    tags = (START, END)  # added tokens, not special, in Qwen's tokenizers: kept in case one marks them

    def __init__(self) -> None:
        super().__init__()
        self.mode = _TEXT
        self._ws = ""  # held whitespace run (dropped if a block is next to it)
        self._tag = ""  # held prefix of START
        self._after_block = False
        self._raw: list[str] = []  # the uncommitted block, for content if it fails
        self._end_match = 0  # characters of END matched (skip / pass modes)
        self._scan: CallScanner | None = None

    def _feed(self, c: str) -> None:
        if self.mode == _TEXT:
            self._text(c)
        elif self.mode == _BLOCK:
            self._block(c)
        else:
            self._until_end(c)

    def _text(self, c: str) -> None:
        if self._tag:
            if START.startswith(self._tag + c):
                self._tag += c
                if self._tag == START:  # a block opens: the whitespace next to it goes
                    self._ws = self._tag = ""
                    self.mode, self._raw = _BLOCK, [START]
                    self._scan = CallScanner(self.out)
                return
            self._release()  # not a tag after all; `c` starts afresh (START has one '<')
        if c in WS:
            self._ws += c
        elif c == "<":
            self._tag = c
        else:
            self._release()
            self.out.text(c)

    def _release(self) -> None:
        """The held whitespace and tag prefix are content: what comes next is not a block (the
        whitespace goes all the same when it follows one)."""
        if not self._after_block:
            self.out.text(self._ws)
        self.out.text(self._tag)
        self._ws = self._tag = ""
        self._after_block = False  # the caller releases non-whitespace next (the tag or `c`)

    def _block(self, c: str) -> None:
        scan = self._scan
        assert scan is not None
        status = scan.feed(c)
        if status == ERROR or (status == DONE and not scan.committed):
            if status == DONE:
                self._raw.append(c)
            if scan.committed:
                scan.close()
                self.mode = _SKIP
            else:  # malformed before its name: the block is content, up to its end tag
                self.out.text("".join(self._raw))
                self.mode = _PASS
            self._raw, self._end_match = [], 0
            if status == ERROR:
                self._until_end(c)
            return
        if status == DONE:
            scan.close()
            self.mode, self._end_match = _SKIP, 0
        elif scan.committed:
            self._raw = []
        else:
            self._raw.append(c)

    def _until_end(self, c: str) -> None:
        if self.mode == _PASS:
            self.out.text(c)
        if c == END[self._end_match]:
            self._end_match += 1
        else:
            self._end_match = 1 if c == END[0] else 0
        if self._end_match == len(END):
            self.mode, self._after_block, self._scan = _TEXT, True, None

    def _end(self) -> None:
        if self.mode == _TEXT:
            if not self._after_block:
                self.out.text(self._ws)
            self.out.text(self._tag)
        elif self.mode == _BLOCK:
            assert self._scan is not None
            if self._scan.committed:
                self._scan.close()
            else:
                self.out.text("".join(self._raw))
        self._ws = self._tag = ""
        self._raw = []
