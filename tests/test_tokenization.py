"""Tokenization as transformers does it: chat templates found where transformers finds them,
special tokens added for completions and not for chat, and the request edge that needs the
tokenizer (no template, lone surrogates, huge prompts, max_tokens beyond the context)."""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from tokenizers import Tokenizer, models, normalizers
from transformers import AutoTokenizer

from conftest import hf_greedy
from pipeserve.errors import InvalidRequestError
from pipeserve.model.demo import BOS_TOKEN, DemoSpec, write_demo_model
from pipeserve.tokenizer import TokenizerAssets
from router_support import RouterHarness, ScriptedStage
from serving_support import UpProcess, running_up

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about ships."}]
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def bos_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("bos"), DemoSpec(bos=True))


def _hf_chat_ids(tok, messages: list[dict]) -> list[int]:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])  # transformers 5: a BatchEncoding


def _tokenizer_only(src: Path, dst: Path, **config: object) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "tokenizer.json", dst / "tokenizer.json")
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


def test_encoding_matches_transformers_on_a_bos_tokenizer(bos_dir: Path) -> None:
    hf = AutoTokenizer.from_pretrained(str(bos_dir))
    tok = TokenizerAssets.load(bos_dir)
    assert not json.loads((bos_dir / "tokenizer_config.json").read_text()).get("chat_template")
    bos = hf.convert_tokens_to_ids(BOS_TOKEN)
    for text in ("Hello! How are you today?", "Hello 🙂 你好", " leading space"):
        assert tok.encode(text) == hf(text)["input_ids"] and tok.encode(text)[0] == bos
        assert tok.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False)["input_ids"]
    chat = tok.encode(tok.render_chat(MESSAGES), add_special_tokens=False)
    assert chat == _hf_chat_ids(hf, MESSAGES) and chat.count(bos) == 1


def test_where_the_chat_template_comes_from(llama_dir: Path, tmp_path: Path) -> None:
    d = _tokenizer_only(llama_dir, tmp_path / "cfg", chat_template="cfg:{{ messages[0]['content'] }}")
    assert TokenizerAssets.load(d).render_chat(MESSAGES) == "cfg:Be brief."
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "named"}]
    d = _tokenizer_only(llama_dir, tmp_path / "named", chat_template=named)
    assert TokenizerAssets.load(d).render_chat(MESSAGES) == "named"
    (d / "chat_template.jinja").write_text("jinja")  # transformers: the file wins over the config
    assert TokenizerAssets.load(d).render_chat(MESSAGES) == "jinja"
    assert TokenizerAssets.load(d, chat_template="text override").render_chat(MESSAGES) == "text override"
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    override = TokenizerAssets.load(d, chat_template=str(tmp_path / "t.jinja"))
    assert override.render_chat(MESSAGES) == "<system>Be brief.<user>Tell me about ships."
    bare = TokenizerAssets.load(_tokenizer_only(llama_dir, tmp_path / "none"))
    with pytest.raises(InvalidRequestError) as err:
        bare.render_chat(MESSAGES)
    assert err.value.param == "messages" and not bare.has_chat_template


def test_prompt_byte_bound_is_sound(llama_dir: Path, bos_dir: Path) -> None:
    """No text longer than max_prompt_bytes(n) encodes to n tokens or fewer."""
    for d in (llama_dir, bos_dir):
        tok = TokenizerAssets.load(d)
        per_token = tok.max_prompt_bytes(1)
        assert per_token is not None and per_token < 64
        vocab = tok.tokenizer.get_vocab(with_added_tokens=True)
        for piece in sorted(vocab, key=len)[-50:]:  # the longest pieces pack the most bytes per token
            text = tok.decode([vocab[piece]]) * 20 or "x"
            ids = tok.encode(text, add_special_tokens=False)
            assert len(text.encode()) <= tok.max_prompt_bytes(len(ids)), piece
    # A tokenizer that may drop text without bound (Strip) or map it to one unknown token: no bound.
    strip = Tokenizer(models.BPE(unk_token="<unk>"))
    strip.normalizer = normalizers.Strip()
    assert TokenizerAssets(strip, None, {}).max_prompt_bytes(2048) is None


@pytest.fixture(scope="module")
def bare_router(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterHarness]:
    """A router over a checkpoint without a chat template, and a scripted stage of context 64."""
    d = _tokenizer_only(llama_dir, tmp_path_factory.mktemp("bare"))
    stage = ScriptedStage(
        [5, 6, 7], vocab_size=Tokenizer.from_file(str(d / "tokenizer.json")).get_vocab_size()
    )
    stage.max_model_len = 64
    with RouterHarness(d, {"g0": stage}) as h:
        yield h


def _post(h: RouterHarness, path: str, body: dict, timeout: float = 30) -> httpx.Response:
    # json.dumps escapes lone surrogates as "\ud800", as a client's JSON may carry them
    content = json.dumps(body)
    return httpx.post(
        h.url + path, content=content, headers={"content-type": "application/json"}, timeout=timeout
    )


def _error(r: httpx.Response, param: str) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    return err["message"]


def test_chat_without_a_template_is_400(bare_router: RouterHarness) -> None:
    r = _post(bare_router, "/v1/chat/completions", {"messages": MESSAGES})
    assert "no chat template" in _error(r, "messages")


def test_chat_template_flag_serves_chat(llama_dir: Path, tmp_path: Path) -> None:
    d = _tokenizer_only(llama_dir, tmp_path / "bare")
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    stage = ScriptedStage([5, 6, 7], vocab_size=1024, max_model_len=64)
    with RouterHarness(d, {"g0": stage}, chat_template=str(tmp_path / "t.jinja")) as h:
        r = _post(h, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})
        assert r.status_code == 200, r.text
    want = TokenizerAssets.load(d).encode("<system>Be brief.<user>Tell me about ships.", False)
    assert list(stage.requests[0].prompt_token_ids) == want


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "hi", "temperature": 10**400}, "temperature"),
        ("/v1/completions", {"prompt": "a\ud800"}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "model": "\ud800"}, "model"),
        ("/v1/completions", {"prompt": "hi", "stop": "\udfff"}, "stop"),
        ("/v1/completions", {"prompt": "hi", "guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/completions", {"prompt": [5, 6], "max_tokens": 63}, "max_tokens"),
        ("/v1/completions", {"prompt": [5, 6], "max_tokens": 10**30}, "max_tokens"),
        ("/v1/completions", {"prompt": "x" * (2**20)}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "\ud800", "content": "x"}]}, "messages[0].role"),
        ("/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "x"}]}, "tools[0].type"),
        ("/v1/chat/completions", {"messages": MESSAGES, "tool_choice": "required"}, "tool_choice"),
    ],
)
def test_edge_refusals_name_the_field(bare_router: RouterHarness, path: str, body: dict, param: str) -> None:
    message = _error(_post(bare_router, path, body), param)
    if param == "max_tokens":
        assert "maximum context length is 64 tokens" in message and "2 input tokens" in message
    assert _post(bare_router, "/v1/completions", {"prompt": [5], "max_tokens": 2}).status_code == 200


def test_max_completion_tokens_beyond_the_context_names_it(llama_dir: Path) -> None:
    stage = ScriptedStage([5, 6, 7], vocab_size=1024, max_model_len=64)
    with RouterHarness(llama_dir, {"g0": stage}) as h:
        r = _post(h, "/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 60})
        assert "maximum context length is 64" in _error(r, "max_completion_tokens")
        r = _post(h, "/v1/chat/completions", {"messages": MESSAGES})  # no max: up to the context
        n = len(stage.requests[-1].prompt_token_ids)
        assert r.status_code == 200 and stage.requests[-1].sampling.max_tokens == 64 - n


def test_a_15mb_prompt_is_refused_without_stalling_the_router(bare_router: RouterHarness) -> None:
    latencies: list[float] = []
    done = threading.Event()

    def poll() -> None:
        with httpx.Client(timeout=10) as c:
            while not done.is_set():
                t = time.monotonic()
                assert c.get(bare_router.url + "/health").status_code == 200
                latencies.append(time.monotonic() - t)
                time.sleep(0.005)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        t = time.monotonic()
        r = _post(bare_router, "/v1/completions", {"prompt": "The sea is wide. " * (15 * 2**20 // 17)}, 60)
        elapsed = time.monotonic() - t
    finally:
        done.set()
        poller.join(15)
    message = _error(r, "prompt")
    assert "maximum context length is 64" in message and "bytes" in message
    assert elapsed < 20 and latencies and max(latencies) < 2.0, (elapsed, max(latencies, default=None))


@pytest.fixture(scope="module")
def bos_up(bos_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    args = ("--model", str(bos_dir), "--num-kv-blocks", "256")
    with running_up(*args, log_dir=tmp_path_factory.mktemp("up")) as server:
        yield server


def test_live_prompt_ids_and_greedy_output_equal_transformers(bos_up: UpProcess, bos_dir: Path) -> None:
    hf = AutoTokenizer.from_pretrained(str(bos_dir))
    bos = hf.convert_tokens_to_ids(BOS_TOKEN)
    extra = {"return_token_ids": True}
    with openai.OpenAI(base_url=bos_up.url + "/v1", api_key="x", max_retries=0, timeout=120) as client:
        model = client.models.list().data[0].id
        text = "The lighthouse keeper"
        got = client.completions.create(
            model=model, prompt=text, max_tokens=8, temperature=0, extra_body=extra
        )
        prompt_ids = hf(text)["input_ids"]
        assert got.choices[0].prompt_token_ids == prompt_ids and prompt_ids[0] == bos
        assert got.choices[0].token_ids == hf_greedy(bos_dir, prompt_ids, 8)
        chat = client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=8, temperature=0, extra_body=extra
        )
        chat_ids = _hf_chat_ids(hf, MESSAGES)
        assert chat.choices[0].prompt_token_ids == chat_ids and chat_ids.count(bos) == 1
        assert chat.choices[0].token_ids == hf_greedy(bos_dir, chat_ids, 8)
        # add_special_tokens overrides the endpoint's default.
        plain = client.completions.create(
            model=model, prompt=text, max_tokens=1, extra_body={**extra, "add_special_tokens": False}
        )
        assert plain.choices[0].prompt_token_ids == prompt_ids[1:]
        doubled = client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=1, extra_body={**extra, "add_special_tokens": True}
        )
        assert doubled.choices[0].prompt_token_ids == [bos, *chat_ids]
