"""echo and prompt_logprobs through the router to a live group, against transformers (float32).

Contract (router/features/echo.py): completions' echo puts the prompt first in the text and, with logprobs,
the prompt's tokens first in the legacy logprobs (the first null); max_tokens 0 only with echo;
prompt_logprobs is vLLM's list (null first), per choice on completions, top level on chat, in the
first streamed chunk.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from conftest import _hf_model
from pipeserve.config import EngineConfig
from pipeserve.supervisor.group import GroupSlot
from pipeserve.tokenizer import TokenizerAssets
from router_support import RouterHarness
from serving_support import live_slots

pytestmark = pytest.mark.slow
PROMPT = "The lighthouse keeper counted the ships"
CHAT = [{"role": "user", "content": "hi there"}]


@pytest.fixture(scope="module")
def slots(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, GroupSlot]]:
    log_dir = tmp_path_factory.mktemp("router-plp")
    config = EngineConfig(model=str(llama_dir), num_threads=1, num_kv_blocks=128, log_dir=str(log_dir))
    with live_slots(config, ("g0",)) as slots:
        yield slots


@pytest.fixture(scope="module")
def router(llama_dir: Path, slots: dict[str, GroupSlot]) -> Iterator[RouterHarness]:
    with RouterHarness(llama_dir, {"g0": slots["g0"].grpc_target}, served_model_name="demo") as h:
        yield h


@pytest.fixture(scope="module")
def tok(llama_dir: Path) -> TokenizerAssets:
    return TokenizerAssets.load(llama_dir)


def post(router: RouterHarness, path: str, body: dict) -> httpx.Response:
    return httpx.post(router.url + path, json={"model": "demo", **body}, timeout=120)


def ok(router: RouterHarness, path: str, body: dict) -> dict:
    r = post(router, path, body)
    assert r.status_code == 200, r.text
    return r.json()


def hf_prompt_logp(llama_dir: Path, ids: list[int]) -> torch.Tensor:
    """[len, vocab] float32 log_softmax; row p - 1 scores position p."""
    with torch.no_grad():
        return _hf_model(str(llama_dir))(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def test_echo_with_logprobs_matches_hf(router: RouterHarness, tok: TokenizerAssets, llama_dir: Path) -> None:
    ids = tok.encode(PROMPT)
    body = {
        "prompt": PROMPT,
        "echo": True,
        "logprobs": 3,
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
    }
    out = ok(router, "/v1/completions", body)
    plain = ok(router, "/v1/completions", {**body, "echo": False, "logprobs": None})
    c = out["choices"][0]
    assert c["text"] == PROMPT + plain["choices"][0]["text"]
    lp = c["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 4
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = hf_prompt_logp(llama_dir, ids)
    for p in range(1, len(ids)):
        assert lp["token_logprobs"][p] == pytest.approx(want[p - 1, ids[p]].item(), abs=1e-4), p
        top_v = want[p - 1].topk(3).values.tolist()
        assert sorted(lp["top_logprobs"][p].values(), reverse=True)[:3] == pytest.approx(top_v, abs=1e-4)
    assert lp["text_offset"][len(ids)] >= len(PROMPT) - 1  # the generated tokens come after the prompt
    assert out["usage"]["prompt_tokens"] == len(ids) and out["usage"]["completion_tokens"] == 4


def test_max_tokens_0_only_with_echo(router: RouterHarness, tok: TokenizerAssets) -> None:
    ids = tok.encode(PROMPT)
    out = ok(router, "/v1/completions", {"prompt": PROMPT, "echo": True, "max_tokens": 0, "logprobs": 1})
    c = out["choices"][0]
    assert c["text"] == PROMPT and c["finish_reason"] == "length"
    assert len(c["logprobs"]["tokens"]) == len(ids)
    assert out["usage"]["completion_tokens"] == 0
    r = post(router, "/v1/completions", {"prompt": PROMPT, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def _check_shape(plp: list, ids: list[int], k: int) -> None:
    assert len(plp) == len(ids) and plp[0] is None
    for p in range(1, len(ids)):
        entry = plp[p]
        assert str(ids[p]) in entry and len(entry) <= k + 1
        for v in entry.values():
            assert set(v) == {"logprob", "rank", "decoded_token"} and v["rank"] >= 1


def test_prompt_logprobs_shapes_on_both_endpoints(
    router: RouterHarness, tok: TokenizerAssets, llama_dir: Path
) -> None:
    ids = tok.encode(PROMPT)
    out = ok(router, "/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 2, "max_tokens": 2, "n": 2})
    want = hf_prompt_logp(llama_dir, ids)
    for c in out["choices"]:
        _check_shape(c["prompt_logprobs"], ids, 2)
        assert c["prompt_logprobs"][1][str(ids[1])]["logprob"] == pytest.approx(
            want[0, ids[1]].item(), abs=1e-4
        )
    assert (
        "prompt_logprobs"
        not in ok(router, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1})["choices"][0]
    )
    chat = ok(router, "/v1/chat/completions", {"messages": CHAT, "prompt_logprobs": 0, "max_tokens": 2})
    n_prompt = chat["usage"]["prompt_tokens"]
    assert len(chat["prompt_logprobs"]) == n_prompt and chat["prompt_logprobs"][0] is None
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])  # k = 0: the prompt token alone
    for body in ({"prompt": PROMPT, "prompt_logprobs": 21}, {"prompt": PROMPT, "prompt_logprobs": -1}):
        r = post(router, "/v1/completions", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def _stream(router: RouterHarness, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", router.url + path, json={"model": "demo", **body}, timeout=120) as r:
        assert r.status_code == 200
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_first_streamed_chunk_carries_the_prompt_side(router: RouterHarness, tok: TokenizerAssets) -> None:
    ids = tok.encode(PROMPT)
    body = {"prompt": PROMPT, "echo": True, "prompt_logprobs": 1, "max_tokens": 5, "temperature": 0}
    chunks = _stream(router, "/v1/completions", {**body, "stream": True})
    first = chunks[0]["choices"][0]
    assert first["text"] == PROMPT
    _check_shape(first["prompt_logprobs"], ids, 1)
    blocking = ok(router, "/v1/completions", body)["choices"][0]
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == blocking["text"]
    assert blocking["prompt_logprobs"] == first["prompt_logprobs"]
    chat = _stream(router, "/v1/chat/completions", {"messages": CHAT, "prompt_logprobs": 1, "stream": True})
    assert chat[0]["choices"][0]["delta"]["role"] == "assistant" and chat[0]["prompt_logprobs"][0] is None
    assert all("prompt_logprobs" not in ch for ch in chat[1:])
