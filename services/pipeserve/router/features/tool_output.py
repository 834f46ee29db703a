"""Tool calls in a chat response (the format step of the router's way; the request side: tools.py).

Responses (`ToolCallOutput`): `message.tool_calls` (`call_<hex>` ids, or the parser's form:
mistral's 9 alphanumerics; arguments as a JSON string), `content` null when only calls were
made, `finish_reason` `tool_calls` when a call was made under auto/required (a named function
keeps the engine's reason, as vLLM); streamed, each call's first delta entry carries index, id,
type and name, then argument pieces follow. Cut by the length limit (`max_tokens`), a choice's
`finish_reason` is `length` (vLLM says tool_calls only when the engine stopped), and the blocking
message leaves out the call that was cut (its arguments, not JSON, are no call to make; the calls
completed before it stay). The streamed pieces of a cut call were sent before the cut was known:
its last chunk says `length`.
"""

from __future__ import annotations

import json
from typing import Any

from pipeserve.router.features.tool_parsers import (
    PARSERS,
    CallArgs,
    CallStart,
    Event,
    NamedParser,
    RequiredParser,
    ToolParser,
)
from pipeserve.router.features.tools import ToolsSpec


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


class ToolCallOutput:
    """Turns a chat choice's text into content and tool calls (one parser per choice)."""

    def __init__(self, spec: ToolsSpec, parser: str | None) -> None:
        self.spec = spec
        self.parser = parser
        self._streams: dict[int, ToolParser] = {}
        # Ids in the deployment parser's form, forced calls' too: they come back in the conversation,
        # and a family's template may refuse another form (mistral's: 9 alphanumerics).
        self.new_id = (PARSERS[parser] if parser is not None else ToolParser).new_id
        self.tags = PARSERS[parser].tags if parser is not None and spec.choice == "auto" else ()

    def _new(self) -> ToolParser:
        if self.spec.choice == "function":
            assert self.spec.name is not None
            return NamedParser(self.spec.name)
        if self.spec.choice == "required":
            return RequiredParser()
        assert self.parser is not None
        return PARSERS[self.parser]()

    def _finish(self, p: ToolParser, finish_reason: str | None) -> str | None:
        # A call the length limit cut is no finished call: "length" stays (vLLM: tool_calls only
        # when the engine stopped), whatever the calls before it.
        if finish_reason not in (None, "length") and p.calls and self.spec.choice in ("auto", "required"):
            return "tool_calls"
        return finish_reason

    def _kept(self, events: list[Event]) -> list[Event]:
        if self.spec.parallel:
            return events
        return [e for e in events if not isinstance(e, CallStart | CallArgs) or e.index == 0]

    def delta(self, index: int, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """A streamed piece: the chunk's delta and its finish_reason."""
        p = self._streams.get(index)
        if p is None:
            p = self._streams[index] = self._new()
        events = p.push(text) if text else []
        if finish_reason is not None:
            events += p.finish()
        delta: dict[str, Any] = {}
        content = "".join(e.text for e in events if not isinstance(e, CallStart | CallArgs))
        if content:
            delta["content"] = content
        entries: list[dict] = []
        for e in self._kept(events):
            if isinstance(e, CallStart):
                fn = {"name": e.name, "arguments": ""}
                entries.append({"index": e.index, "id": self.new_id(), "type": "function", "function": fn})
            elif isinstance(e, CallArgs):
                if entries and entries[-1]["index"] == e.index:
                    entries[-1]["function"]["arguments"] += e.text
                else:
                    entries.append({"index": e.index, "function": {"arguments": e.text}})
        if entries:
            delta["tool_calls"] = entries
        return delta, self._finish(p, finish_reason)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The blocking response's message and finish_reason for a choice's whole text."""
        p = self._new()
        events = self._kept(p.push(text) + p.finish())
        content = "".join(e.text for e in events if not isinstance(e, CallStart | CallArgs))
        calls: list[dict] = []
        for e in events:
            if isinstance(e, CallStart):
                fn = {"name": e.name, "arguments": ""}
                calls.append({"id": self.new_id(), "type": "function", "function": fn})
            elif isinstance(e, CallArgs):
                calls[e.index]["function"]["arguments"] += e.text
        if finish_reason == "length" and calls and not _is_json(calls[-1]["function"]["arguments"]):
            calls.pop()  # cut by max_tokens: its arguments are a prefix, not a call to make
        message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
        if calls:
            message["tool_calls"] = calls
        return message, self._finish(p, finish_reason)
