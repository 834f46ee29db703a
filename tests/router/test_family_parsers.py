"""The families' parsers, alone: mistral's `[TOOL_CALLS]` (router/features/tool_parsers/mistral.py) and the
`<think>` reasoning split (router/features/reasoning.py).

As for the other tool parsers (test_tools_parsers.py), every case is checked three ways: one push,
every two-piece split, one character per push; the results must be equal, and text that may still
turn into a tag is never released first.
"""

from __future__ import annotations

import re

import pytest

from pipeserve.config import REASONING_PARSERS as REASONING_CHOICES
from pipeserve.config import TOOL_CALL_PARSERS, RouterConfig
from pipeserve.errors import ConfigError
from pipeserve.router.features.reasoning import REASONING_PARSERS, ReasoningSplitter, split
from pipeserve.router.features.tool_output import ToolCallOutput
from pipeserve.router.features.tool_parsers import PARSERS, Text, merge
from pipeserve.router.features.tools import parse_tools

WEATHER = ("get_weather", '{"city": "Paris", "unit": "celsius"}')
TIME = ("get_time", '{"tz": "Europe/Paris"}')
W = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
T = '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}'

MISTRAL = [
    ("plain text", "Paris [is] in France.", ("Paris [is] in France.", [])),
    ("one call", f"[TOOL_CALLS][{W}]", ("", [WEATHER])),
    ("parallel calls", f"[TOOL_CALLS] [{W}, {T}]", ("", [WEATHER, TIME])),
    ("text before", f"Checking. [TOOL_CALLS][{W}]", ("Checking. ", [WEATHER])),
    ("newer form", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}', ("", [WEATHER])),
    (
        "newer form, parallel",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]get_time[ARGS]'
        '{"tz": "Europe/Paris"}',
        ("", [WEATHER, TIME]),
    ),
    ("newer form, no [ARGS]", '[TOOL_CALLS]get_time{"tz": "Europe/Paris"}', ("", [TIME])),
    ("malformed JSON is content, without the tag", "[TOOL_CALLS][{oops}]", ("[{oops}]", [])),
    ("nameless object is content", '[TOOL_CALLS][{"x": 1}]', ('[{"x": 1}]', [])),
    ("a tag then prose is content", "[TOOL_CALLS] sorry, no.", (" sorry, no.", [])),
    ("calls, then text", f"[TOOL_CALLS][{W}]\n Done.", ("Done.", [WEATHER])),
    ("a partial tag at the end is content", "Answer: [TOOL_CA", ("Answer: [TOOL_CA", [])),
    ("unclosed array keeps its calls", f"[TOOL_CALLS][{W}, {T}", ("", [WEATHER, TIME])),
    (
        "cut inside the arguments",
        '[TOOL_CALLS][{"name": "f", "arguments": {"a": [1',
        ("", [("f", '{"a": [1')]),
    ),
]

# (text, thinking) -> (reasoning, content)
REASONING = [
    ("start tag generated", "<think>\nhm\n</think>\n\nParis.", True, ("\nhm\n", "\n\nParis.")),
    ("no start tag, end tag present", "hm, France\n</think>\n\nParis.", True, ("hm, France\n", "\n\nParis.")),
    ("no end tag: cut while thinking", "<think>still thinking", True, ("still thinking", "")),
    ("end tag first", "</think>Paris.", True, ("", "Paris.")),
    ("a second start tag is reasoning text", "<think>a<think>b</think>c", True, ("a<think>b", "c")),
    ("a second end tag is content", "a</think>b</think>c", True, ("a", "b</think>c")),
    ("tags split mid-way stay whole", "a </thin k> b</think>c", True, ("a </thin k> b", "c")),
    ("a cut-off end tag is reasoning", "thinking</thi", True, ("thinking</thi", "")),
    ("thinking off: all content", "<think>a</think>b", False, ("", "<think>a</think>b")),
]


def _pieces(make, pieces: list[str]) -> list:
    p = make()
    events = []
    for piece in pieces:
        events += p.push(piece)
    return events + p.finish()


@pytest.mark.parametrize(("name", "text", "want"), MISTRAL, ids=[c[0] for c in MISTRAL])
def test_mistral(name: str, text: str, want: tuple) -> None:
    make = PARSERS["mistral"]
    assert merge(_pieces(make, [text])) == want
    assert merge(_pieces(make, list(text))) == want, "one character per push"
    for k in range(len(text) + 1):
        assert merge(_pieces(make, [text[:k], text[k:]])) == want, f"split at {k}"


def test_mistral_never_releases_a_partial_tag() -> None:
    p = PARSERS["mistral"]()
    content = ""
    for c in f"Sure. [TOOL_CALLS][{W}]":
        content += "".join(e.text for e in p.push(c) if isinstance(e, Text))
        assert "Sure. ".startswith(content) or content == "Sure. ", content


def test_mistral_call_ids_are_nine_alphanumerics() -> None:
    """Mistral's templates refuse any other id when the call comes back; every call gets one."""
    out = ToolCallOutput(parse_tools({"tools": [{"type": "function", "function": {"name": "f"}}]}), "mistral")
    message, finish = out.message('[TOOL_CALLS][{"name": "f", "arguments": {}}, {"name": "f"}]', "stop")
    ids = [c["id"] for c in message["tool_calls"]]
    assert finish == "tool_calls" and len(ids) == 2 and len(set(ids)) == 2
    assert all(re.fullmatch("[A-Za-z0-9]{9}", i) for i in ids), ids
    delta, _ = out.delta(0, '[TOOL_CALLS][{"name": "f", "arguments": {}}]', "stop")
    assert re.fullmatch("[A-Za-z0-9]{9}", delta["tool_calls"][0]["id"])
    hermes = ToolCallOutput(
        parse_tools({"tools": [{"type": "function", "function": {"name": "f"}}]}), "hermes"
    )
    assert hermes.message('<tool_call>{"name": "f"}</tool_call>', "stop")[0]["tool_calls"][0][
        "id"
    ].startswith("call_")


@pytest.mark.parametrize(("name", "text", "thinking", "want"), REASONING, ids=[c[0] for c in REASONING])
def test_reasoning_split(name: str, text: str, thinking: bool, want: tuple) -> None:
    assert split(text, thinking) == want

    def pieces(parts: list[str]) -> tuple[str, str]:
        s = ReasoningSplitter(thinking)
        got = [s.push(p) for p in parts]
        return "".join(r for r, _ in got) + s.finish(), "".join(c for _, c in got)

    assert pieces(list(text)) == want, "one character per push"
    for k in range(len(text) + 1):
        assert pieces([text[:k], text[k:]]) == want, f"split at {k}"


def test_reasoning_never_releases_a_partial_end_tag_as_reasoning() -> None:
    s = ReasoningSplitter(True)
    released = "".join(s.push(c)[0] for c in "ok</think>")
    assert released == "ok"


def test_only_qwen3_turns_thinking_off() -> None:
    off = {"enable_thinking": False}
    assert not REASONING_PARSERS["qwen3"].thinking(off) and REASONING_PARSERS["qwen3"].thinking({})
    assert REASONING_PARSERS["deepseek_r1"].thinking(off)


def test_registries_match_the_flags_choices(qwen2_dir) -> None:
    assert tuple(REASONING_PARSERS) == REASONING_CHOICES and tuple(PARSERS) == TOOL_CALL_PARSERS
    assert RouterConfig(model=str(qwen2_dir), reasoning_parser="qwen3").reasoning_parser == "qwen3"
    with pytest.raises(ConfigError, match=r"reasoning_parser: must be one of \('deepseek_r1', 'qwen3'\)"):
        RouterConfig(model=str(qwen2_dir), reasoning_parser="granite")
