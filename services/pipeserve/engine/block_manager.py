"""BlockManager: the KV block pool and prefix cache of stage 0.

Invariants:
* A block is either referenced (ref_count > 0, owned by >= 1 request) or free
  (ref_count == 0), in exactly one of two places:
  - `blank`, a stack of free blocks that hold nothing worth keeping (no hash):
    a block released without a hash goes on top, blocks never used lie at the
    bottom;
  - `free`, the LRU-ordered free blocks that hold a cached prefix (`hash` set,
    listed in `cached`): release appends at the back, eviction takes the
    front. A prefix hit on a free block takes it out of `free`.
* Allocation takes the top of `blank` first, then evicts from `free`'s front.
  So a cached prefix is evicted only when no blank block is left, and the pool's
  pages are touched as the cache needs them: on a CPU the pool is lazily
  committed memory, and handing out never-used blocks while recycled ones wait
  grew the resident set by every request's KV, cache or no cache.
* Block hashes chain: h_i = xxh3_64(h_{i-1} || tokens of block i), so a hash
  names the whole prefix up to and including block i. Only full blocks whose
  tokens all have KV are hashed. A hit also compares the tokens, so a hash
  collision cannot alias two prefixes.
* With an L2 index (`host`, HiCache), allocating a free block that holds a
  cached prefix first saves it to a host slot (`pending_saves`, carried by
  the plan being built, executed before anything writes the block), and a
  prefix continues from L1 into L2 (`match_host`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from pipeserve.engine.host_index import HostIndex
from pipeserve.engine.plan import BlockCopy
from pipeserve.engine.request import Request


def chain_hash(prev: int, tokens: list[int] | tuple[int, ...]) -> int:
    h = xxhash.xxh3_64()
    h.update(prev.to_bytes(8, "little"))
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.intdigest()


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    tokens: tuple[int, ...] | None = None


@dataclass
class CacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0
    evictions: int = 0


def chain_hashes(token_ids: list[int], block_size: int, start: int, stop: int, prev: int) -> list[int]:
    """Chained hashes of blocks [start, stop) of token_ids, `prev` being block start-1's (0 at 0)."""
    out = []
    for i in range(start, stop):
        prev = chain_hash(prev, token_ids[i * block_size : (i + 1) * block_size])
        out.append(prev)
    return out


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        host: HostIndex | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict()
        self.blank: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() yields 0, 1, ... first
        self.cached: dict[int, int] = {}  # hash -> block_id
        self.stats = CacheStats()
        # Per request: chained hashes of its leading full blocks that are committed.
        self._req_hashes: dict[str, list[int]] = {}
        self.host = host if enable_prefix_caching else None
        self.pending_saves: list[BlockCopy] = []  # L1 -> L2 copies for the plan being built
        # Told of every block allocate() hands out, before anything writes it (engine/l3_writes.py:
        # an L3 store of the block's old content still waiting goes with the plan being built).
        self.reuse_hook: Callable[[int], None] | None = None

    @property
    def num_free(self) -> int:
        return len(self.blank) + len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- prefix cache -------------------------------------------------------
    def max_prefix_blocks(self, num_tokens: int) -> int:
        """Blocks a prefix hit may cover: the last token is always computed (its logits are needed)."""
        return (num_tokens - 1) // self.block_size if self.enable_prefix_caching else 0

    def match_prefix(self, token_ids: list[int]) -> tuple[list[int], int]:
        """(cached block ids of the longest cached prefix of token_ids, the last hit's chain hash).

        At most max_prefix_blocks. Does not take references.
        """
        bs = self.block_size
        hits: list[int] = []
        prev = 0
        for i in range(self.max_prefix_blocks(len(token_ids))):
            toks = tuple(token_ids[i * bs : (i + 1) * bs])
            h = chain_hash(prev, toks)
            bid = self.cached.get(h)
            if bid is None or self.blocks[bid].tokens != toks:
                break
            hits.append(bid)
            prev = h
        return hits, prev

    def match_host(self, token_ids: list[int], start: int, prev: int) -> list[tuple[int, int]]:
        """L2 slots continuing a prefix from block `start` (`prev`: block start-1's chain hash):
        [(slot, hash)], each slot pinned against eviction until `end_plan`."""
        if self.host is None:
            return []
        bs = self.block_size
        out: list[tuple[int, int]] = []
        for i in range(start, self.max_prefix_blocks(len(token_ids))):
            toks = tuple(token_ids[i * bs : (i + 1) * bs])
            prev = chain_hash(prev, toks)
            slot = self.host.lookup(prev, toks)
            if slot is None:
                break
            out.append((slot, prev))
        return out

    def publish(self, block_id: int, block_hash: int, tokens: tuple[int, ...]) -> None:
        """Name a held block's content (loaded from L2 or L3) so later requests can share it."""
        block = self.blocks[block_id]
        if block.hash is None and block_hash not in self.cached:
            block.hash, block.tokens = block_hash, tokens
            self.cached[block_hash] = block_id

    def take_plan_saves(self) -> list[BlockCopy]:
        """The L1 -> L2 saves of the plan being built; unpins the L2 slots it loads from."""
        saves, self.pending_saves = self.pending_saves, []
        if self.host is not None:
            self.host.end_plan()
        return saves

    def record_query(self, queried: int, hit: int) -> None:
        self.stats.queried_tokens += queried
        self.stats.hit_tokens += hit

    def commit_full_blocks(self, req: Request) -> list[tuple[int, int, int]]:
        """Hash and publish req's full blocks whose tokens all have KV; returns the
        (index in the request, block id, hash) of the blocks this call hashed (the L3 write policy
        sees them)."""
        if not self.enable_prefix_caching:
            return []
        hashes = self._req_hashes.setdefault(req.req_id, [])
        full = min(req.num_computed // self.block_size, len(req.block_ids))
        if len(hashes) >= full:
            return []
        tokens = req.all_token_ids
        bs = self.block_size
        new = []
        for i in range(len(hashes), full):
            toks = tuple(tokens[i * bs : (i + 1) * bs])
            h = chain_hash(hashes[-1] if hashes else 0, toks)
            hashes.append(h)
            bid = req.block_ids[i]
            self.publish(bid, h, toks)
            new.append((i, bid, h))
        return new

    # --- allocation ---------------------------------------------------------
    def can_allocate(self, num_new: int, reuse: Sequence[int] = ()) -> bool:
        """Room for num_new fresh blocks after taking the cached blocks `reuse`."""
        reused_free = sum(1 for b in reuse if self.blocks[b].ref_count == 0)
        return self.num_free - reused_free >= num_new

    def take_cached(self, block_ids: list[int]) -> None:
        for bid in block_ids:
            block = self.blocks[bid]
            if block.ref_count == 0:
                del self.free[bid]
            block.ref_count += 1

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise RuntimeError(f"allocate({n}) with {self.num_free} free blocks")
        out = []
        for _ in range(n):
            bid = self.blank.pop() if self.blank else self.free.popitem(last=False)[0]
            block = self.blocks[bid]
            if block.hash is not None:
                if self.cached.get(block.hash) == bid:
                    del self.cached[block.hash]
                    self.stats.evictions += 1
                    if self.host is not None and block.tokens is not None:
                        slot = self.host.save(block.hash, block.tokens)
                        if slot is not None:
                            self.pending_saves.append(BlockCopy(bid, slot))
                block.hash = block.tokens = None
            block.ref_count = 1
            if self.reuse_hook is not None:
                self.reuse_hook(bid)
            out.append(bid)
        return out

    def release(self, req: Request) -> None:
        """Drop req's references; its tail blocks become the first to be evicted."""
        self.release_blocks(req.block_ids)
        req.block_ids = []
        self._req_hashes.pop(req.req_id, None)

    def release_blocks(self, block_ids: list[int]) -> None:
        for bid in reversed(block_ids):
            block = self.blocks[bid]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is not None:
                    self.free[bid] = None
                else:
                    self.blank.append(bid)
            elif block.ref_count < 0:
                raise RuntimeError(f"block {bid} released more often than taken")
