"""PageWriter: a stage's writes to L3 — batched, rate-capped, off the stage's thread.

The stage's thread does one bounded thing per page: `submit` copies the page out of the KV pool
into a free slot of the staging buffer, or, when every slot is taken, drops it and counts the drop
(a dropped page is only a later miss; stage 0 hears of it through the stage's reports and orders
the block again when it is seen again). Everything else happens on the writer's thread: the
header (format, shape, checksum) is packed in front of the staged bytes, which become the stored
value as they are (no encoding copy); pages go in batches of up to `batch_bytes`, one Redis
pipeline (one round trip) each, the staged bytes written to the socket without a copy; a token
bucket holds the average to `rate_bytes_s` (Redis's CPU and the link are taken from serving only
this fast); a slot is free again once Redis has answered its batch.

The staging buffer is allocated once: `buffer_bytes` at most (whole pages, at most `max_queue`),
pinned on CUDA. On the CPU its memory pages are touched only when a page is staged in them, so a
stage that writes nothing (second-hit on traffic without reuse) pays no memory for it, and one that
writes never holds more than the buffer, whatever the traffic.

Redis down, slow or full: the batch is counted failed and dropped, and the state change is logged
once (`available` flips), never once per page. The writer then backs off (BACKOFF_S doubling to
BACKOFF_MAX_S): pages submitted meanwhile are dropped at once, uncopied, and counted. Each counter
has one writing thread (the stage's or the writer's), so none loses an update.

`close(timeout_s)` stops taking pages, lets the thread write what is staged within the deadline,
and returns how many pages were left unwritten.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from pipeserve.engine.l3_writes import RateCap
from pipeserve.hicache.backoff import Backoff
from pipeserve.hicache.page import HEADER_BYTES, PageLayout, page_header
from pipeserve.hicache.redis_tier import RedisTier, TierUnavailable

log = logging.getLogger(__name__)

# After a failed write, pages are dropped unwritten for this long (doubling per failure in a row, up
# to the max): a Redis that is down costs no socket timeouts per page, and is tried again soon.
BACKOFF_S = 0.2
BACKOFF_MAX_S = 5.0
BATCH_BYTES = 4 << 20  # one pipeline: few round trips, and each reply well within the socket deadline


@dataclass
class WriterStats:
    queued: int = 0  # pages staged
    written: int = 0
    bytes_written: int = 0
    batches: int = 0  # pipelines sent
    dropped_full: int = 0  # the staging buffer was full
    failed: int = 0  # Redis refused or did not answer in time (or was backing off): the writer's count
    dropped_down: int = 0  # offered while the writer backs off from a failed Redis: the stage's count
    throttled_s: float = 0.0  # time the rate cap held the writer back


class PageWriter:
    def __init__(
        self,
        tier: RedisTier,
        layout: PageLayout,
        max_queue: int = 1 << 16,
        buffer_bytes: int = 32 << 20,
        rate_bytes_s: float = 0.0,
        batch_bytes: int = BATCH_BYTES,
        pin_memory: bool = False,
    ) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue: must be >= 1 (got {max_queue})")
        self.tier = tier
        self.layout = layout
        self.stats = WriterStats()
        self.slots = max(1, min(max_queue, buffer_bytes // layout.value_bytes))
        # [slots, header + payload] bytes; a slot's payload viewed as the page it holds.
        self._staging = torch.empty(
            (self.slots, layout.value_bytes), dtype=torch.uint8, pin_memory=pin_memory
        )
        self._pages = self._staging[:, HEADER_BYTES:].view(layout.dtype).view(self.slots, *layout.shape)
        self._rows = self._staging.numpy()  # the writer's view: headers in, values out (shared memory)
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for slot in range(self.slots):
            self._free.put(slot)
        self._staged: queue.SimpleQueue[tuple[int, int, int] | None] = queue.SimpleQueue()
        self._batch_pages = max(1, batch_bytes // layout.value_bytes)
        # The bucket's depth is the buffer: a burst the buffer took goes out at once, then the rate.
        self._cap = RateCap(rate_bytes_s, self.slots * layout.value_bytes)
        # While Redis is down: pages are dropped uncopied until the wait is over.
        self._backoff = Backoff(BACKOFF_S, BACKOFF_MAX_S)
        self._closed = False
        self._close_by = float("inf")
        self._thread = threading.Thread(target=self._run, name=f"l3-writer-{layout.stage}", daemon=True)
        self._thread.start()

    @property
    def available(self) -> bool:
        """The last write succeeded (or none was tried)."""
        return not self._backoff.down

    # --- the stage's thread ----------------------------------------------------
    def submit(self, block_hash: int, page: torch.Tensor, tokens: int) -> bool:
        """Stage one page ([layers, 2, block_size, kv_heads, head_dim], any device); False if dropped."""
        if self._closed:
            return False
        if self._backoff.waiting():
            self.stats.dropped_down += 1  # Redis is down: no copy, no queue (the writer backs off)
            return False
        try:
            slot = self._free.get_nowait()
        except queue.Empty:
            self.stats.dropped_full += 1
            return False
        self._pages[slot].copy_(page.detach())
        self.stats.queued += 1
        self._staged.put((slot, block_hash, tokens))
        return True

    @property
    def queue_depth(self) -> int:
        """Pages staged and not yet answered by Redis."""
        return self.slots - self._free.qsize()

    def close(self, timeout_s: float = 5.0) -> int:
        """Stop taking pages; write what is staged within `timeout_s`; the pages left unwritten."""
        self._closed = True
        self._close_by = time.monotonic() + timeout_s
        self._staged.put(None)  # the thread's stop, behind what is staged
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            return 0
        return self.queue_depth

    # --- the writer's thread ---------------------------------------------------
    def _run(self) -> None:
        stop = False
        while not stop:
            first = self._staged.get()
            if first is None:
                break
            batch = [first]
            while len(batch) < self._batch_pages:
                try:
                    item = self._staged.get_nowait()
                except queue.Empty:
                    break
                if item is None:  # close(): write this batch, then stop
                    stop = True
                    break
                batch.append(item)
            ok = self._write(batch)
            for slot, _, _ in batch:
                self._free.put(slot)
            if ok is None:
                continue  # dropped during the backoff: nothing learnt about Redis
            if ok and self._backoff.succeeded():
                log.info("L3 available again for stage %d", self.layout.stage)
            elif not ok:
                self._backoff.failed()

    def _write(self, batch: list[tuple[int, int, int]]) -> bool | None:
        """Write a batch: True, False when Redis failed, None when dropped unwritten (backing off)."""
        if self._backoff.waiting():
            self.stats.failed += len(batch)  # staged before Redis was found down: drop, no call
            return None
        wait = self._cap.book(len(batch) * self.layout.value_bytes)
        if self._closed:  # closing: wait no longer than close() does
            wait = min(wait, max(0.0, self._close_by - time.monotonic()))
        if wait > 0:
            self.stats.throttled_s += wait
            time.sleep(wait)
        values = []
        for slot, block_hash, tokens in batch:
            row = self._rows[slot]
            header = page_header(self.layout, memoryview(row[HEADER_BYTES:]), tokens)
            row[:HEADER_BYTES] = np.frombuffer(header, dtype=np.uint8)
            values.append((block_hash, memoryview(row)))
        try:
            self.stats.bytes_written += self.tier.store_values(self.layout, values)
        except TierUnavailable as e:
            self.stats.failed += len(batch)
            if self.available:
                log.warning("L3 unavailable for stage %d: %s", self.layout.stage, e)
            return False
        self.stats.written += len(batch)
        self.stats.batches += 1
        return True
