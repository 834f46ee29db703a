"""The tool-call parsers (router/features/tool_parsers): results, and the same result whatever the split.

Every case is checked three ways: one push, every two-piece split, one character per push; the
merged events must be equal. Where text may still begin a call, it is never released as content.
"""

from __future__ import annotations

import json

import pytest

from pipeserve.router.features.tool_parsers import (
    PARSERS,
    NamedParser,
    RequiredParser,
    Text,
    ToolParser,
    merge,
)

W = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
T = '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}'
WEATHER = ("get_weather", '{"city": "Paris", "unit": "celsius"}')
TIME = ("get_time", '{"tz": "Europe/Paris"}')

HERMES = [
    (
        "plain text, no call",
        "The sky is blue. 1 < 2 and <b>bold</b>.",
        ("The sky is blue. 1 < 2 and <b>bold</b>.", []),
    ),
    ("one call", f"<tool_call>\n{W}\n</tool_call>", ("", [WEATHER])),
    (
        "parallel calls",
        f"<tool_call>\n{W}\n</tool_call>\n<tool_call>\n{T}\n</tool_call>",
        ("", [WEATHER, TIME]),
    ),
    (
        "text before",
        f"Let me look that up.\n<tool_call>\n{W}\n</tool_call>",
        ("Let me look that up.", [WEATHER]),
    ),
    (
        "text between and after",
        f"A<tool_call>{W}</tool_call> B <tool_call>{T}</tool_call>\nC",
        ("ABC", [WEATHER, TIME]),
    ),
    (
        "arguments first, nested, escapes, a tag inside a string",
        '<tool_call>{"arguments": {"q": "a \\"</tool_call>\\" b", "n": [1, -2.5e3, true, null, {"x": []}]}, '
        '"name": "search"}</tool_call>',
        ("", [("search", '{"q": "a \\"</tool_call>\\" b", "n": [1, -2.5e3, true, null, {"x": []}]}')]),
    ),
    ("no arguments", '<tool_call>{"name": "ping"}</tool_call>', ("", [("ping", "{}")])),
    (
        "malformed block is content",
        "Hi <tool_call>not json</tool_call> there",
        ("Hi<tool_call>not json</tool_call>there", []),
    ),
    (
        "nameless object is content",
        '<tool_call>{"x": 1}</tool_call>',
        ('<tool_call>{"x": 1}</tool_call>', []),
    ),
    (
        "malformed then valid",
        f"<tool_call>{{oops</tool_call><tool_call>{W}</tool_call>",
        ("<tool_call>{oops</tool_call>", [WEATHER]),
    ),
    ("unclosed block keeps the call", f"<tool_call>\n{W}", ("", [WEATHER])),
    (
        "cut inside the arguments",
        '<tool_call>{"name": "f", "arguments": {"a": [1, 2',
        ("", [("f", '{"a": [1, 2')]),
    ),
    (
        "an end tag cuts open arguments",
        '<tool_call>{"name": "f", "arguments": {"a": 1</tool_call>ok',
        ("ok", [("f", '{"a": 1')]),
    ),
    ("cut before the name is content", '<tool_call>\n{"na', ('<tool_call>\n{"na', [])),
    ("a partial tag at the end is content", "Answer: <tool_ca", ("Answer: <tool_ca", [])),
    ("garbage after the object is dropped", f"<tool_call>{W} trailing</tool_call>", ("", [WEATHER])),
]

LLAMA = [
    ("plain text", "Paris is in France. {not a call}", ("Paris is in France. {not a call}", [])),
    (
        "one call, python tag",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
        ("", [WEATHER]),
    ),
    (
        "one call, no tag, leading whitespace",
        '\n {"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
        ("", [WEATHER]),
    ),
    (
        "parallel calls separated by ;",
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
        '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}};',
        ("", [WEATHER, TIME]),
    ),
    (
        "text after the calls",
        '{"name": "get_time", "parameters": {"tz": "Europe/Paris"}} and then some',
        (" and then some", [TIME]),
    ),
    ("a JSON answer, not a call", '{"answer": 42}', ('{"answer": 42}', [])),
    ("malformed JSON is content", '<|python_tag|>{"name" 1}', ('<|python_tag|>{"name" 1}', [])),
    ("a tag then code is content", "<|python_tag|>print(1)", ("<|python_tag|>print(1)", [])),
    ("unclosed call keeps its arguments", '{"name": "f", "parameters": {"a": 1', ("", [("f", '{"a": 1')])),
]

REQUIRED = [
    (
        "two calls",
        '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}, '
        '{"name": "get_time", "parameters": {"tz": "Europe/Paris"}}]',
        ("", [WEATHER, TIME]),
    ),
    ("pretty printed", '[\n  {\n    "name": "ping",\n    "parameters": {}\n  }\n]\n', ("", [("ping", "{}")])),
    ("not an array is content", "sorry", ("sorry", [])),
]


def _one_push(make, text: str) -> list:
    p = make()
    return p.push(text) + p.finish()


def _pieces(make, pieces: list[str]) -> list:
    p = make()
    events = []
    for piece in pieces:
        events += p.push(piece)
    return events + p.finish()


def _assert_split_invariant(make, text: str, want: tuple) -> None:
    assert merge(_one_push(make, text)) == want
    assert merge(_pieces(make, list(text))) == want, "one character per push"
    for k in range(len(text) + 1):
        assert merge(_pieces(make, [text[:k], text[k:]])) == want, (
            f"split at {k}: {text[:k]!r} | {text[k:]!r}"
        )


@pytest.mark.parametrize(("name", "text", "want"), HERMES, ids=[c[0] for c in HERMES])
def test_hermes(name: str, text: str, want: tuple) -> None:
    _assert_split_invariant(PARSERS["hermes"], text, want)


@pytest.mark.parametrize(("name", "text", "want"), LLAMA, ids=[c[0] for c in LLAMA])
def test_llama3_json(name: str, text: str, want: tuple) -> None:
    _assert_split_invariant(PARSERS["llama3_json"], text, want)


@pytest.mark.parametrize(("name", "text", "want"), REQUIRED, ids=[c[0] for c in REQUIRED])
def test_required_array(name: str, text: str, want: tuple) -> None:
    _assert_split_invariant(RequiredParser, text, want)


def test_named_choice_takes_the_whole_output_as_arguments() -> None:
    args = '{"city": "Paris"}'
    _assert_split_invariant(lambda: NamedParser("get_weather"), args, ("", [("get_weather", args)]))
    assert merge(_one_push(lambda: NamedParser("f"), "")) == ("", [("f", "")])


@pytest.mark.parametrize("name", ["hermes", "llama3_json"])
def test_valid_arguments_are_json(name: str) -> None:
    text = f"<tool_call>{W}</tool_call>" if name == "hermes" else W
    _, calls = merge(_one_push(PARSERS[name], text))
    assert json.loads(calls[0][1]) == {"city": "Paris", "unit": "celsius"}


def _content_so_far(p: ToolParser, pieces: list[str]) -> list[str]:
    """The content released after each push (before finish)."""
    seen = []
    text = ""
    for piece in pieces:
        text += "".join(e.text for e in p.push(piece) if isinstance(e, Text))
        seen.append(text)
    return seen


def test_hermes_never_releases_a_partial_tag_as_content() -> None:
    text = f"Checking.\n<tool_call>\n{W}\n</tool_call>"
    for content in _content_so_far(PARSERS["hermes"](), list(text)):
        assert "<" not in content and "Checking.".startswith(content), content
    # A call's name is given once whole: no event names a prefix of it.
    p = PARSERS["hermes"]()
    names = [e.name for c in text for e in p.push(c) if hasattr(e, "name")]
    assert names == ["get_weather"]


def test_llama3_json_holds_a_leading_object_until_it_is_decided() -> None:
    for content in _content_so_far(PARSERS["llama3_json"](), list('  {"name": "f", "parameters": {}}')):
        assert content == ""
    released = _content_so_far(PARSERS["llama3_json"](), list("Hi {x"))
    assert released[-1] == "Hi {x"  # plain text streams as soon as it is known not to be a call
