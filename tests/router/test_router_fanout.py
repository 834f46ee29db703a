"""n, best_of and the logprobs limit, through the router to live groups (two single-stage groups).

Contract (router/upstream/fanout.py): choice index = prompt × n + j; seeded choice j equals a separate
request with seed + j; best_of returns the n candidates of highest cumulative logprob; usage counts
a prompt once; siblings open on the leader's group after its first token, so they hit its cached
prompt blocks; a client gone mid-stream aborts every choice; logprobs > MAX_LOGPROBS is refused by
the router and by stage 0.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
import torch

from conftest import hf_logits
from pipeserve.config import EngineConfig
from pipeserve.rpc import generation_pb2 as pb
from pipeserve.sampling_fields import MAX_LOGPROBS
from pipeserve.supervisor.group import GroupSlot
from pipeserve.tokenizer import TokenizerAssets
from router_support import RouterHarness
from serving_support import generate, greedy_request, live_slots, metric_sum, stub, wait_until

pytestmark = pytest.mark.slow
PROMPT = "The lighthouse keeper"


@pytest.fixture(scope="module")
def slots(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, GroupSlot]]:
    log_dir = tmp_path_factory.mktemp("router-fanout")
    config = EngineConfig(model=str(llama_dir), num_threads=1, num_kv_blocks=128, log_dir=str(log_dir))
    with live_slots(config) as slots:
        yield slots


@pytest.fixture(scope="module")
def router(llama_dir: Path, slots: dict[str, GroupSlot]) -> Iterator[RouterHarness]:
    # round_robin (the default) would send each sibling to the other group: they must follow the leader.
    targets = {name: s.grpc_target for name, s in slots.items()}
    with RouterHarness(llama_dir, targets, served_model_name="demo", policy="round_robin") as h:
        yield h


@pytest.fixture(scope="module")
def tok(llama_dir: Path) -> TokenizerAssets:
    return TokenizerAssets.load(llama_dir)


def post(router: RouterHarness, path: str, body: dict) -> httpx.Response:
    return httpx.post(router.url + path, json={"model": "demo", **body}, timeout=120)


def completion(router: RouterHarness, **body: object) -> dict:
    r = post(router, "/v1/completions", body)
    assert r.status_code == 200, r.text
    return r.json()


SAMPLED = {"temperature": 1.0, "max_tokens": 8, "ignore_eos": True}


def test_index_order_and_usage_counts_each_prompt_once(router: RouterHarness, tok: TokenizerAssets) -> None:
    prompts = [PROMPT, "Once upon a time"]
    out = completion(router, prompt=prompts, n=3, seed=3, **SAMPLED)
    assert [c["index"] for c in out["choices"]] == list(range(6))
    lens = [len(tok.encode(p)) for p in prompts]
    assert out["usage"]["prompt_tokens"] == sum(lens)  # once per prompt, not once per choice
    assert out["usage"]["completion_tokens"] == 6 * 8
    # choices 3..5 belong to the second prompt: each equals that prompt alone with seed 3 + j
    for j in range(3):
        alone = completion(router, prompt=prompts[1], seed=3 + j, **SAMPLED)
        assert out["choices"][3 + j]["text"] == alone["choices"][0]["text"]


def test_seeded_choice_j_equals_a_separate_request_with_seed_plus_j(router: RouterHarness) -> None:
    out = completion(router, prompt=PROMPT, n=4, seed=41, **SAMPLED)
    texts = [c["text"] for c in out["choices"]]
    assert len(set(texts)) > 1, "the choices share one seed"
    for j in range(4):
        alone = completion(router, prompt=PROMPT, seed=41 + j, **SAMPLED)
        assert texts[j] == alone["choices"][0]["text"], j
    chat = post(
        router,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "n": 2, "seed": 9, **SAMPLED},
    ).json()
    assert [c["index"] for c in chat["choices"]] == [0, 1]
    assert chat["usage"]["completion_tokens"] == 16
    for j in range(2):
        alone = post(
            router,
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "seed": 9 + j, **SAMPLED},
        ).json()
        assert chat["choices"][j]["message"]["content"] == alone["choices"][0]["message"]["content"]


def _stream(router: RouterHarness, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", router.url + path, json={"model": "demo", **body}, timeout=120) as r:
        assert r.status_code == 200
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_streams_interleave_and_each_equals_blocking(router: RouterHarness) -> None:
    body = {"prompt": PROMPT, "n": 3, "seed": 5, **SAMPLED}
    blocking = completion(router, **body)
    chunks = _stream(
        router, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    order = [ch["choices"][0]["index"] for ch in chunks[:-1]]
    assert order != sorted(order), "the choices' chunks did not interleave"
    texts = ["", "", ""]
    for ch in chunks[:-1]:
        (c,) = ch["choices"]
        texts[c["index"]] += c["text"]
    assert texts == [c["text"] for c in blocking["choices"]]
    usage = {k: v for k, v in chunks[-1]["usage"].items() if k != "prompt_tokens_details"}
    assert usage == {k: v for k, v in blocking["usage"].items() if k != "prompt_tokens_details"}
    chat = _stream(
        router,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "n": 2, "stream": True},
    )
    roles = [ch["choices"][0]["index"] for ch in chat if ch["choices"][0]["delta"].get("role")]
    assert sorted(roles) == [0, 1]
    finished = [ch["choices"][0]["index"] for ch in chat if ch["choices"][0]["finish_reason"]]
    assert sorted(finished) == [0, 1]


def test_best_of_returns_the_most_probable_candidates(router: RouterHarness) -> None:
    cum = []
    for j in range(4):
        alone = completion(router, prompt=PROMPT, seed=70 + j, logprobs=0, **SAMPLED)
        c = alone["choices"][0]
        cum.append((sum(c["logprobs"]["token_logprobs"]), c["text"]))
    want = [text for _, text in sorted(cum, key=lambda x: x[0], reverse=True)[:2]]
    assert len({t for _, t in cum}) == 4
    out = completion(router, prompt=PROMPT, n=2, best_of=4, seed=70, **SAMPLED)
    assert [c["text"] for c in out["choices"]] == want
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert all(c["logprobs"] is None for c in out["choices"])  # asked for ranking, not by the client
    assert out["usage"]["completion_tokens"] == 16  # the returned choices only


def test_siblings_hit_the_leaders_cached_prompt_blocks(
    router: RouterHarness, slots: dict[str, GroupSlot]
) -> None:
    def hits() -> float:
        return sum(
            metric_sum(httpx.get(s.health_url(0) + "/metrics").text, "pipeserve:prefix_cache_hits_total")
            for s in slots.values()
        )

    prompt = [(i * 7919 + 13) % 900 + 20 for i in range(40)]  # 2 full blocks of 16, never sent before
    before = hits()
    out = completion(router, prompt=prompt, n=4, temperature=1.0, max_tokens=2, ignore_eos=True)
    assert len(out["choices"]) == 4
    assert hits() - before == 3 * 32  # every sibling reused both full blocks of the leader
    # With prompt_logprobs only the leader scores the prompt (no hit for it); its siblings still hit.
    prompt = [(i * 7907 + 29) % 900 + 20 for i in range(40)]
    before = hits()
    out = completion(router, prompt=prompt, n=3, prompt_logprobs=0, max_tokens=2, ignore_eos=True)
    assert all(len(c["prompt_logprobs"]) == 40 for c in out["choices"])
    assert hits() - before == 2 * 32


def test_logprobs_limit_and_admission_are_enforced_by_the_router_and_by_stage_0(
    router: RouterHarness, slots: dict[str, GroupSlot], tok: TokenizerAssets
) -> None:
    r = post(router, "/v1/completions", {"prompt": PROMPT, "logprobs": MAX_LOGPROBS + 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
    r = post(
        router,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    r = post(router, "/v1/completions", {"prompt": PROMPT, "n": 2, "best_of": 3, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"
    # admission counts prompts x best_of against max_concurrency (256 here)
    r = post(router, "/v1/completions", {"prompt": [PROMPT] * 3, "best_of": 100})
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of", r.text
    s = stub(slots["g0"].grpc_target)
    with pytest.raises(grpc.RpcError) as err:
        generate(s, greedy_request("lp21", tok.encode(PROMPT), 2, logprobs=MAX_LOGPROBS + 1))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "logprobs" in err.value.details()


def test_top_20_logprobs_equal_hf_at_every_greedy_step(
    slots: dict[str, GroupSlot], tok: TokenizerAssets, llama_dir: Path
) -> None:
    ids = tok.encode(PROMPT)
    req = greedy_request("lp20", ids, 6, logprobs=MAX_LOGPROBS, ignore_eos=True)
    tokens: list[int] = []
    steps: list[pb.TokenLogprob] = []
    for msg in stub(slots["g1"].grpc_target).Generate(req, timeout=60):
        tokens += msg.token_ids
        steps += msg.logprobs
    assert len(steps) == len(tokens) == 6
    for k, step in enumerate(steps):
        want = hf_logits(llama_dir, ids + tokens[:k]).log_softmax(-1)
        top_v, top_i = want.topk(MAX_LOGPROBS)
        assert [t.token_id for t in step.top] == top_i.tolist(), k
        got = torch.tensor([t.logprob for t in step.top])
        assert torch.allclose(got, top_v, atol=1e-4), k
        assert step.logprob == pytest.approx(want[tokens[k]].item(), abs=1e-4)


def test_client_disconnect_aborts_every_choice(router: RouterHarness, slots: dict[str, GroupSlot]) -> None:
    body = {"model": "demo", "prompt": PROMPT, "n": 4, "max_tokens": 400, "ignore_eos": True, "stream": True}
    seen: set[int] = set()
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                seen.add(json.loads(line[6:])["choices"][0]["index"])
            if len(seen) == 4:
                break
    assert seen == {0, 1, 2, 3}

    def idle() -> bool:
        loads = [stub(s.grpc_target).Load(pb.LoadRequest(), timeout=5) for s in slots.values()]
        return all(x.kv_blocks_used == 0 and x.running == 0 for x in loads)

    wait_until(idle, 30, "every choice aborted and its KV blocks freed")
