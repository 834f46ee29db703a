"""BlockManager: the KV block pool and prefix cache of stage 0.

Invariants:
* A block is either referenced (ref_count > 0, owned by >= 1 request) or in
  `free` (ref_count == 0). `free` is LRU-ordered: allocation takes from the
  front, release appends at the back, so the longest-unused block is reused
  first.
* A free block may still hold a cached prefix (`hash` set, listed in `cached`);
  allocating it for new content evicts that entry. A prefix hit on a free
  block takes it out of `free`.
* Block hashes chain: h_i = xxh3_64(h_{i-1} || tokens of block i), so a hash
  names the whole prefix up to and including block i. Only full blocks whose
  tokens all have KV are hashed. A hit also compares the tokens, so a hash
  collision cannot alias two prefixes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

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


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}  # hash -> block_id
        self.stats = CacheStats()
        # Per request: chained hashes of its leading full blocks that are committed.
        self._req_hashes: dict[str, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- prefix cache -------------------------------------------------------
    def match_prefix(self, token_ids: list[int]) -> list[int]:
        """Cached block ids for the longest cached prefix of token_ids.

        At most (len-1)//block_size blocks: the last token is always computed,
        because its logits are needed. Does not take references.
        """
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        hits: list[int] = []
        prev = 0
        for i in range((len(token_ids) - 1) // bs):
            toks = tuple(token_ids[i * bs : (i + 1) * bs])
            prev = chain_hash(prev, toks)
            bid = self.cached.get(prev)
            if bid is None or self.blocks[bid].tokens != toks:
                break
            hits.append(bid)
        return hits

    def record_query(self, queried: int, hit: int) -> None:
        self.stats.queried_tokens += queried
        self.stats.hit_tokens += hit

    def commit_full_blocks(self, req: Request) -> None:
        """Hash and publish req's full blocks whose tokens all have KV."""
        if not self.enable_prefix_caching:
            return
        hashes = self._req_hashes.setdefault(req.req_id, [])
        full = min(req.num_computed // self.block_size, len(req.block_ids))
        if len(hashes) >= full:
            return
        tokens = req.all_token_ids
        bs = self.block_size
        for i in range(len(hashes), full):
            toks = tuple(tokens[i * bs : (i + 1) * bs])
            h = chain_hash(hashes[-1] if hashes else 0, toks)
            hashes.append(h)
            block = self.blocks[req.block_ids[i]]
            if block.hash is None and h not in self.cached:
                block.hash, block.tokens = h, toks
                self.cached[h] = block.block_id

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
        if n > len(self.free):
            raise RuntimeError(f"allocate({n}) with {len(self.free)} free blocks")
        out = []
        for _ in range(n):
            bid, _ = self.free.popitem(last=False)
            block = self.blocks[bid]
            if block.hash is not None:
                if self.cached.get(block.hash) == bid:
                    del self.cached[block.hash]
                    self.stats.evictions += 1
                block.hash = block.tokens = None
            block.ref_count = 1
            out.append(bid)
        return out

    def release(self, req: Request) -> None:
        """Drop req's references; its tail blocks become the first to be evicted."""
        for bid in reversed(req.block_ids):
            block = self.blocks[bid]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[bid] = None
            elif block.ref_count < 0:
                raise RuntimeError(f"block {bid} released more often than taken")
        req.block_ids = []
        self._req_hashes.pop(req.req_id, None)
