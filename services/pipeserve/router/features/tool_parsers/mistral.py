"""`mistral`: Mistral's calls, `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`.

Also the newer form (Mistral's v11+ tokenizers): `[TOOL_CALLS]name[ARGS]{...}`, one tag per call.
`[TOOL_CALLS]` and `[ARGS]` are special tokens in Mistral's tokenizers: the router keeps them in
the detokenized text when this parser reads a choice (`tags`; vLLM turns skip_special_tokens off).
Rules (a function of the whole text, however it arrives; base.py):
* Text before `[TOOL_CALLS]` is content; text that may begin the tag is held until it cannot.
* After the tag, a JSON array of call objects (arguments under `arguments`, or `parameters`), or
  a name (`[a-zA-Z0-9_-]+`), an optional `[ARGS]`, and the arguments object. A call's arguments
  stream verbatim once its name is read (committed, base.py). Another `[TOOL_CALLS]` may follow.
* What fails before a call's name is read is content, without the tag (vLLM drops the tag from
  the content of an output it cannot parse); text after the calls is content, whitespace next to
  them dropped. vLLM's blocking parser returns everything as content when any part fails and
  drops text after the calls; here committed calls stay calls and the rest is content.
Call ids are 9 alphanumeric characters: Mistral's chat templates refuse any other id when the
calls come back in the conversation (`new_id`).
"""

from __future__ import annotations

import random
import string

from pipeserve.router.features.tool_parsers.base import ToolParser
from pipeserve.router.features.tool_parsers.scan import DONE, ERROR, WS, CallScanner

TAG = "[TOOL_CALLS]"
ARGS = "[ARGS]"
ID_CHARS = string.ascii_letters + string.digits
ID_LENGTH = 9
_NAME_CHARS = frozenset(string.ascii_letters + string.digits + "_-")
_TEXT, _LEAD, _ELEM, _OBJ, _AFTER, _NAME, _ARGS_TAG, _ARGS_OPEN, _ARGS = range(9)


class MistralParser(ToolParser):
    tags = (TAG, ARGS)

    @staticmethod
    def new_id() -> str:
        return "".join(random.choices(ID_CHARS, k=ID_LENGTH))

    def __init__(self) -> None:
        super().__init__()
        self.mode = _TEXT
        self._tag = ""  # held prefix of TAG (text mode)
        self._after = False  # text mode right after calls: whitespace is dropped
        self._held: list[str] = []  # text since the tag or the last call, while undecided
        self._scan: CallScanner | None = None
        self._name: list[str] = []
        self._args_tag = ""
        self._depth, self._in_str, self._esc = 0, False, False

    def _feed(self, c: str) -> None:
        mode = self.mode
        if mode == _TEXT:
            self._text(c)
        elif mode == _OBJ:
            self._object(c)
        elif mode == _ARGS:
            self._args(c)
        elif mode == _NAME:
            if c in _NAME_CHARS:
                self._keep(c)
                self._name.append(c)
            elif c == "[":
                self._keep(c)
                self.mode, self._args_tag = _ARGS_TAG, c
            elif c == "{":
                self._call(c)
            else:
                self._fail(c)
        elif mode == _ARGS_TAG:
            if ARGS.startswith(self._args_tag + c):
                self._keep(c)
                self._args_tag += c
                if self._args_tag == ARGS:
                    self.mode = _ARGS_OPEN
            else:
                self._fail(c)
        elif c in WS:
            self._keep(c)
        elif mode == _ARGS_OPEN and c == "{":
            self._call(c)
        elif mode == _LEAD and c == "[":
            self._keep(c)
            self.mode = _ELEM
        elif mode == _LEAD and c in _NAME_CHARS:
            self._keep(c)
            self.mode, self._name = _NAME, [c]
        elif mode == _ELEM and c == "{":
            self.mode = _OBJ
            self._scan = CallScanner(self.out)
            self._object(c)
        elif mode == _AFTER and c == ",":
            self._keep(c)
            self.mode = _ELEM
        elif mode == _AFTER and c == "]":
            self._calls_end()
        else:
            self._fail(c)

    def _keep(self, c: str) -> None:
        self._held.append(c)

    def _text(self, c: str) -> None:
        if self._tag:
            if TAG.startswith(self._tag + c):
                self._tag += c
                if self._tag == TAG:
                    self.mode, self._tag, self._held, self._after = _LEAD, "", [], False
                return
            self.out.text(self._tag)  # not the tag after all; `c` starts afresh (TAG has one '[')
            self._tag = ""
        if c == TAG[0]:
            self._tag = c
        elif not (self._after and c in WS):
            self._after = False
            self.out.text(c)

    def _fail(self, c: str) -> None:
        """What was read since the tag (or the last call) is content; `c` is read as text."""
        self.out.text("".join(self._held))
        self._held, self.mode, self._after = [], _TEXT, False
        if c:
            self._text(c)

    def _calls_end(self) -> None:
        self.mode, self._held, self._after = _TEXT, [], True

    def _call(self, c: str) -> None:
        """A new-form call's name is whole and its arguments object opens with `c`."""
        self.out.start("".join(self._name))
        self._held, self.mode = [], _ARGS
        self._depth, self._in_str, self._esc = 0, False, False
        self._args(c)

    def _args(self, c: str) -> None:
        """One character of a new-form call's arguments, verbatim, up to its closing bracket."""
        self.out.args(c)
        if self._in_str:
            if self._esc:
                self._esc = False
            elif c == "\\":
                self._esc = True
            elif c == '"':
                self._in_str = False
        elif c == '"':
            self._in_str = True
        elif c in "{[":
            self._depth += 1
        elif c in "}]":
            self._depth -= 1
            if self._depth == 0:
                self._calls_end()

    def _object(self, c: str) -> None:
        scan = self._scan
        assert scan is not None
        status = scan.feed(c)
        if status == ERROR:
            if scan.committed:  # the array breaks after a call: the call stays, the rest is text
                scan.close()
                self._held = []
            self._fail(c)
        elif status == DONE and not scan.committed:
            self._keep(c)
            self._fail("")
        elif status == DONE:
            scan.close()
            self.mode, self._held = _AFTER, []
        elif scan.committed:
            self._held = []
        else:
            self._keep(c)

    def _end(self) -> None:
        if self.mode == _TEXT:
            self.out.text(self._tag)
        elif self.mode == _OBJ and self._scan is not None and self._scan.committed:
            self._scan.close()
        elif self.mode not in (_ARGS, _AFTER):
            self.out.text("".join(self._held))
        self._tag, self._held = "", []
