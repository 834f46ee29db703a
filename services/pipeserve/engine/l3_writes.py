"""L3Writes: which full blocks stage 0 orders written to L3, and when (DESIGN.md sections 2 and 5).

Only stage 0 decides: a stage writes a page only when a plan names its block (`PageStore`), so
every stage writes its part of exactly the same blocks. A stage choosing on its own would leave
blocks that some stages hold and others lack: misses for every group, and wasted bytes.

Policy (`hicache_write_policy`), applied to each full block a request commits (computed, or taken
from a cache tier):
- "second-hit" (the default): the block is ordered written when it is seen again — its chain hash
  was committed before (a bounded filter of recent hashes, `SeenFilter`), or the request got it
  from the prefix cache (an L1/L2 hit: the prefix is already shared), or another running request
  references it. A prompt seen once costs Redis neither bandwidth nor memory; a shared prefix is
  stored the second time it is seen. SGLang's `write_through_selective` (a node is backed up when
  its hit count reaches 2) is the same rule on a radix tree.
- "always": every block on its first computation (write-through).
Blocks known to be in L3 (ordered or loaded lately) are not ordered again.

Pacing: ordered blocks wait in a backlog (block id -> hash, oldest first: the leading blocks of a
prefix, the ones a later hit can use, go first) and leave it at the writers' rate cap (bytes/s of
the largest stage page), with a burst of half a writer's staging buffer. A writer's buffer then
holds what its own rate lets through, and a long prefix ordered at once is written in full instead
of overflowing the buffer. A backlog block the scheduler hands to new content leaves with the plan
being built (a plan reads its stores out of L1 before anything writes a block) if the writers'
buffers can take it, else it is dropped and ordered again at a later sighting. A block enters the
backlog only once the plan that computed it came back, so every stage holds its final content.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from pipeserve.config import HICACHE_WRITE_POLICIES
from pipeserve.engine.plan import PageStore

SEEN_SLOTS = 1 << 16  # 512 KiB of hashes: ~1M tokens of recent prompts at 16 tokens a block
KNOWN_MAX = 1 << 16  # hashes remembered as being in L3


class RateCap:
    """A token bucket in bytes: `book(n)` takes n bytes and returns how long the caller must wait
    for the bucket to be out of debt (0 when it was not). `rate` 0: no cap."""

    def __init__(self, rate_bytes_s: float, depth_bytes: float) -> None:
        self.rate = rate_bytes_s
        self.depth = max(depth_bytes, 1.0)
        self._tokens = self.depth
        self._t = time.monotonic()

    def _refill(self, now: float) -> None:
        self._tokens = min(self.depth, self._tokens + (now - self._t) * self.rate)
        self._t = now

    def book(self, n: int, now: float | None = None) -> float:
        if self.rate <= 0:
            return 0.0
        self._refill(time.monotonic() if now is None else now)
        self._tokens -= n
        return max(0.0, -self._tokens / self.rate)

    def room(self, n: int, now: float) -> bool:
        """Whether n bytes may go now without debt (books nothing)."""
        if self.rate <= 0:
            return True
        self._refill(now)
        return self._tokens >= n

    def try_book(self, n: int, now: float, debt: float) -> bool:
        """Take n bytes if the bucket stays within `debt` of empty; whether it did."""
        if self.rate <= 0:
            return True
        self._refill(now)
        if self._tokens - n < -debt:
            return False
        self._tokens -= n
        return True

    def wait_s(self, n: int, now: float) -> float:
        """Seconds until n bytes may go without debt."""
        if self.rate <= 0:
            return 0.0
        self._refill(now)
        return max(0.0, (n - self._tokens) / self.rate)


class SeenFilter:
    """Recently committed chain hashes, direct-mapped (slot = hash mod size): a newer hash in the
    same slot replaces the older, which is then only one more first sighting. 8 bytes a slot."""

    def __init__(self, slots: int = SEEN_SLOTS) -> None:
        if slots < 1 or slots & (slots - 1):
            raise ValueError(f"slots: a power of 2 (got {slots})")
        self._hashes = np.zeros(slots, dtype=np.uint64)
        self._mask = slots - 1

    def sighted(self, block_hash: int) -> bool:
        """Record a sighting; whether the hash was seen before (0 marks an empty slot: never seen)."""
        h = block_hash & 0xFFFF_FFFF_FFFF_FFFF
        i = h & self._mask
        seen = h != 0 and int(self._hashes[i]) == h
        self._hashes[i] = h
        return seen


@dataclass(frozen=True)
class WriteSettings:
    """The group's L3 write settings, as stage 0 applies them (EngineConfig's hicache_write_*)."""

    policy: str = "second-hit"
    rate_bytes_s: float = 0.0  # each stage's writer cap; 0: not paced
    buffer_bytes: int = 32 << 20  # each stage's staging buffer: stage 0's burst is half of it


@dataclass
class WriteStats:
    ordered: int = 0  # blocks ordered written (PageStores sent)
    first_sightings: int = 0  # blocks not ordered: seen once (second-hit)
    forced: int = 0  # backlog blocks sent early: the scheduler reused the block
    dropped_reused: int = 0  # ... and those that would have overflowed a writer's buffer (not sent)


class L3Writes:
    def __init__(self, settings: WriteSettings, page_bytes: int) -> None:
        """`page_bytes`: the largest stage's stored value of one block (the pacing unit)."""
        if settings.policy not in HICACHE_WRITE_POLICIES:
            raise ValueError(f"policy: one of {HICACHE_WRITE_POLICIES} (got {settings.policy!r})")
        self.settings = settings
        self.page_bytes = max(1, page_bytes)
        burst = max(self.page_bytes, settings.buffer_bytes // 2)
        self._cap = RateCap(settings.rate_bytes_s, burst)
        self._seen = SeenFilter()
        self._known: OrderedDict[int, None] = OrderedDict()
        self._backlog: OrderedDict[int, int] = OrderedDict()  # block id -> hash, oldest first
        self._forced: list[PageStore] = []  # reused blocks: they leave with the plan being built
        self.stats = WriteStats()

    # --- what is in L3 -----------------------------------------------------------
    def note_known(self, hashes: list[int]) -> None:
        for h in hashes:
            self._known[h] = None
            self._known.move_to_end(h)
        while len(self._known) > KNOWN_MAX:
            self._known.popitem(last=False)

    def is_known(self, block_hash: int) -> bool:
        return block_hash in self._known

    def forget(self, block_hash: int) -> None:
        self._known.pop(block_hash, None)

    def forget_all(self) -> None:
        self._known.clear()

    # --- the decision --------------------------------------------------------------
    def committed(self, block_id: int, block_hash: int, shared: bool) -> bool:
        """A request committed a full block: order it written if the policy says so (True)."""
        seen = self._seen.sighted(block_hash)
        if block_hash in self._known:
            return False
        if not (self.settings.policy == "always" or shared or seen):
            self.stats.first_sightings += 1
            return False
        self._backlog[block_id] = block_hash
        self.note_known([block_hash])  # ordered: not ordered again while it is believed stored
        return True

    def reused(self, block_id: int) -> None:
        """The scheduler hands `block_id` to new content in the plan being built: a backlog store of
        it goes with that plan, whose stores are read out before its writes — if the writers' buffers
        can take it (the bucket may run into debt by the other half of a buffer). Otherwise it is
        dropped here and its hash forgotten, so a later sighting orders it again: a burst of reused
        blocks would only overflow the buffers, and a page dropped by a stage makes stage 0 forget
        everything it believed stored."""
        h = self._backlog.pop(block_id, None)
        if h is None:
            return
        if self._cap.try_book(self.page_bytes, time.monotonic(), debt=self._cap.depth):
            self._forced.append(PageStore(block_id, h))
            self.stats.forced += 1
        else:
            self.forget(h)
            self.stats.dropped_reused += 1

    # --- pacing ----------------------------------------------------------------------
    @property
    def backlog(self) -> int:
        return len(self._backlog) + len(self._forced)

    def take(self, now: float) -> list[PageStore]:
        """The stores of the plan being built: the forced ones, then the backlog as the cap allows."""
        out, self._forced = self._forced, []  # booked when their blocks were reused
        while self._backlog and self._cap.room(self.page_bytes, now):
            bid, h = self._backlog.popitem(last=False)
            self._cap.book(self.page_bytes, now)
            out.append(PageStore(bid, h))
        self.stats.ordered += len(out)
        return out

    def wait_s(self, now: float) -> float:
        """Seconds until the backlog's next store may leave (0: none waits, or it may go now)."""
        if self._forced or not self._backlog:
            return 0.0
        return self._cap.wait_s(self.page_bytes, now)
