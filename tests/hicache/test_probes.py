"""Stage 0's L3 probes (engine/prefix_loads.py, hicache/directory.py) on a real redis-server: a
request that arrives while others decode is probed and, the answer back within the scheduler's short
wait, admitted by the very next plan instead of a step later; with Redis gone the wait ends at once
(the directory answers 0 during its backoff) and serving goes on."""

from __future__ import annotations

import time
from pathlib import Path

from conftest import hf_greedy, record_plans
from hicache_support import GREEDY, TIGHT
from pipeserve import LLM, SamplingParams
from pipeserve.local.redis_server import LocalRedis


def _first_plan_with(plans: list, req_id: str) -> int:
    return next((i for i, p in enumerate(plans) if any(c.req_id == req_id for c in p.chunks)), -1)


def test_a_new_request_is_admitted_by_the_next_plan(llama_dir: Path) -> None:
    with LocalRedis() as server:
        kw = {**TIGHT, "hicache_url": server.url, "host_cache_gb": 0}
        with LLM(str(llama_dir), stages=1, **kw) as llm:
            eng = llm.engine
            plans = record_plans(llm)
            eng.add_request([5, 6, 7, 8, 9, 10], SamplingParams(temperature=0, max_tokens=30), "a")
            for _ in range(4):  # "a" is decoding
                eng.step()
            assert eng.scheduler.running
            before = len(plans)
            prompt = list(range(40, 70))
            eng.add_request(prompt, GREEDY, "b")
            eng.step()
            assert _first_plan_with(plans, "b") == before, "b was left a step behind its probe"
            assert eng.scheduler.fetch.stats.probes == 2
            while eng.has_unfinished():
                eng.step()
            assert eng.scheduler.fetch.stats.probes == 2


def test_redis_gone_costs_no_wait(llama_dir: Path) -> None:
    server = LocalRedis().start()
    kw = {**TIGHT, "hicache_url": server.url, "host_cache_gb": 0, "hicache_timeout_s": 0.2}
    with LLM(str(llama_dir), stages=1, **kw) as llm:
        server.stop()
        prompts = [list(range(10 + i, 40 + i)) for i in range(4)]
        llm.generate(prompts[:1], GREEDY)  # the directory finds Redis gone (one socket deadline)
        t0 = time.monotonic()
        outs = llm.generate(prompts[1:], GREEDY)
        assert time.monotonic() - t0 < 5
        assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(llama_dir, p, 8) for p in prompts[1:]]
        assert llm.engine.scheduler.fetch.l3.available is False  # type: ignore[union-attr]
