"""PageWriter: a stage's asynchronous writes to L3, through a bounded queue.

The stage's step never waits for Redis: `submit` copies the page to the host
and queues it, or — when the queue is full — drops it and counts the drop (a
dropped page is only a later miss). One daemon thread drains the queue in
order and writes each page with RedisTier.store; a write that fails (Redis
down, slow or full) is counted and the page dropped, and the state change is
logged once (`available` flips), never once per page. While Redis is down
the writer backs off (BACKOFF_S doubling to BACKOFF_MAX_S): pages queued
meanwhile are dropped and counted without a call.

`close(timeout_s)` stops taking pages, lets the thread finish what is queued
within the deadline, and returns how many pages were left unwritten.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

import torch

from pipeserve.hicache.page import PageLayout
from pipeserve.hicache.redis_tier import RedisTier, TierUnavailable

log = logging.getLogger(__name__)

# After a failed write, pages are dropped unwritten for this long (doubling per failure in a row, up
# to the max): a Redis that is down costs no socket timeouts per page, and is tried again soon.
BACKOFF_S = 0.2
BACKOFF_MAX_S = 5.0


@dataclass
class WriterStats:
    queued: int = 0
    written: int = 0
    bytes_written: int = 0
    dropped_full: int = 0  # the queue was full
    failed: int = 0  # Redis refused or did not answer in time


class PageWriter:
    def __init__(self, tier: RedisTier, layout: PageLayout, max_queue: int = 256) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue: must be >= 1 (got {max_queue})")
        self.tier = tier
        self.layout = layout
        self.stats = WriterStats()
        self.available = True  # the last write succeeded (or none was tried)
        self._queue: queue.Queue[tuple[int, torch.Tensor, int] | None] = queue.Queue(max_queue)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"l3-writer-{layout.stage}", daemon=True)
        self._thread.start()

    def submit(self, block_hash: int, page: torch.Tensor, tokens: int) -> bool:
        """Queue one page ([layers, 2, block_size, kv_heads, head_dim]); False if dropped."""
        if self._closed:
            return False
        try:
            self._queue.put_nowait((block_hash, page.detach().to("cpu", copy=True), tokens))
        except queue.Full:
            self.stats.dropped_full += 1
            return False
        self.stats.queued += 1
        return True

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    def close(self, timeout_s: float = 5.0) -> int:
        """Stop taking pages; write what is queued within `timeout_s`; the pages left unwritten."""
        self._closed = True
        deadline = time.monotonic() + timeout_s
        try:
            self._queue.put(None, timeout=timeout_s)  # the thread's stop, behind what is queued
            stop_queued = True
        except queue.Full:
            stop_queued = False
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if not self._thread.is_alive():
            return 0
        return max(0, self._queue.qsize() - stop_queued)

    def _run(self) -> None:
        delay, retry_at = BACKOFF_S, 0.0
        while (item := self._queue.get()) is not None:
            block_hash, page, tokens = item
            if not self.available and time.monotonic() < retry_at:
                self.stats.failed += 1  # Redis is down: drop without waiting on it (backoff)
                continue
            try:
                self.stats.bytes_written += self.tier.store(self.layout, block_hash, page, tokens)
                self.stats.written += 1
                ok = True
            except TierUnavailable as e:
                self.stats.failed += 1
                ok = False
                if self.available:
                    log.warning("L3 unavailable for stage %d: %s", self.layout.stage, e)
                else:
                    delay = min(2 * delay, BACKOFF_MAX_S)
                retry_at = time.monotonic() + delay
            if ok and not self.available:
                log.info("L3 available again for stage %d", self.layout.stage)
                delay = BACKOFF_S
            self.available = ok
