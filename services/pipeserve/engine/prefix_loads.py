"""L3 loads on stage 0: what it asks Redis, what it orders, what it decides (DESIGN.md section 5).

A waiting request whose prompt continues past its L1/L2 hits is *probed*:
`L3Directory.probe` asks (off the engine thread) how many of the following
blocks L3 holds for every stage. If some, stage 0 allocates L1 blocks for
them and puts a LoadOrder in the next plan, with a deadline priced by size
(`base + per_block x blocks`, capped: a flat timeout misprices long
prefixes). Each stage answers with a LoadAck in its report. The loaded
blocks join L1's prefix cache only when **every** stage answered "ok"; any
other answer (late, missing, checksum, Redis unavailable) releases them
unnamed and the request recomputes. Either way the request then holds no
blocks until its admission finds the prefix in L1 like any other hit (a
waiting request that held blocks could fill the pool with requests that
cannot start). Only this request waits for its load; the batch runs on.

The load holds its own reference on the blocks until every stage has
answered, so a request aborted meanwhile cannot hand a block to another
request while a stage may still write into it.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

from pipeserve.engine.block_manager import BlockManager, chain_hashes
from pipeserve.engine.l3_writes import L3Writes, WriteSettings
from pipeserve.engine.plan import BlockCopy, LoadAck, LoadOrder
from pipeserve.engine.request import Fetch, Request
from pipeserve.histogram import Histogram


class L3Directory(Protocol):
    """Stage 0's view of L3: presence queries, answered asynchronously (hicache/directory.py)."""

    page_bytes: int  # the largest stage's stored value of one block (L3 writes are paced by it)

    def probe(self, req_id: str, hashes: list[int]) -> None:
        """Queue 'how many leading blocks of `hashes` does L3 hold for every stage?'; never blocks."""

    def answers(self) -> list[tuple[str, int]]:
        """Finished probes since the last call: (req_id, leading blocks present; 0 when unavailable)."""

    def wait(self, timeout_s: float) -> None:
        """Return when an answer is ready, or after timeout_s."""

    def deadline_ms(self, blocks: int) -> int:
        """The time each stage gets to load `blocks` pages."""

    def load_ended(self, status: str) -> None:
        """How the group's last L3 load ended ("ok" or the first failing stage's answer): a stage
        that could not reach Redis in time ("unavailable", "late") pauses the loads for a backoff."""

    def close(self) -> None: ...


@dataclass
class TierStats:
    """Prompt tokens served per tier at admission, and how L3 loads ended."""

    hit_tokens: Counter[str] = field(default_factory=Counter)  # "l1", "l2", "l3"
    probes: int = 0
    probe_hit_blocks: int = 0
    probe_wait_s: float = 0.0  # the scheduler's waits for fresh probe answers
    probe_waits_expired: int = 0  # ... that ended with a probe still unanswered (its request waits a step)
    loads: Counter[str] = field(default_factory=Counter)  # "ok" or the first failing stage's status
    load_blocks_ok: int = 0
    load_seconds: Histogram = field(default_factory=Histogram)  # order sent -> every stage answered


@dataclass
class PendingLoad:
    order: LoadOrder
    req: Request
    tokens: list[tuple[int, ...]]  # each block's tokens (published on success)
    issued: float
    acks: dict[int, str] = field(default_factory=dict)  # rank -> status
    status: str = ""  # once every stage answered: "ok" or the first failing answer (outcome())


class PrefixFetch:
    """Stage 0's fetching of prefixes from L2 and L3 for the scheduler's admissions: L2 copies,
    L3 probes and loads in flight (issued with a plan, finished when every stage has answered)."""

    def __init__(
        self, bm: BlockManager, num_stages: int, l3: L3Directory | None, writes: WriteSettings | None = None
    ) -> None:
        self.bm = bm
        self.l3 = l3 if bm.enable_prefix_caching else None
        self.num_stages = num_stages
        self.pending: dict[int, PendingLoad] = {}
        self._next = 0
        self.stats = TierStats()
        # Which blocks go to L3 (stage 0's decision), and the hashes known to be there.
        self.writes = None if self.l3 is None else L3Writes(writes or WriteSettings(), self.l3.page_bytes)
        self._probed: dict[str, list[int]] = {}  # req_id -> the hashes its probe asked about
        self._lost = 0

    def issue(
        self,
        req: Request,
        block_ids: list[int],
        hashes: list[int],
        tokens: list[tuple[int, ...]],
        deadline_ms: int,
    ) -> LoadOrder:
        self._next += 1
        order = LoadOrder(self._next, list(block_ids), list(hashes), int(deadline_ms))
        self.pending[order.load_id] = PendingLoad(order, req, tokens, time.monotonic())
        return order

    def ack(self, rank: int, ack: LoadAck) -> PendingLoad | None:
        """Record one stage's answer; returns the load once every stage has answered (no longer pending)."""
        load = self.pending.get(ack.load_id)
        if load is None or rank in load.acks:
            raise ValueError(f"stage {rank}: answer to load {ack.load_id} that is not awaited")
        load.acks[rank] = ack.status
        if len(load.acks) < self.num_stages:
            return None
        del self.pending[ack.load_id]
        load.status = status = self.outcome(load)
        self.stats.loads[status] += 1
        if status == "ok":
            self.stats.load_blocks_ok += len(load.order.block_ids)
            if self.writes is not None:
                self.writes.note_known(load.order.block_hashes)
        self.stats.load_seconds.observe(time.monotonic() - load.issued)
        if self.l3 is not None:
            self.l3.load_ended(status)
        return load

    @staticmethod
    def outcome(load: PendingLoad) -> str:
        """ "ok" only if every stage said ok; otherwise the first other answer in rank order."""
        for rank in sorted(load.acks):
            if load.acks[rank] != "ok":
                return load.acks[rank]
        return "ok"

    def load_from_host(
        self,
        tokens: list[int],
        first: int,
        blocks: list[int],
        l2: list[tuple[int, int]],
        out: list[BlockCopy],
    ) -> None:
        """Copy L2 hits (blocks `first`...) into the leading fresh `blocks` — in this plan, before its
        chunks — and name them, so a request admitted later in this plan may share them."""
        bs = self.bm.block_size
        for j, ((slot, h), bid) in enumerate(zip(l2, blocks, strict=False)):
            out.append(BlockCopy(bid, slot))
            k = first + j
            self.bm.publish(bid, h, tuple(tokens[k * bs : (k + 1) * bs]))

    def order_load(
        self,
        req: Request,
        hits: list[int],
        l2: list[tuple[int, int]],
        prev: int,
        l2_loads: list[BlockCopy],
        l3_loads: list[LoadOrder],
    ) -> bool:
        """Hold blocks for req's prefix up to `l3_end`: L1 hits, L2 copies, and L3 blocks loaded by
        every stage (a LoadOrder in this plan). False when the pool has no room now."""
        assert self.l3 is not None
        bs = self.bm.block_size
        tokens = req.all_token_ids
        k = len(hits) + len(l2)
        need = len(l2) + req.l3_end - k
        if not self.bm.can_allocate(need, hits):
            req.fetch = Fetch.PROBED  # asked again at the next admission
            return False
        self.bm.take_cached(hits)
        new = self.bm.allocate(need)
        self.load_from_host(tokens, len(hits), new, l2, l2_loads)
        l3_blocks = new[len(l2) :]
        self.bm.take_cached(l3_blocks)  # the load's own reference, until every stage has answered
        hashes = chain_hashes(tokens, bs, k, req.l3_end, l2[-1][1] if l2 else prev)
        block_tokens = [tuple(tokens[j * bs : (j + 1) * bs]) for j in range(k, req.l3_end)]
        order = self.issue(req, l3_blocks, hashes, block_tokens, self.l3.deadline_ms(len(l3_blocks)))
        l3_loads.append(order)
        req.block_ids = list(hits) + new
        req.fetched = {j: "l2" for j in range(len(hits), k)} | {j: "l3" for j in range(k, req.l3_end)}
        req.fetch = Fetch.LOADING
        return True

    def note_lost(self, lost: int) -> None:
        """Pages the stages could not write (their reports' sum): when it grows, what stage 0
        believes is in L3 may not be; it forgets, and the next requests store their blocks again."""
        if lost != self._lost:
            self._lost = lost
            if self.writes is not None:
                self.writes.forget_all()

    def probe(self, req: Request, start: int, hashes: list[int]) -> None:
        """Ask L3 about req's blocks from `start` on (their chain hashes); the answer comes later."""
        assert self.l3 is not None
        self.l3.probe(req.req_id, hashes)
        self._probed[req.req_id] = hashes
        self.stats.probes += 1
        req.fetch, req.l3_end = Fetch.PROBING, start

    def take_probe_answers(self, requests: dict[str, Request]) -> None:
        if self.l3 is None:
            return
        for req_id, blocks in self.l3.answers():
            hashes = self._probed.pop(req_id, [])
            # Blocks written through lately but absent now (a store dropped, Redis restarted or
            # evicting): forget them, so the next request that computes them stores them again.
            assert self.writes is not None
            for h in hashes[blocks:]:
                self.writes.forget(h)
            req = requests.get(req_id)
            if req is None or req.fetch is not Fetch.PROBING:
                continue  # finished or aborted meanwhile
            self.stats.probe_hit_blocks += blocks
            req.fetch = Fetch.PROBED if blocks else Fetch.DONE
            req.l3_end += blocks

    def await_probes(self, requests: dict[str, Request], timeout_s: float) -> bool:
        """Take probe answers as they come, until none is outstanding or `timeout_s` has passed;
        whether any came. (The directory answers 0 at once while Redis is known down.)"""
        assert self.l3 is not None
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        got = False
        while self._probed:
            outstanding = len(self._probed)
            self.take_probe_answers(requests)
            got |= len(self._probed) < outstanding
            left = deadline - time.monotonic()
            if not self._probed or left <= 0:
                break
            self.l3.wait(left)
        self.stats.probe_wait_s += time.monotonic() - t0
        self.stats.probe_waits_expired += bool(self._probed)
        return got

    def on_ack(self, rank: int, ack: LoadAck) -> None:
        """One stage's answer; once every stage answered, use the blocks (all ok) or recompute."""
        load = self.ack(rank, ack)
        if load is None:
            return
        self.bm.release_blocks(load.order.block_ids)  # the load's own reference
        req = load.req
        if req.fetch is not Fetch.LOADING or req.is_finished:
            return  # aborted meanwhile: its blocks went back when it finished
        if load.status == "ok":
            for bid, h, toks in zip(load.order.block_ids, load.order.block_hashes, load.tokens, strict=True):
                self.bm.publish(bid, h, toks)
        else:
            req.fetched = {}
        # A waiting request holds no blocks: the loaded prefix is in L1's cache now, found by the
        # request's admission like any other hit (or evicted first under pressure, then recomputed).
        # Holding them until admission could fill the pool with requests that cannot start.
        self.bm.release(req)
        req.fetch = Fetch.DONE
