"""The router in front of live stage processes (two single-stage groups), end to end.

The groups are started once for the module by the supervisor's own GroupSlot;
the router runs under uvicorn in a background thread (router_support). The
last test kills the groups, so it stays last.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from pipeserve.config import EngineConfig
from pipeserve.supervisor.group import GroupSlot
from pipeserve.tokenizer import TokenizerAssets
from router_support import RouterHarness
from serving_support import generate, greedy_request, live_slots, metric, stub, wait_until

pytestmark = pytest.mark.slow
KEY = "e2e-key"
PROMPT = "The lighthouse keeper"


@pytest.fixture(scope="module")
def slots(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, GroupSlot]]:
    log_dir = tmp_path_factory.mktemp("router-e2e")
    config = EngineConfig(model=str(llama_dir), num_threads=1, num_kv_blocks=128, log_dir=str(log_dir))
    with live_slots(config) as slots:
        yield slots


@pytest.fixture(scope="module")
def router(llama_dir: Path, slots: dict[str, GroupSlot]) -> Iterator[RouterHarness]:
    targets = {name: s.grpc_target for name, s in slots.items()}
    # Polls are driven by the tests (RouterHarness.poll), so a killed group is still routable when
    # the next request picks it: that request must take the retry path.
    with RouterHarness(
        llama_dir, targets, wait_ready=0, api_key=KEY, served_model_name="demo", health_interval_s=3600
    ) as h:
        h.poll()
        assert len(h.call(h.replicas.ready_groups)) == 2
        yield h


@pytest.fixture(scope="module")
def client(router: RouterHarness) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=router.url + "/v1", api_key=KEY, max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def tok(llama_dir: Path) -> TokenizerAssets:
    return TokenizerAssets.load(llama_dir)


def test_completions_match_stage0_and_stream_equals_blocking(
    client: openai.OpenAI, slots: dict[str, GroupSlot], tok: TokenizerAssets
) -> None:
    ids = tok.encode(PROMPT)
    direct, _ = generate(stub(slots["g1"].grpc_target), greedy_request("direct", ids, 24, ignore_eos=True))
    kw = {
        "model": "demo",
        "prompt": PROMPT,
        "max_tokens": 24,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    blocking = client.completions.create(**kw)
    assert blocking.choices[0].text == tok.decode(direct) and blocking.choices[0].finish_reason == "length"
    assert blocking.usage.prompt_tokens == len(ids) and blocking.usage.completion_tokens == 24
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == blocking.choices[0].text
    assert chunks[-1].usage.completion_tokens == 24


def test_chat_streaming(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    kw = {"model": "demo", "messages": messages, "max_tokens": 16, "temperature": 0, "seed": 1}
    blocking = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == blocking.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == blocking.choices[0].finish_reason in ("stop", "length")


def test_stop_string_trims_and_frees_the_request(
    client: openai.OpenAI, router: RouterHarness, slots: dict[str, GroupSlot]
) -> None:
    kw = {"model": "demo", "prompt": PROMPT, "temperature": 0, "extra_body": {"ignore_eos": True}}
    full = client.completions.create(**kw, max_tokens=40).choices[0].text
    cut = len(full) // 2
    stop = full[cut : cut + 3]
    want = full[: full.find(stop)]
    for stream in (False, True):
        if stream:
            got = "".join(
                c.choices[0].text
                for c in client.completions.create(**kw, max_tokens=400, stop=stop, stream=True)
            )
        else:
            r = client.completions.create(**kw, max_tokens=400, stop=[stop, "never-there"])
            assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens < 400
            got = r.choices[0].text
        assert got == want
    # The cancelled calls were aborted on stage 0 (not run to max_tokens): no block held.
    aborted = sum(
        metric(
            httpx.get(s.health_url(0) + "/metrics").text,
            "pipeserve:request_success_total",
            finished_reason="abort",
        )
        or 0
        for s in slots.values()
    )
    assert aborted == 2
    for s in slots.values():
        wait_until(
            lambda s=s: metric(httpx.get(s.health_url(0) + "/metrics").text, "pipeserve:kv_blocks_used") == 0,
            10,
            f"{s.name} blocks freed",
        )


def test_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(model="demo", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert (
            value <= 0 and token in top and value == pytest.approx(max(top.values()))
        )  # greedy: the top token
    chat = client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)


def test_auth_model_and_admission_errors(router: RouterHarness, client: openai.OpenAI) -> None:
    with openai.OpenAI(base_url=router.url + "/v1", api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="nope", prompt="x")
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="demo", prompt="x", max_tokens=-1)
    assert err.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError):  # longer than the groups' context (from Health)
        client.completions.create(model="demo", prompt=[5] * 5000)
    assert [m.id for m in client.models.list().data] == ["demo"]
    assert httpx.get(router.url + "/health_generate").status_code == 200


def test_killed_group_is_retried_elsewhere_then_503_when_none_is_left(
    router: RouterHarness, client: openai.OpenAI, slots: dict[str, GroupSlot]
) -> None:
    """Last in this module: it kills the groups."""
    slots["g0"].group.procs[0].send_signal(signal.SIGKILL)  # type: ignore[union-attr]
    wait_until(lambda: slots["g0"].group_exited(), 10, "g0 exited")
    before = metric(httpx.get(router.url + "/metrics").text, "pipeserve:router_retries_total")
    for _ in range(3):  # round-robin: one of these picks the dead group first
        r = client.completions.create(model="demo", prompt=PROMPT, max_tokens=4)
        assert r.choices[0].text
    after = metric(httpx.get(router.url + "/metrics").text, "pipeserve:router_retries_total")
    assert after == before + 1  # the failure marked g0 unready: only one request paid a retry
    assert [g["ready"] for g in router.call(router.replicas.snapshot)] == [False, True]
    slots["g1"].kill(grace_s=5.0)
    router.poll()
    with pytest.raises(openai.InternalServerError) as err:
        client.completions.create(model="demo", prompt=PROMPT, max_tokens=4)
    assert err.value.status_code == 503
    assert httpx.get(router.url + "/health").status_code == 503
