"""The families' chat conventions through the live router: reasoning, hermes and mistral calls.

A scripted stage (tests/router_support.py) replies with a family tokenizer's ids for a model's
text, one token per message, so the text crosses the router's detokenizer as a model's would.
For each parser: plain text, reasoning + content, reasoning + a tool call, tool calls only and
malformed output, blocking and streamed; streamed deltas add up to the blocking message, reasoning
never streams as content, and every body and chunk is validated by the `openai` package's types.
The prompt the stage gets is apply_chat_template's, chat_template_kwargs included.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from chat_families_support import family_dir
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from tokenizers import Tokenizer
from tools_support import TOOLS
from transformers import AutoTokenizer

from router_support import RouterHarness, ScriptedStage

USER = [{"role": "user", "content": "Weather in Paris?"}]
W = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
WEATHER = ("get_weather", '{"city": "Paris", "unit": "celsius"}')


def _harness(model_dir: Path, **config) -> RouterHarness:
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    stage = ScriptedStage([], vocab_size=tok.get_vocab_size(), max_model_len=4096)
    return RouterHarness(model_dir, {"g0": stage}, **config)


@pytest.fixture(scope="module")
def qwen3(qwen2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterHarness]:
    d = family_dir(qwen2_dir, tmp_path_factory.mktemp("qwen3"), "qwen3")
    with _harness(d, tool_call_parser="hermes", reasoning_parser="qwen3") as h:
        yield h


@pytest.fixture(scope="module")
def mistral(qwen2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterHarness]:
    with _harness(
        family_dir(qwen2_dir, tmp_path_factory.mktemp("mistral"), "mistral"), tool_call_parser="mistral"
    ) as h:
        yield h


def _reply(h: RouterHarness, text: str, eos: str | None = None) -> list[int]:
    tok = Tokenizer.from_file(str(Path(h.config.model) / "tokenizer.json"))
    ids = tok.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids, skip_special_tokens=False) == text
    if eos is not None:  # the end-of-turn token the model stops on (special: never in the text)
        ids.append(tok.token_to_id(eos))
    stage = h.stages["g0"]
    assert isinstance(stage, ScriptedStage)
    h.call(lambda: setattr(stage, "reply", ids))
    return ids


def _blocking(h: RouterHarness, body: dict) -> ChatCompletion:
    r = httpx.post(h.url + "/v1/chat/completions", json={"max_tokens": 500, **body}, timeout=30)
    assert r.status_code == 200, r.text
    return ChatCompletion.model_validate(r.json())


def _streamed(h: RouterHarness, body: dict) -> tuple[str | None, str | None, list, str | None]:
    """What the chunks add up to: (reasoning, content, [(name, arguments)], finish_reason); checks
    that no content or call precedes reasoning's end and that each call's first entry has its id."""
    body = {"max_tokens": 500, **body, "stream": True}
    with httpx.stream("POST", h.url + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200, r.read()
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    reasoning = content = finish = None
    calls: dict[int, list] = {}
    for raw in events[:-1]:
        chunk = ChatCompletionChunk.model_validate(json.loads(raw))
        (choice,) = chunk.choices
        d = json.loads(raw)["choices"][0]["delta"]
        if d.get("reasoning_content"):
            assert content is None and not calls, "reasoning after content"
            reasoning = (reasoning or "") + d["reasoning_content"]
        if d.get("content"):
            content = (content or "") + d["content"]
        for tc in choice.delta.tool_calls or []:
            if tc.index not in calls:
                assert tc.id and tc.function and tc.function.name
                calls[tc.index] = [tc.function.name, tc.function.arguments or ""]
            else:
                calls[tc.index][1] += tc.function.arguments or "" if tc.function else ""
        if choice.finish_reason:
            finish = choice.finish_reason
    return reasoning, content, [tuple(calls[i]) for i in sorted(calls)], finish


def _got(c: ChatCompletion) -> tuple:
    (choice,) = c.choices
    m = choice.message
    calls = [(t.function.name, t.function.arguments) for t in m.tool_calls or []]
    return getattr(m, "reasoning_content", None), m.content, calls, choice.finish_reason


QWEN3_CASES = [
    ("plain text, thinking off", "Paris.", {"enable_thinking": False}, (None, "Paris.", [], "stop")),
    (
        "reasoning + content",
        "Paris is the capital.\n</think>\n\nParis.",
        None,
        ("Paris is the capital.\n", "\n\nParis.", [], "stop"),
    ),
    ("start tag generated", "<think>\nhm\n</think>\n\nParis.", None, ("\nhm\n", "\n\nParis.", [], "stop")),
    (
        "reasoning + tool call",
        f"Need the weather.\n</think>\n\n<tool_call>\n{W}\n</tool_call>",
        None,
        ("Need the weather.\n", None, [WEATHER], "tool_calls"),
    ),
    (
        "tool calls only, thinking off",
        f"<tool_call>\n{W}\n</tool_call>",
        {"enable_thinking": False},
        (None, None, [WEATHER], "tool_calls"),
    ),
    (
        "a call written while thinking is reasoning",
        f"<tool_call>\n{W}\n</tool_call></think>Done.",
        None,
        (f"<tool_call>\n{W}\n</tool_call>", "Done.", [], "stop"),
    ),
    (
        "malformed call is content",
        "ok</think><tool_call>not json</tool_call>",
        None,
        ("ok", "<tool_call>not json</tool_call>", [], "stop"),
    ),
    ("cut while thinking", "still thinking about it", None, ("still thinking about it", None, [], "stop")),
]


@pytest.mark.parametrize(("name", "text", "kwargs", "want"), QWEN3_CASES, ids=[c[0] for c in QWEN3_CASES])
def test_qwen3_reasoning_and_hermes_calls(
    qwen3: RouterHarness, name: str, text: str, kwargs, want: tuple
) -> None:
    ids = _reply(qwen3, text, eos="<|im_end|>")
    body: dict = {"messages": USER, "tools": TOOLS}
    if kwargs is not None:
        body["chat_template_kwargs"] = kwargs
    done = _blocking(qwen3, body)
    assert _got(done) == want
    assert done.usage is not None and done.usage.completion_tokens == len(ids)  # reasoning counts
    assert _streamed(qwen3, body) == want


def test_prompt_is_apply_chat_templates_with_the_kwargs(qwen3: RouterHarness) -> None:
    _reply(qwen3, "ok", eos="<|im_end|>")
    hf = AutoTokenizer.from_pretrained(str(Path(qwen3.config.model)))
    stage = qwen3.stages["g0"]
    assert isinstance(stage, ScriptedStage)
    for kwargs in ({}, {"enable_thinking": False}):
        _blocking(
            qwen3, {"messages": USER, "tools": TOOLS, "tool_choice": "none", "chat_template_kwargs": kwargs}
        )
        want = hf.apply_chat_template(USER, tools=TOOLS, add_generation_prompt=True, tokenize=True, **kwargs)
        want = want if isinstance(want, list) else want["input_ids"]
        assert list(stage.requests[-1].prompt_token_ids) == list(want)
    assert "<think>" in hf.decode(list(stage.requests[-1].prompt_token_ids))  # the switch reached it
    _blocking(
        qwen3,
        {"messages": [*USER, {"role": "assistant", "content": "It is"}], "continue_final_message": True},
    )
    assert hf.decode(list(stage.requests[-1].prompt_token_ids)).endswith("It is")


def test_deepseek_r1_has_no_switch(qwen2_dir: Path, tmp_path: Path) -> None:
    d = family_dir(qwen2_dir, tmp_path / "r1", "qwen3")
    with _harness(d, reasoning_parser="deepseek_r1") as h:
        _reply(h, "hm</think>Paris.", eos="<|im_end|>")
        body = {"messages": USER, "chat_template_kwargs": {"enable_thinking": False}}
        assert _got(_blocking(h, body)) == ("hm", "Paris.", [], "stop")
        assert _streamed(h, body) == ("hm", "Paris.", [], "stop")


MISTRAL_CASES = [
    ("plain text", "Paris [1].", ("Paris [1].", [], "stop")),
    ("tool calls only", f"[TOOL_CALLS][{W}]", (None, [WEATHER], "tool_calls")),
    ("text, then calls", f"Let me check.[TOOL_CALLS] [{W}]", ("Let me check.", [WEATHER], "tool_calls")),
    (
        "newer form",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}',
        (None, [WEATHER], "tool_calls"),
    ),
    ("malformed", "[TOOL_CALLS][{oops", ("[{oops", [], "stop")),
]


@pytest.mark.parametrize(("name", "text", "want"), MISTRAL_CASES, ids=[c[0] for c in MISTRAL_CASES])
def test_mistral_calls(mistral: RouterHarness, name: str, text: str, want: tuple) -> None:
    _reply(mistral, text, eos="</s>")
    body = {"messages": USER, "tools": TOOLS}
    done = _blocking(mistral, body)
    assert _got(done)[1:] == want
    for call in done.choices[0].message.tool_calls or []:
        assert re.fullmatch("[A-Za-z0-9]{9}", call.id), call.id
    assert _streamed(mistral, body)[1:] == want
    if not want[1]:  # special tokens other than the parser's stay out of the text
        plain = _blocking(mistral, {"messages": USER})
        assert plain.choices[0].message.content == text.replace("[TOOL_CALLS]", "")


def test_mistral_call_comes_back_through_its_template(mistral: RouterHarness) -> None:
    """The ids the router gives are the ones Mistral's template accepts on the next turn."""
    _reply(mistral, f"[TOOL_CALLS][{W}]", eos="</s>")
    call = _blocking(mistral, {"messages": USER, "tools": TOOLS}).choices[0].message.tool_calls[0]
    history = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": "19 & sunny"},
    ]
    _reply(mistral, "Sunny.", eos="</s>")
    assert _blocking(mistral, {"messages": history, "tools": TOOLS}).choices[0].message.content == "Sunny."
    bad = json.loads(json.dumps(history))
    bad[1]["tool_calls"][0]["id"] = bad[2]["tool_call_id"] = "call_0123456789abcdef01234567"
    r = httpx.post(mistral.url + "/v1/chat/completions", json={"messages": bad, "tools": TOOLS}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert "length 9" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"chat_template_kwargs": "enable_thinking"}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs.tokenize"),
        ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
        ({"chat_template_kwargs": {"enable_thinking": False, "bos_token": 3}}, None),
    ],
)
def test_bad_fields_are_openai_400s(qwen3: RouterHarness, body: dict, param: str | None) -> None:
    r = httpx.post(qwen3.url + "/v1/chat/completions", json={"messages": USER, **body}, timeout=30)
    if param is None:  # the Qwen3-style template does not read bos_token: unused kwargs are harmless
        assert r.status_code == 200, r.text
        return
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]
