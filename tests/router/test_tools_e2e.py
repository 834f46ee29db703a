"""Tool calling with the real `openai` client against `pipeserve up` serving a live qwen2 demo group.

The router is started with a Qwen2.5-style tool template (tests/tools_support.py) and
`--tool-call-parser hermes`. A tool round trip (an assistant's tool_calls, then tool messages)
is served from exactly the prompt tokens `apply_chat_template(tools=...)` gives, and the greedy
output equals transformers'. A second router over the same group, without a parser, refuses
`tool_choice: auto` with a 400 naming `tool_choice`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from tools_support import QWEN_TOOLS_TEMPLATE, ROUND_TRIP, TOOLS, hf_messages
from transformers import AutoTokenizer

from conftest import hf_greedy
from router_support import RouterHarness
from serving_support import UpProcess, running_up

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("template") / "qwen_tools.jinja"
    path.write_text(QWEN_TOOLS_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def up(qwen2_dir: Path, template: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    args = ("--model", str(qwen2_dir), "--stages", "2", "--num-kv-blocks", "512")
    args += ("--chat-template", str(template), "--tool-call-parser", "hermes")
    with running_up(*args, log_dir=tmp_path_factory.mktemp("up-tools")) as server:
        yield server


@pytest.fixture(scope="module")
def client(up: UpProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=up.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _hf_prompt(qwen2_dir: Path, messages: list[dict], tools: list | None) -> list[int]:
    tok = AutoTokenizer.from_pretrained(str(qwen2_dir))
    ids = tok.apply_chat_template(
        messages, tools=tools, chat_template=QWEN_TOOLS_TEMPLATE, add_generation_prompt=True, tokenize=True
    )
    return list(ids if isinstance(ids, list) else ids["input_ids"])


@pytest.mark.parametrize("choice", ["none", "auto"])
def test_tool_round_trip_serves_apply_chat_templates_prompt(
    client: openai.OpenAI, qwen2_dir: Path, choice: str
) -> None:
    model = str(qwen2_dir)
    got = client.chat.completions.create(
        model=model,
        messages=ROUND_TRIP,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice=choice,  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    prompt = _hf_prompt(qwen2_dir, hf_messages(ROUND_TRIP), TOOLS)
    c = got.choices[0]
    assert c.prompt_token_ids == prompt  # type: ignore[attr-defined]
    assert got.usage is not None and got.usage.prompt_tokens == len(prompt)
    want = hf_greedy(qwen2_dir, prompt, MAX_TOKENS)
    assert c.token_ids == want  # type: ignore[attr-defined]
    text = AutoTokenizer.from_pretrained(str(qwen2_dir)).decode(want, skip_special_tokens=True)
    if choice == "none" or "<tool_call>" not in text:  # the random demo model writes no call
        assert c.message.content == text and not c.message.tool_calls
        assert c.finish_reason in ("stop", "length")
    stream = client.chat.completions.create(
        model=model,
        messages=ROUND_TRIP,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice=choice,  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
    )
    chunks = list(stream)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == (
        c.message.content or ""
    )
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finish == [c.finish_reason]


def test_without_tools_the_template_gets_none(client: openai.OpenAI, qwen2_dir: Path) -> None:
    messages = [{"role": "user", "content": "Say hi."}]
    got = client.chat.completions.create(
        model=str(qwen2_dir),
        messages=messages,  # type: ignore[arg-type]
        max_tokens=2,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    assert got.choices[0].prompt_token_ids == _hf_prompt(qwen2_dir, messages, None)  # type: ignore[attr-defined]


def test_bad_tools_are_400_and_the_server_stays_healthy(client: openai.OpenAI, qwen2_dir: Path) -> None:
    bad = {"type": "function", "function": {"name": "two words"}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=str(qwen2_dir),
            messages=[{"role": "user", "content": "hi"}],
            tools=[TOOLS[0], bad],  # type: ignore[list-item]
        )
    assert err.value.body["param"] == "tools[1].function.name"  # type: ignore[index]
    ok = client.chat.completions.create(
        model=str(qwen2_dir), messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_auto_without_a_parser_is_400(up: UpProcess, qwen2_dir: Path, template: Path) -> None:
    """A second router, without --tool-call-parser, over the same live group."""
    target = up.groups()[0]["grpc"]
    with RouterHarness(qwen2_dir, {"g0": target}, chat_template=str(template)) as h:
        client = openai.OpenAI(base_url=h.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        messages = [{"role": "user", "content": "hi"}]
        for kw in ({}, {"tool_choice": "auto"}):
            with pytest.raises(openai.BadRequestError) as err:
                client.chat.completions.create(model=str(qwen2_dir), messages=messages, tools=TOOLS, **kw)  # type: ignore[arg-type]
            assert err.value.body["param"] == "tool_choice"  # type: ignore[index]
            assert "--tool-call-parser" in err.value.body["message"]  # type: ignore[index]
        ok = client.chat.completions.create(
            model=str(qwen2_dir),
            messages=messages,
            tools=TOOLS,
            tool_choice="none",
            max_tokens=2,  # type: ignore[arg-type]
        )
        assert ok.choices[0].message.content is not None
