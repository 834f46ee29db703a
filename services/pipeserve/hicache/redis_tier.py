"""RedisTier: L3, the pages of every group of one model in Redis (or a Redis Cluster).

Contract (DESIGN §5: only stage 0 decides):
- `present(layouts, hashes)` is stage 0's question "how many leading blocks of
  this chain does L3 hold for *every* stage?", answered in one round trip
  (`present_many`: several chains in one)
  (a pipeline of EXISTS; on a cluster every stage's page of a block shares a
  slot, see page.py). A block counts only if every stage's page exists, and a
  prefix only up to its first missing block.
- `store(layout, block_hash, page, tokens)` writes one stage's page (SET, with
  the optional TTL); `store_values` writes a batch of encoded pages in one
  pipelined round trip (the writer's path). `load(layout, hashes)` reads one stage's pages and checks
  each (format, layout, checksum); a missing or bad page is reported, never
  used — the caller reports the load failed and stage 0 recomputes.
- Every call has a deadline (`timeout_s` on the socket); a Redis that is down,
  slow or full raises TierUnavailable, which callers treat as a miss. Redis
  evicting keys (allkeys-lru) can only cause misses.

The connection is a redis-py pool (`Redis.from_url`: redis://, rediss://,
unix://) that reconnects by itself; a server in cluster mode is detected when
it first answers (at start-up, or later if it was down) and used through
`RedisCluster` with the same calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import redis
import torch
from redis.cluster import RedisCluster

from pipeserve.hicache.page import PageError, PageLayout, decode_page, encode_page

LOAD_BATCH = 16  # pages per round trip of a load


class TierUnavailable(RuntimeError):
    """Redis did not answer in time or refused the call; the caller counts it as a miss."""


@dataclass
class LoadResult:
    """One stage's pages of a chain of blocks: `pages[i]` is block i's tensor, or None when its page
    was missing or bad (`errors[i]` says why: "missing", "format", "layout" or "checksum")."""

    pages: list[torch.Tensor | None]
    tokens: list[int]
    errors: dict[int, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.errors


class RedisTier:
    def __init__(self, url: str, timeout_s: float = 0.5, ttl_s: int | None = None) -> None:
        if ttl_s is not None and ttl_s < 1:
            raise ValueError(f"ttl_s: must be >= 1 or None (got {ttl_s})")
        self.url = url
        self.ttl_s = ttl_s
        self._opts = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
        self.client: redis.Redis | RedisCluster = redis.Redis.from_url(url, **self._opts)
        self._detected = False
        self._detect()

    def _detect(self) -> None:
        """Use RedisCluster when the server is in cluster mode. Asked again before each call until a
        server answered, so a Redis (or cluster) that was down at start-up is recognised once it is up."""
        if self._detected:
            return
        try:
            cluster = self.client.info("cluster").get("cluster_enabled") == 1
        except redis.RedisError:
            return  # not reachable now: the call that follows fails and is counted
        self._detected = True
        if cluster:
            self.client.close()
            self.client = RedisCluster.from_url(self.url, **self._opts)

    def close(self) -> None:
        self.client.close()

    def present(self, layouts: list[PageLayout], hashes: list[int]) -> int:
        """How many leading blocks of `hashes` have a page for every stage's layout."""
        return self.present_many(layouts, [hashes])[0]

    def present_many(self, layouts: list[PageLayout], chains: list[list[int]]) -> list[int]:
        """`present` for several chains in one pipelined round trip (the probes stage 0 queued
        meanwhile: a burst of new requests costs one round trip, not one each)."""
        if not any(chains):
            return [0] * len(chains)
        try:
            self._detect()
            pipe = self.client.pipeline(transaction=False)
            for hashes in chains:
                for h in hashes:
                    for layout in layouts:
                        pipe.exists(layout.key(h))
            found = pipe.execute()
        except redis.RedisError as e:
            raise TierUnavailable(f"present: {type(e).__name__}: {e}") from None
        out, at, n = [], 0, len(layouts)
        for hashes in chains:
            out.append(_leading(found[at : at + n * len(hashes)], n, len(hashes)))
            at += n * len(hashes)
        return out

    def store(self, layout: PageLayout, block_hash: int, page: torch.Tensor, tokens: int) -> int:
        """Write one stage's page of one block; returns the bytes written."""
        value = encode_page(layout, page, tokens)
        try:
            self._detect()
            self.client.set(layout.key(block_hash), value, ex=self.ttl_s)
        except redis.RedisError as e:
            raise TierUnavailable(f"store: {type(e).__name__}: {e}") from None
        return len(value)

    def store_values(self, layout: PageLayout, values: list[tuple[int, memoryview]]) -> int:
        """Write several encoded pages of one stage (block hash, value) in one pipelined round trip;
        returns the bytes written. The values are sent as they are (redis-py writes a memoryview to
        the socket without copying it), so the caller keeps them unchanged until this returns."""
        if not values:
            return 0
        try:
            self._detect()
            pipe = self.client.pipeline(transaction=False)
            for block_hash, value in values:
                pipe.set(layout.key(block_hash), value, ex=self.ttl_s)
            pipe.execute()
        except redis.RedisError as e:
            raise TierUnavailable(f"store: {type(e).__name__}: {e}") from None
        return sum(len(v) for _, v in values)

    def load(self, layout: PageLayout, hashes: list[int]) -> LoadResult:
        """One stage's pages of `hashes`, each checked; see LoadResult. Read LOAD_BATCH pages per
        round trip: each reply stays small enough to arrive within the socket deadline, and a
        long prefix does not hold one huge reply in Redis' output buffer."""
        values: list[bytes | None] = []
        try:
            self._detect()
            for i in range(0, len(hashes), LOAD_BATCH):
                pipe = self.client.pipeline(transaction=False)
                for h in hashes[i : i + LOAD_BATCH]:
                    pipe.get(layout.key(h))
                values += pipe.execute()
        except redis.RedisError as e:
            raise TierUnavailable(f"load: {type(e).__name__}: {e}") from None
        result = LoadResult([], [])
        for i, value in enumerate(values):
            page, tokens = None, 0
            if value is None:
                result.errors[i] = "missing"
            else:
                try:
                    page, tokens = decode_page(layout, value)
                except PageError as e:
                    result.errors[i] = e.kind
            result.pages.append(page)
            result.tokens.append(tokens)
        return result


def _leading(found: list[int], n: int, blocks: int) -> int:
    """Leading blocks whose `n` pages (one per stage, in order) all exist."""
    for i in range(blocks):
        if not all(found[i * n : (i + 1) * n]):
            return i
    return blocks
