"""Structured outputs through the router and a live group, both endpoints, streamed and not:
response_format, vLLM's guided_* and structured_outputs; a spec stage 0 cannot compile is a 400
naming the field the client sent; two kinds are a 400; the openai client's `parse` returns a
parsed model. A random-weight model could write JSON whitespace forever: the JSON tests ask for
`structured_outputs.disable_any_whitespace` (vLLM's option) so objects end."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from router_support import RouterHarness
from serving_support import live_group

pytestmark = pytest.mark.slow
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"type": "string", "enum": ["red", "blue"]}},
    "required": ["ok", "color"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Answer in JSON."}]


class Answer(pydantic.BaseModel):
    ok: bool
    color: Literal["red", "green", "blue"]


@pytest.fixture(scope="module")
def router(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterHarness]:
    with live_group(llama_dir, 1, tmp_path_factory.mktemp("structured")) as slot:
        with RouterHarness(llama_dir, {"g0": slot.grpc_target}, served_model_name="demo") as h:
            yield h


def _post(router: RouterHarness, path: str, body: dict) -> httpx.Response:
    return httpx.post(router.url + path, json={"model": "demo", **body}, timeout=60)


def _text(router: RouterHarness, path: str, body: dict, stream: bool) -> tuple[str, str]:
    """(text, finish_reason) of one choice, streamed (SSE deltas joined) or not."""
    chat = "chat" in path
    if not stream:
        r = _post(router, path, body)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        return (c["message"]["content"] if chat else c["text"]), c["finish_reason"]
    text, finish = "", ""
    with httpx.stream(
        "POST", router.url + path, json={"model": "demo", **body, "stream": True}, timeout=60
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            c = json.loads(line[6:])["choices"][0]
            text += (c["delta"].get("content") or "") if chat else c["text"]
            finish = c.get("finish_reason") or finish
    return text, finish


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("path", "field"),
    [
        ("/v1/completions", {"prompt": "Pick one:", "guided_choice": ["yes", "no"]}),
        ("/v1/completions", {"prompt": "Pick:", "structured_outputs": {"choice": ["up", "down"]}}),
        ("/v1/chat/completions", {"messages": MESSAGES, "guided_choice": ["left", "right"]}),
        ("/v1/chat/completions", {"messages": MESSAGES, "structured_outputs": {"regex": "[ab]{3}"}}),
    ],
)
def test_choice_and_regex_on_both_endpoints(
    router: RouterHarness, path: str, field: dict, stream: bool
) -> None:
    text, finish = _text(router, path, {**field, "max_tokens": 20}, stream)
    assert finish == "stop", text
    so = field.get("structured_outputs", {})
    if "regex" in so:
        assert len(text) == 3 and set(text) <= {"a", "b"}, text
    else:
        assert text in (field.get("guided_choice") or so["choice"]), text


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("path", "field"),
    [
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}},
        ),
        ("/v1/chat/completions", {"guided_json": SCHEMA}),  # a dict, as tool_choice forcing sets it
        ("/v1/completions", {"guided_json": json.dumps(SCHEMA)}),
        (
            "/v1/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}},
        ),
    ],
)
def test_json_schema_on_both_endpoints(router: RouterHarness, path: str, field: dict, stream: bool) -> None:
    body = {"messages": MESSAGES} if "chat" in path else {"prompt": "JSON:"}
    text, finish = _text(router, path, {**body, **field, **COMPACT, "max_tokens": 40}, stream)
    assert finish == "stop", text
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object(router: RouterHarness) -> None:
    body = {"messages": MESSAGES, "response_format": {"type": "json_object"}, **COMPACT, "max_tokens": 60}
    text, finish = _text(router, "/v1/chat/completions", body, False)
    if finish == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # a random-weight model may go on with keys: what it wrote is a JSON object's prefix
        assert text.startswith("{"), text


@pytest.mark.parametrize(
    ("path", "field", "param"),
    [
        (
            "/v1/chat/completions",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": {"type": "nonsense"}},
                }
            },
            "response_format",
        ),
        ("/v1/chat/completions", {"guided_json": {"type": "nonsense"}}, "guided_json"),
        ("/v1/completions", {"guided_regex": "(unclosed"}, "guided_regex"),
        ("/v1/completions", {"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs.grammar"),
        ("/v1/completions", {"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_object"}, "guided_regex": "a"},
            "guided_regex",
        ),
        ("/v1/completions", {"guided_json": "{not json"}, "guided_json"),
    ],
)
def test_bad_or_double_specs_are_400_naming_the_field(
    router: RouterHarness, path: str, field: dict, param: str
) -> None:
    body = {"messages": MESSAGES} if "chat" in path else {"prompt": "x"}
    r = _post(router, path, {**body, **field, "max_tokens": 4})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    ok = _post(router, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200


def test_openai_parse_returns_the_model(router: RouterHarness) -> None:
    with openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0) as client:
        done = client.chat.completions.parse(
            model="demo", messages=MESSAGES, response_format=Answer, max_tokens=60, extra_body=COMPACT
        )
    parsed = done.choices[0].message.parsed
    assert isinstance(parsed, Answer), done
