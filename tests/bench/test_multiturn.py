"""The multi-turn workload: conversation structure, the shared system prompt, seeded determinism,
the per-turn summary and the Prometheus counter parsing (pure functions; no server)."""

from __future__ import annotations

import argparse

import pytest

from pipeserve.bench import multiturn, workloads
from pipeserve.bench.metrics import RequestResult
from pipeserve.bench.serving import add_bench_parser, build_conversations


def make(
    seed: int = 0, n: int = 4, turns: int = 3, prefix: int = 64, input_len: int = 20, output_len: int = 8
):
    return workloads.multi_turn_workload(n, turns, input_len, output_len, 0.5, 1000, seed, prefix)


def test_conversations_share_one_system_prompt_and_have_their_turns():
    convs = make()
    assert len(convs) == 4
    system = convs[0].system
    assert len(system) == 64 and all(3 <= t < 1000 for t in system)
    for c in convs:
        assert c.system == system
        assert c.num_turns == 3 and len(c.output_lens) == 3 and len(c.fallback_outputs) == 3
        for user, out_len, fallback in zip(c.user, c.output_lens, c.fallback_outputs, strict=True):
            assert 10 <= len(user) <= 20 and 4 <= out_len <= 8
            assert len(fallback) == out_len
    # The user parts differ between conversations: only the system prompt is shared.
    assert len({tuple(c.user[0]) for c in convs}) == 4


def test_turn_prompt_is_the_previous_prompt_plus_output_plus_a_new_user_part():
    conv = make()[1]
    outputs = [[901, 902], [903]]
    p0 = conv.turn_prompt(0, [])
    p1 = conv.turn_prompt(1, outputs)
    p2 = conv.turn_prompt(2, outputs)
    assert p0 == conv.system + conv.user[0]
    assert p1 == p0 + outputs[0] + conv.user[1]
    assert p2 == p1 + outputs[1] + conv.user[2]
    req = conv.request(2, outputs)
    assert req.prompt == p2 and req.output_len == conv.output_lens[2]
    with pytest.raises(ValueError):
        conv.turn_prompt(2, outputs[:1])  # turn 2 needs both earlier outputs
    with pytest.raises(ValueError):
        conv.turn_prompt(3, outputs)


def test_same_seed_same_workload_other_seed_differs():
    assert make(seed=5) == make(seed=5)
    other = make(seed=6)
    assert other[0].system != make(seed=5)[0].system
    # Conversation k does not depend on how many conversations follow it.
    assert make(seed=5, n=2) == make(seed=5, n=4)[:2]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        workloads.multi_turn_workload(0, 3, 10, 4, 0.0, 1000, 0, 16)
    with pytest.raises(ValueError):
        workloads.multi_turn_workload(2, 0, 10, 4, 0.0, 1000, 0, 16)
    with pytest.raises(ValueError):
        workloads.multi_turn_workload(2, 3, 10, 4, 0.0, 3, 0, 16)  # empty id range


def test_cli_defaults_for_multi_turn():
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        ["bench", "--workload", "multi-turn", "--num-requests", "12", "--vocab-size", "500"]
    )
    convs = build_conversations(args)
    assert len(convs) == 4  # 12 requests / 3 turns
    assert len(convs[0].system) == multiturn.DEFAULT_SHARED_PREFIX_LEN == 2048
    assert all(c.num_turns == 3 for c in convs)
    args = parser.parse_args(
        ["bench", "--workload", "multi-turn", "--num-conversations", "2", "--num-turns", "5"]
    )
    assert [c.num_turns for c in build_conversations(args)] == [5, 5]


def ok(prompt_len: int, cached: int | None, ttft: float) -> RequestResult:
    return RequestResult(
        success=True,
        prompt_len=prompt_len,
        output_len=2,
        ttft=ttft,
        latency=ttft + 0.01,
        cached_tokens=cached,
    )


def test_summary_per_turn_and_cached_share():
    convs = make(n=2, turns=3)
    per_conv = [
        [ok(100, 0, 1.0), ok(130, 100, 0.1), ok(160, 130, 0.1)],
        [ok(100, 96, 0.2), RequestResult(success=False, error="HTTP 500")],  # turn 1 failed: turn 2 unsent
    ]
    s = multiturn.summarize(per_conv, convs, duration=2.0)
    assert s["completed"] == 4 and s["failed"] == 2  # the failed turn and the one never sent
    t0, t1, t2 = s["turns"]
    assert t0["completed"] == 2 and t0["ttft_ms"]["p50"] == pytest.approx(600.0)
    assert t0["cached_share"] == pytest.approx(96 / 200)
    assert t1["completed"] == 1 and t1["cached_share"] == pytest.approx(100 / 130)
    assert t2["completed"] == 1 and t2["mean_prompt_len"] == 160
    assert s["cached_share"] == pytest.approx((0 + 100 + 130 + 96) / (100 + 130 + 160 + 100))
    assert "| all | 4 |" in "\n".join(multiturn.turn_table_md(s))


def test_cached_share_unknown_when_the_server_does_not_say():
    s = multiturn.summarize([[ok(100, None, 0.5)]], make(n=1, turns=1), duration=1.0)
    assert s["cached_share"] is None and s["turns"][0]["cached_share"] is None


def test_parse_counters_sums_labelled_samples():
    page = "\n".join(
        [
            "# HELP pipeserve:hicache_l3_read_bytes_total page bytes read from L3",
            'pipeserve:hicache_l3_read_bytes_total{rank="0"} 1.5e+03',
            'pipeserve:hicache_l3_read_bytes_total{rank="1"} 500.0',
            "pipeserve:hicache_l3_written_bytes_total 7",
            'pipeserve:hicache_l3_read_bytes_created{rank="0"} 1.7e9',
        ]
    )
    got = multiturn.parse_counters(page, multiturn.BYTE_COUNTERS)
    assert got == {
        "pipeserve:hicache_l3_read_bytes_total": 2000.0,
        "pipeserve:hicache_l3_written_bytes_total": 7.0,
    }
    assert multiturn.bytes_per_token(got, {k: v * 2 for k, v in got.items()}, 100) == {
        "pipeserve:hicache_l3_read_bytes_total": 20.0,
        "pipeserve:hicache_l3_written_bytes_total": 0.07,
    }
    assert multiturn.bytes_per_token(None, got, 100) is None


def history_app(with_ids: bool = True):
    """An OpenAI-shaped streaming app (run in-process over httpx's ASGI transport): each completion
    streams max_tokens tokens whose ids are 7000 + prompt length + i (when `with_ids`), and a usage
    chunk calling half the prompt cached. It records every request body."""
    import json

    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    bodies: list[dict] = []

    async def completions(request):
        body = await request.json()
        bodies.append(body)
        n = len(body["prompt"])

        async def gen():
            for i in range(body["max_tokens"]):
                choice = {"index": 0, "text": "t"} | ({"token_ids": [7000 + n + i]} if with_ids else {})
                yield f"data: {json.dumps({'choices': [choice]})}\n\n"
            usage = {"prompt_tokens": n, "completion_tokens": body["max_tokens"]}
            usage["prompt_tokens_details"] = {"cached_tokens": n // 2}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])]), bodies


@pytest.mark.parametrize("with_ids", [True, False])
def test_turns_carry_the_generated_ids_in_order(with_ids):
    import asyncio

    import httpx

    app, bodies = history_app(with_ids)
    convs = make(n=2, turns=3)

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://bench") as http:
            return await multiturn.run_conversations(http, "m", convs, concurrency=1, timeout_s=30)

    per_conv, _ = asyncio.run(run())
    assert len(bodies) == 6 and all(b["return_token_ids"] and b["ignore_eos"] for b in bodies)
    for c, conv in enumerate(convs):
        sent = [b["prompt"] for b in bodies[3 * c : 3 * c + 3]]  # concurrency 1: conversations in order
        outputs = []
        for t in range(3):
            assert sent[t] == conv.turn_prompt(t, outputs)
            res = per_conv[c][t]
            assert res.success and res.cached_tokens == len(sent[t]) // 2
            generated = [7000 + len(sent[t]) + i for i in range(conv.output_lens[t])]
            outputs.append(generated if with_ids else conv.fallback_outputs[t])
