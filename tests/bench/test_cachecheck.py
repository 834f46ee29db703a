"""The side-by-side's cache-hit check: a pass that reuses a cached prompt prefix fails, loudly.

Driven by real servers: a small HTTP server with llama-server's slot prompt cache and its way of
reporting reuse (slot_server.py), and a real `pipeserve up` (S=1) on the demo model
whose stage-0 prefix-cache counters are read from /metrics. Each check is shown red on a pass that
re-sends its prompts and green on fresh ones.
"""

from __future__ import annotations

import pytest
from slot_server import slot_app
from test_bench import Served

from pipeserve.bench import cachecheck, prompts
from pipeserve.bench.cells import Cell
from pipeserve.bench.launch import RunningServer
from pipeserve.bench.metrics import RequestResult
from pipeserve.bench.sweep import SweepSpec, run_pass
from serving_support import UpProcess

pytestmark = pytest.mark.timeout(180)


def done(cached: int | None = None, cache_n: int | None = None) -> RequestResult:
    return RequestResult(success=True, prompt_len=64, output_len=4, cached_tokens=cached, cache_n=cache_n)


def test_check_pass_fails_on_any_reported_hit():
    ok = [done(0, 0) for _ in range(4)]
    report = cachecheck.check_pass("peer", ok, None, None)
    assert report["hit_tokens"] == 0 and report["reporting"] == 4
    for hit in ([*ok, done(cache_n=3)], [*ok, done(cached=5)]):  # llama.cpp's timings, OpenAI's usage
        with pytest.raises(cachecheck.CacheHitError, match="CACHE HITS") as e:
            cachecheck.check_pass("peer", hit, None, None)
        assert e.value.report is not None and e.value.report["hit_requests"] == 1
    # The counter says what the responses did not.
    with pytest.raises(cachecheck.CacheHitError, match="counter grew by 16"):
        cachecheck.check_pass("self", ok, 100.0, 116.0)
    assert cachecheck.check_pass("self", ok, 100.0, 100.0)["counter_hit_tokens"] == 0
    # A pass that says it measures caching reports instead of failing.
    measured = cachecheck.check_pass("peer", [done(cache_n=3)], None, None, measures_caching=True)
    assert measured["hit_tokens"] == 3


def test_check_pass_fails_when_nothing_can_be_checked():
    silent = [RequestResult(success=True, prompt_len=64, output_len=4) for _ in range(3)]
    with pytest.raises(cachecheck.CacheHitError, match="cannot show"):
        cachecheck.check_pass("peer", silent, None, None)
    assert cachecheck.check_pass("peer", silent, 5.0, 5.0)["counter_hit_tokens"] == 0  # counters suffice


def _pass(server: RunningServer, fresh: prompts.FreshPrompts, rnd: int, cell: Cell) -> dict:
    with server.session("running", fresh.requests(f"ready{rnd}", 1, 8, 1)[0]) as live:
        return run_pass("peer", server, live, fresh, SweepSpec([cell], rounds=1, requests=6), rnd, cell)


def test_slot_cache_server_red_on_resent_prompts_green_on_fresh(llama_dir):
    """Fresh text prompts: the slot server reuses nothing and the pass passes. The same cell and round
    again re-sends the same prompt set (each prompt's whole prefix is held): the check fails it."""
    # Room for more than two passes: the resent set is held whole, whatever order its requests arrive in.
    app, state = slot_app(slots=32)
    fresh = prompts.FreshPrompts(prompts.hf_text_prompts(str(llama_dir)), seed=3)
    cell = Cell(48, 4, 4)
    with Served(app) as srv:
        server = RunningServer(srv.url)
        first = _pass(server, fresh, 1, cell)
        assert first["cache"]["hit_tokens"] == 0 and first["cache"]["reporting"] == 6 + 2  # timed + warmup
        assert _pass(server, fresh, 2, cell)["cache"]["hit_tokens"] == 0  # another round: fresh again
        with pytest.raises(cachecheck.CacheHitError, match="CACHE HITS") as e:
            _pass(server, fresh, 1, cell)  # round 1's prompts once more
    assert e.value.report is not None and e.value.report["hit_requests"] == 8
    assert max(state["cache_n"][:16]) == 0 and min(state["cache_n"][-8:]) > 10  # words reused


def test_a_server_that_reports_nothing_fails_the_pass(llama_dir):
    app, _ = slot_app(report=False)
    fresh = prompts.FreshPrompts(prompts.IdPrompts(500), seed=1)
    with Served(app) as srv, pytest.raises(cachecheck.CacheHitError, match="cannot show"):
        _pass(RunningServer(srv.url), fresh, 1, Cell(16, 2, 2))


def test_pipeserve_counters_red_on_resent_prompts(llama_dir, tmp_path):
    """A real `pipeserve up`: fresh prompts leave stage 0's prefix_cache_hits_total where it was; the
    same prompts again are served from its prefix cache, and the counter (read from /metrics through
    /groups) and the responses both say so."""
    up = UpProcess("--model", str(llama_dir), "--stages", "1", "--num-kv-blocks", "256", log_dir=tmp_path)
    try:
        up.wait_ready()
        server = RunningServer(up.url, up.proc.pid, pipeserve=True)
        fresh = prompts.FreshPrompts(prompts.hf_text_prompts(str(llama_dir)), seed=5)
        cell = Cell(96, 2, 4)
        first = _pass(server, fresh, 1, cell)
        assert first["cache"]["counter_hit_tokens"] == 0 and first["cache"]["hit_tokens"] == 0
        assert first["figures"]["peak_rss_bytes"] > 100e6  # the tree was sampled during the pass
        with pytest.raises(cachecheck.CacheHitError, match="CACHE HITS") as e:
            _pass(server, fresh, 1, cell)
    finally:
        code = up.stop()
    assert code == 0, up.log()[-2000:]
    report = e.value.report
    assert report is not None and report["counter_hit_tokens"] >= 64 and report["hit_tokens"] >= 64
