"""A chat choice's text as the message the client gets: reasoning, content and tool calls.

`ChatOutput` is what the Formatter asks (responses.py) when a chat request has a reasoning parser
(`--reasoning-parser`, router/features/reasoning.py) or tool calls to parse
(router/features/tools.py), in this order:
1. the reasoning parser splits the text into `reasoning_content` and the rest;
2. tool calls are parsed in that rest only (a `<tool_call>` while thinking is reasoning text).
Blocking: `message.reasoning_content` is the reasoning (null when there was none: thinking off,
or none written); `content` is null when it is empty and the model thought or called a tool
(vLLM's `content or None`). Streaming: as vLLM streams it, a chunk's delta carries
`reasoning_content` pieces while the model thinks, then `content` / `tool_calls` pieces; a piece
the parsers still hold sends no chunk. The deltas add up to the blocking message.
Usage counts every generated token, reasoning included (as vLLM).
"""

from __future__ import annotations

from typing import Any

from pipeserve.router.features.reasoning import REASONING_PARSERS, ReasoningSplitter, split
from pipeserve.router.features.tool_output import ToolCallOutput
from pipeserve.router.features.tool_parsers import PARSERS

TOOL_CHOICES = ("none", "auto", "required", "function")


def kept_tags(reasoning: str | None, tool_parser: str | None, tool_choice: str) -> tuple[str, ...]:
    """Text the detokenizer must keep for these parsers (even where the tokenizer marks it special):
    the reasoning parser's tags, and the tool-call parser's under tool_choice auto. Known from the
    configuration, so the router computes it once, before any output."""
    fmt = REASONING_PARSERS[reasoning] if reasoning is not None else None
    tools = PARSERS[tool_parser].tags if tool_parser is not None and tool_choice == "auto" else ()
    return (fmt.tags if fmt is not None else ()) + tools


class ChatOutput:
    def __init__(self, tools: ToolCallOutput | None, reasoning: str | None, template_kwargs: dict) -> None:
        self.tools = tools
        self.reasoning = reasoning
        fmt = REASONING_PARSERS[reasoning] if reasoning is not None else None
        self.thinking = fmt is not None and fmt.thinking(template_kwargs)
        self._splitters: dict[int, ReasoningSplitter] = {}
        parser, choice = (tools.parser, tools.spec.choice) if tools is not None else (None, "none")
        self.tags = kept_tags(reasoning, parser, choice)  # text the detokenizer keeps

    def _content(self, index: int, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        if self.tools is not None:
            return self.tools.delta(index, text, finish_reason)
        return ({"content": text} if text else {}), finish_reason

    def delta(self, index: int, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """A streamed piece: the chunk's delta (empty: nothing to send yet) and its finish_reason."""
        if self.reasoning is None:
            return self._content(index, text, finish_reason)
        s = self._splitters.get(index)
        if s is None:
            s = self._splitters[index] = ReasoningSplitter(self.thinking)
        reasoning, content = s.push(text)
        if finish_reason is not None:
            reasoning += s.finish()
        delta: dict[str, Any] = {"reasoning_content": reasoning} if reasoning else {}
        rest, finish_reason = self._content(index, content, finish_reason)
        return delta | rest, finish_reason

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The blocking response's message and finish_reason for a choice's whole text."""
        if self.reasoning is None:
            assert self.tools is not None
            return self.tools.message(text, finish_reason)
        reasoning, content = split(text, self.thinking)
        if self.tools is not None:
            message, finish_reason = self.tools.message(content, finish_reason)
        else:
            message = {"role": "assistant", "content": content}
        if self.thinking and not message["content"]:
            message["content"] = None
        return {**message, "reasoning_content": reasoning or None}, finish_reason
