"""RedisDirectory: stage 0's presence queries to L3 (engine/prefix_loads.py's L3Directory).

The engine thread never blocks on Redis: `probe` queues the question, a
daemon thread asks Redis (one pipelined round trip for every stage's page of
every block of every question queued meanwhile, RedisTier.present_many) and
leaves the answers for `answers()`; stage 0 waits for them at most a few
milliseconds (scheduler.PROBE_WAIT_S) before planning without the request.

Redis down, slow or refusing: the probe is answered 0 (a miss), the state
change is logged once, and Redis is left alone for a backoff (doubling from
`backoff_s` up to `backoff_max_s`); the next probe after it tries again, and
redis-py reconnects by itself. L3 may only ever cost misses.

Stage 0 reaching Redis does not mean every stage does: a follower cut off from
Redis (or too slow for the deadline) answers its loads "unavailable" or "late",
and each request that was ordered such a load waited for nothing. So a load
that ends so pauses the loads the same way: probes are answered 0 for a backoff
of its own (doubling while loads keep failing, back to `backoff_s` after a load
that every stage answered "ok"); the first load after it tries again. A data
error (a missing page, a bad checksum) is the page's fault, not the tier's: it
pauses nothing.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

from pipeserve.hicache.backoff import Backoff
from pipeserve.hicache.page import PageLayout
from pipeserve.hicache.redis_tier import RedisTier, TierUnavailable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadDeadline:
    """Time a stage gets to load n pages: base + per_block x n, capped (a flat timeout misprices
    long prefixes: too short for them, or far too long for short ones)."""

    base_ms: float = 250.0
    per_block_ms: float = 25.0
    max_ms: float = 30_000.0

    def __call__(self, blocks: int) -> int:
        return int(min(self.max_ms, self.base_ms + self.per_block_ms * blocks))


class RedisDirectory:
    def __init__(
        self,
        tier: RedisTier,
        layouts: list[PageLayout],
        deadline: LoadDeadline,
        backoff_s: float = 0.5,
        backoff_max_s: float = 30.0,
    ) -> None:
        self.tier = tier
        self.layouts = layouts
        self.page_bytes = max(layout.value_bytes for layout in layouts)
        self.deadline = deadline
        self.errors = 0
        self._redis = Backoff(backoff_s, backoff_max_s)  # stage 0's own calls to Redis
        self._loads = Backoff(backoff_s, backoff_max_s)  # the group's loads (any stage's answer)
        self.paused_probes = 0  # questions answered 0 because loads were paused (no Redis round trip)
        self._questions: queue.SimpleQueue[tuple[str, list[int]] | None] = queue.SimpleQueue()
        self._answers: list[tuple[str, int]] = []
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="l3-directory", daemon=True)
        self._thread.start()

    # --- L3Directory (the engine thread) ---------------------------------------
    def probe(self, req_id: str, hashes: list[int]) -> None:
        self._questions.put((req_id, hashes))

    def answers(self) -> list[tuple[str, int]]:
        with self._lock:
            out, self._answers = self._answers, []
            self._ready.clear()
        return out

    def wait(self, timeout_s: float) -> None:
        self._ready.wait(timeout_s)

    @property
    def available(self) -> bool:
        """Stage 0's last call to Redis succeeded (or none was tried)."""
        return not self._redis.down

    @property
    def loads_paused(self) -> bool:
        """The last load that ended, ended "unavailable" or "late" on some stage."""
        return self._loads.down

    def deadline_ms(self, blocks: int) -> int:
        return self.deadline(blocks)

    def load_ended(self, status: str) -> None:
        with self._lock:
            if status == "ok":
                if self._loads.succeeded():
                    log.info("L3 loads succeed on every stage again")
            elif status in ("unavailable", "late"):
                wait_s = self._loads.delay_s
                if self._loads.failed():
                    log.warning(
                        "L3 load answered %r by a stage: loads paused for %.1f s (the group recomputes)",
                        status,
                        wait_s,
                    )

    def close(self) -> None:
        self._questions.put(None)
        self._thread.join(2.0)
        self.tier.close()

    # --- the thread ------------------------------------------------------------
    def _run(self) -> None:
        stop = False
        while not stop and (q := self._questions.get()) is not None:
            batch = [q]  # every question queued meanwhile: one round trip for all of them
            while True:
                try:
                    nxt = self._questions.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                batch.append(nxt)
            found = self._present([hashes for _, hashes in batch])
            with self._lock:
                self._answers += [(req_id, n) for (req_id, _), n in zip(batch, found, strict=True)]
                self._ready.set()

    def _present(self, chains: list[list[int]]) -> list[int]:
        now = time.monotonic()
        with self._lock:
            paused = self._loads.waiting(now)
            self.paused_probes += len(chains) if paused else 0
        if paused or self._redis.waiting(now):
            return [0] * len(chains)
        try:
            found = self.tier.present_many(self.layouts, chains)
        except TierUnavailable as e:
            self.errors += 1
            if self._redis.failed(now):
                log.warning("L3 unavailable (serving on L1/L2; retrying with backoff): %s", e)
            return [0] * len(chains)
        if self._redis.succeeded():
            log.info("L3 available again at %s", self.tier.url)
        return found
