"""router/features/structured.py: every spelling of a structured output normalizes to one spec; bad shapes
and two kinds are 400s naming the field (no live group: the compile check is stage 0's)."""

from __future__ import annotations

import json

import pytest

from pipeserve.router.api.protocol import parse_chat, parse_completion
from pipeserve.router.errors import APIError

CHAT = {"messages": [{"role": "user", "content": "x"}]}
COMPACT = {"disable_any_whitespace": True}
SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}


@pytest.mark.parametrize(
    ("field", "kind", "text", "compact"),
    [
        ({"response_format": {"type": "text"}}, "", "", False),
        ({"response_format": {"type": "json_object"}}, "json_object", "", False),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}},
            "json",
            json.dumps(SCHEMA, separators=(",", ":")),
            False,
        ),
        ({"guided_json": SCHEMA}, "json", json.dumps(SCHEMA, separators=(",", ":")), False),
        ({"guided_json": '{"type": "integer"}'}, "json", '{"type": "integer"}', False),
        ({"guided_regex": "[a-z]+"}, "regex", "[a-z]+", False),
        ({"guided_choice": ["a", 'b"c']}, "choice", json.dumps(["a", 'b"c']), False),
        ({"guided_grammar": 'root ::= "x"'}, "grammar", 'root ::= "x"', False),
        (
            {"structured_outputs": {"json_object": True, "disable_any_whitespace": True}},
            "json_object",
            "",
            True,
        ),
        ({"structured_outputs": {"choice": ["y"]}}, "choice", '["y"]', False),
        (
            {
                "response_format": {"type": "json_object"},
                "structured_outputs": {"disable_any_whitespace": True},
            },
            "json_object",
            "",
            True,
        ),
    ],
)
def test_every_spelling_normalizes_on_both_endpoints(
    field: dict, kind: str, text: str, compact: bool
) -> None:
    for params in (parse_chat({**CHAT, **field}).params, parse_completion({"prompt": "x", **field}).params):
        assert (params.structured_kind, params.structured, params.structured_compact) == (kind, text, compact)


@pytest.mark.parametrize(
    ("field", "param"),
    [
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": "json"}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
            "response_format.json_schema.name",
        ),
        ({"guided_json": 3}, "guided_json"),
        ({"guided_json": ""}, "guided_json"),
        ({"guided_regex": ""}, "guided_regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": ["a", 1]}, "guided_choice"),
        ({"guided_choice": ["\ud800"]}, "guided_choice"),
        ({"guided_grammar": ["x"]}, "guided_grammar"),
        ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex"),
        ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
        ({"structured_outputs": {"disable_any_whitespace": 1}}, "structured_outputs.disable_any_whitespace"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ({"response_format": {"type": "json_object"}, "guided_json": {}}, "guided_json"),
        ({"guided_json": {}, "structured_outputs": {"regex": "a"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"regex": "a", "grammar": 'root ::= "a"'}}, "structured_outputs.grammar"),
    ],
)
def test_bad_shapes_and_two_kinds_are_400_naming_the_field(field: dict, param: str) -> None:
    for parse, body in ((parse_chat, CHAT), (parse_completion, {"prompt": "x"})):
        with pytest.raises(APIError) as err:
            parse({**body, **field})
        assert err.value.status == 400 and err.value.param == param, err.value


def test_compile_is_cached_and_bounded(llama_dir) -> None:
    from pipeserve.engine import grammar
    from pipeserve.model.config import ModelConfig

    cfg = ModelConfig.from_dir(str(llama_dir), "float32")
    book = grammar.GrammarBook(llama_dir, cfg.vocab_size, cfg.eos_token_ids)
    first = book.compile("regex", "[a-z]+")
    assert book.compile("regex", "[a-z]+") is first and book.compiles == 1
    for i in range(grammar.CACHE_SIZE + 5):
        book.compile("regex", f"x{{{i + 1}}}")
    assert len(book._cache) == grammar.CACHE_SIZE
