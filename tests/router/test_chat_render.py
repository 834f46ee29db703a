"""Chat prompts rendered exactly as transformers' apply_chat_template renders them.

Each case goes the router's way (parse_chat on the request body, then TokenizerAssets.render_chat
with the request's chat_template_kwargs, add_generation_prompt and continue_final_message) and
transformers' way (AutoTokenizer.apply_chat_template with the same values), on the project's demo
tokenizers (their own templates) and on a Qwen3-style and a Mistral-style family
(tests/chat_families_support.py). Bad values are 400s naming the field.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from chat_families_support import MISTRAL_TEMPLATE, QWEN3_TEMPLATE, family_dir
from tools_support import ROUND_TRIP, TOOLS, hf_messages
from transformers import AutoTokenizer

from pipeserve.errors import InvalidRequestError
from pipeserve.router.api.protocol import parse_chat
from pipeserve.router.errors import APIError
from pipeserve.tokenizer import TokenizerAssets

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]
THOUGHT = [
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "Two and two."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "6", "reasoning": "Three and three."},  # vLLM's newer name
]
PREFILL = [{"role": "user", "content": "Count to three."}, {"role": "assistant", "content": "One, two,"}]
MISTRAL_ROUND_TRIP = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "a1B2c3D4e",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "a1B2c3D4e", "content": "19 & sunny"},
]


@pytest.fixture(scope="module")
def qwen3_dir(qwen2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return family_dir(qwen2_dir, tmp_path_factory.mktemp("qwen3-tok"), "qwen3")


@pytest.fixture(scope="module")
def mistral_dir(qwen2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return family_dir(qwen2_dir, tmp_path_factory.mktemp("mistral-tok"), "mistral")


def _both(model_dir: Path, template: str | None, body: dict) -> tuple[str, str]:
    """(the router's prompt, transformers') for a request body."""
    req = parse_chat(copy.deepcopy(body))
    a = req.chat_args
    ours = TokenizerAssets.load(model_dir, template).render_chat(
        req.messages, req.tools.tools, a.add_generation_prompt, a.continue_final_message, a.template_kwargs
    )
    hf = AutoTokenizer.from_pretrained(str(model_dir))
    extra = {k: body[k] for k in ("add_generation_prompt", "continue_final_message") if k in body}
    if body.get("continue_final_message") and "add_generation_prompt" not in body:
        extra["add_generation_prompt"] = False
    extra.setdefault("add_generation_prompt", True)
    theirs = hf.apply_chat_template(
        hf_messages(body["messages"]),
        tools=body.get("tools"),
        chat_template=template,
        tokenize=False,
        **extra,
        **(body.get("chat_template_kwargs") or {}),
    )
    return ours, theirs


CASES = [
    ("chat", {"messages": CHAT}),
    ("no generation prompt", {"messages": CHAT, "add_generation_prompt": False}),
    ("thinking on", {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": True}}),
    ("thinking off", {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}}),
    ("tools", {"messages": ROUND_TRIP, "tools": TOOLS, "tool_choice": "none"}),
    ("earlier reasoning", {"messages": THOUGHT}),
    ("continue the final message", {"messages": PREFILL, "continue_final_message": True}),
    ("kwargs beside the special tokens", {"messages": CHAT, "chat_template_kwargs": {"eos_token": "<e>"}}),
]


@pytest.mark.parametrize(("name", "body"), CASES, ids=[c[0] for c in CASES])
def test_qwen3_style_template(qwen3_dir: Path, name: str, body: dict) -> None:
    ours, theirs = _both(qwen3_dir, None, body)
    assert ours == theirs
    if name == "thinking off":
        assert ours.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    if name == "earlier reasoning":  # the last turn's reasoning, under either name, is rendered
        assert "<think>\nThree and three.\n</think>\n\n6" in ours and "Two and two." not in ours
    if name == "continue the final message":
        assert ours.endswith("One, two,")


@pytest.mark.parametrize(("name", "body"), CASES[:4] + CASES[6:7], ids=[c[0] for c in CASES[:4] + CASES[6:7]])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_demo_templates(request: pytest.FixtureRequest, arch: str, name: str, body: dict) -> None:
    model_dir = request.getfixturevalue(f"{arch}_dir")
    ours, theirs = _both(model_dir, None, body)
    assert ours == theirs


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [{"role": "system", "content": "Be brief."}, *MISTRAL_ROUND_TRIP], "tools": TOOLS},
        {"messages": MISTRAL_ROUND_TRIP[:1], "tools": TOOLS, "tool_choice": "none"},
        {"messages": CHAT},
    ],
    ids=["round trip", "tools", "chat"],
)
def test_mistral_style_template(mistral_dir: Path, body: dict) -> None:
    ours, theirs = _both(mistral_dir, None, body)
    assert ours == theirs and ours.startswith("<s>")


def test_mistral_template_refuses_other_call_ids(mistral_dir: Path) -> None:
    messages = copy.deepcopy(MISTRAL_ROUND_TRIP)
    messages[1]["tool_calls"][0]["id"] = "call_0123456789abcdef01234567"
    req = parse_chat({"messages": messages})
    with pytest.raises(InvalidRequestError, match="length 9") as e:
        TokenizerAssets.load(mistral_dir).render_chat(req.messages)
    assert e.value.param == "messages"


def test_generation_block_renders_its_body(qwen2_dir: Path) -> None:
    """`{% generation %}` (transformers' assistant-mask tag) parses and renders what it holds."""
    template = (
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
        "{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}"
    )
    body = {"messages": [*CHAT, {"role": "assistant", "content": "Paris"}], "add_generation_prompt": False}
    ours, theirs = _both(qwen2_dir, template, body)
    assert ours == theirs == "Be brief.Capital of France?Paris"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize"),
        ({"chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, "chat_template_kwargs.chat_template"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
        ({"chat_template_kwargs": {"x": "\ud800"}}, "chat_template_kwargs"),
        ({"add_generation_prompt": "yes"}, "add_generation_prompt"),
        ({"continue_final_message": 1}, "continue_final_message"),
        ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
        (
            {"chat_template_kwargs": {"continue_final_message": True}, "add_generation_prompt": True},
            "continue_final_message",
        ),
    ],
)
def test_bad_rendering_fields_are_400(body: dict, param: str) -> None:
    with pytest.raises(APIError) as e:
        parse_chat({"messages": CHAT, **body})
    assert e.value.status == 400 and e.value.param == param


def test_a_kwarg_the_template_cannot_use_is_a_400(qwen2_dir: Path) -> None:
    """A value of the wrong type for the template's code: a 400 naming chat_template_kwargs."""
    req = parse_chat({"messages": CHAT, "chat_template_kwargs": {"bos_token": 7}})
    tok = TokenizerAssets.load(qwen2_dir, "{{ bos_token + messages[0].content }}")
    with pytest.raises(InvalidRequestError) as e:
        tok.render_chat(req.messages, template_kwargs=req.chat_args.template_kwargs)
    assert e.value.param == "chat_template_kwargs" and "TypeError" in e.value.message
    prefill = parse_chat({"messages": PREFILL, "continue_final_message": True})
    dropping = TokenizerAssets.load(qwen2_dir, "{% for m in messages %}{{ m.role }}{% endfor %}")
    with pytest.raises(InvalidRequestError) as e:
        dropping.render_chat(prefill.messages, None, False, True)
    assert e.value.param == "continue_final_message"


def test_qwen3_template_text_is_the_families(qwen3_dir: Path, mistral_dir: Path) -> None:
    """The family dirs carry the templates in tokenizer_config.json, where transformers reads them."""
    assert TokenizerAssets.load(qwen3_dir).chat_template == QWEN3_TEMPLATE
    assert TokenizerAssets.load(mistral_dir).chat_template == MISTRAL_TEMPLATE
