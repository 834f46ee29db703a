"""Tool-call parsers, by the name `--tool-call-parser` takes (vLLM's names).

`PARSERS[name]()` makes a fresh parser for one choice; every parser is incremental and gives
the same merged result however its text is split (base.py). The names must equal
config.TOOL_CALL_PARSERS (the flag's choices; config.py cannot import the router).
"""

from __future__ import annotations

from pipeserve.router.features.tool_parsers.base import CallArgs, CallStart, Event, Text, ToolParser, merge
from pipeserve.router.features.tool_parsers.forced import NamedParser, RequiredParser
from pipeserve.router.features.tool_parsers.hermes import HermesParser
from pipeserve.router.features.tool_parsers.llama3_json import Llama3JsonParser
from pipeserve.router.features.tool_parsers.mistral import MistralParser

PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}

__all__ = [
    "PARSERS",
    "CallArgs",
    "CallStart",
    "Event",
    "NamedParser",
    "RequiredParser",
    "Text",
    "ToolParser",
    "merge",
]
