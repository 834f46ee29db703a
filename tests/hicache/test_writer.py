"""PageWriter against a real redis-server: pages land in L3 in the background, a full queue drops
and counts instead of blocking the stage, a Redis that is gone costs counted failures (one log
line per state change) and writing resumes by itself when it is back."""

from __future__ import annotations

import logging
import os
import signal
import time

import pytest
import torch

from pipeserve.hicache.page import HEADER_BYTES, PageLayout
from pipeserve.hicache.redis_tier import RedisTier
from pipeserve.hicache.writer import PageWriter
from pipeserve.local.redis_server import LocalRedis

LAYOUT = PageLayout("fpw", 0, 0, 2, block_size=4, kv_heads=2, head_dim=8, dtype=torch.float32)


def page(seed: int) -> torch.Tensor:
    return torch.randn(LAYOUT.shape, generator=torch.Generator().manual_seed(seed))


def wait_for(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_pages_are_written_in_the_background() -> None:
    with LocalRedis() as server:
        tier = RedisTier(server.url)
        writer = PageWriter(tier, LAYOUT, max_queue=64)
        hashes = list(range(20))
        assert all(writer.submit(h, page(h), tokens=4) for h in hashes)
        assert writer.close(timeout_s=10) == 0
        assert writer.stats.written == 20 and writer.stats.dropped_full == 0
        assert writer.stats.bytes_written == 20 * (LAYOUT.payload_bytes + HEADER_BYTES)
        assert tier.present([LAYOUT], hashes) == 20
        got = tier.load(LAYOUT, [7])
        assert torch.equal(got.pages[0], page(7))
        assert not writer.submit(99, page(99), tokens=4)  # closed
        tier.close()


def test_a_full_queue_drops_and_counts_without_blocking() -> None:
    with LocalRedis() as server:
        tier = RedisTier(server.url, timeout_s=0.5)
        writer = PageWriter(tier, LAYOUT, max_queue=2)
        os.kill(server.proc.pid, signal.SIGSTOP)  # Redis hangs: the writer's first store waits
        try:
            t0 = time.monotonic()
            results = [writer.submit(h, page(h), tokens=4) for h in range(10)]
            assert time.monotonic() - t0 < 0.5  # the stage never waited for Redis
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        assert results.count(True) == writer.stats.queued <= 3
        assert writer.stats.dropped_full == 10 - writer.stats.queued >= 7
        writer.close(timeout_s=10)
        tier.close()


def test_redis_gone_and_back(caplog: pytest.LogCaptureFixture) -> None:
    server = LocalRedis().start()
    port = server.port
    tier = RedisTier(server.url, timeout_s=0.3)
    writer = PageWriter(tier, LAYOUT)
    writer.submit(1, page(1), tokens=4)
    wait_for(lambda: writer.stats.written == 1)
    server.stop()
    with caplog.at_level(logging.INFO, logger="pipeserve.hicache.writer"):
        for h in range(2, 6):
            writer.submit(h, page(h), tokens=4)
        wait_for(lambda: writer.stats.failed + writer.stats.dropped_down == 4)
        assert not writer.available
        back = LocalRedis(port=port).start()
        try:
            # Pages keep coming; once the backoff has passed, writing resumes by itself.
            def resumed() -> bool:
                writer.submit(6, page(6), tokens=4)
                time.sleep(0.05)
                return writer.stats.written >= 2

            wait_for(resumed)
            assert writer.available and tier.present([LAYOUT], [6]) == 1
            lines = [r.getMessage() for r in caplog.records]
            assert sum("unavailable" in m for m in lines) == 1  # once per state change
            assert sum("available again" in m for m in lines) == 1
        finally:
            writer.close()
            tier.close()
            back.stop()


def test_staged_pages_go_in_pipelined_batches() -> None:
    with LocalRedis() as server:
        tier = RedisTier(server.url, timeout_s=2.0)
        writer = PageWriter(tier, LAYOUT, max_queue=64)
        os.kill(server.proc.pid, signal.SIGSTOP)  # the first batch waits on Redis: the rest pile up
        try:
            assert all(writer.submit(h, page(h), tokens=4) for h in range(20))
            time.sleep(0.2)
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        assert writer.close(timeout_s=10) == 0
        assert writer.stats.written == 20 and writer.stats.batches <= 3, writer.stats  # not one per page
        assert tier.present([LAYOUT], list(range(20))) == 20
        assert torch.equal(tier.load(LAYOUT, [13]).pages[0], page(13))  # staged bytes, header in front
        tier.close()


def test_the_rate_cap_holds_and_the_buffer_is_bounded() -> None:
    value = LAYOUT.value_bytes
    with LocalRedis() as server:
        tier = RedisTier(server.url)
        # A buffer of 4 pages (its depth: a burst of 4 goes at once), then 8 pages a second.
        writer = PageWriter(tier, LAYOUT, buffer_bytes=4 * value + 10, rate_bytes_s=8 * value)
        assert writer.slots == 4 and writer._staging.numel() == 4 * value
        t0 = time.monotonic()
        sent = 0
        while sent < 12:  # the stage offers pages as fast as it can; a full buffer drops them
            sent += writer.submit(sent, page(sent), tokens=4)
        wait_for(lambda: writer.stats.written == 12)
        took = time.monotonic() - t0
        assert took >= 0.8, took  # 8 pages past the burst at 8 a second
        assert writer.stats.throttled_s >= 0.6 and writer.stats.dropped_full > 0
        assert writer.queue_depth == 0
        writer.close()
        tier.close()
