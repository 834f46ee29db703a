"""StageTiers: one stage's side of HiCache — its L2 host pool, its L3 loads and stores.

It decides nothing: every move comes from the plan (engine/plan.py says the
order), with the slots and blocks stage 0 chose. Per plan, on the stage's
thread, before the plan's chunks run:
  1. read out of L1 every block the plan stores to L3 (queued to the
     PageWriter, which writes on its own thread) or saves to L2;
  2. write the saves into their L2 slots;
  3. copy the L2 loads into their L1 blocks;
  4. hand the new L3 load orders to the loader thread (Redis GET, checks),
     each with its deadline counted from now;
  5. copy every load that finished into its L1 blocks and answer it (LoadAck):
     "ok", or why not — a load that finished after its deadline, or has not
     finished by it, is "late" and its pages are never copied (stage 0 may
     hand the blocks to another request once every stage has answered).

Without L3 (no URL) a load order is answered "disabled"; without an L2 pool
a plan that moves blocks through L2 is a PlanMismatch (the group agreed on
the pool size at start-up, so that is a divergence).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from pipeserve.engine.executor import refuse_l2_moves
from pipeserve.engine.plan import LoadAck, LoadOrder, StepPlan
from pipeserve.hicache.page import PageLayout
from pipeserve.hicache.redis_tier import LoadResult, RedisTier, TierUnavailable
from pipeserve.hicache.writer import PageWriter
from pipeserve.histogram import Histogram
from pipeserve.obs.ratelimit import RateLimitedLog

log = logging.getLogger(__name__)


@dataclass
class StageTierStats:
    l2_saves: int = 0
    l2_loads: int = 0
    l3_loads: dict[str, int] = field(default_factory=dict)  # by answer: ok, late, missing, checksum, ...
    l3_blocks_loaded: int = 0
    l3_bytes_read: int = 0
    l3_load_seconds: Histogram = field(default_factory=Histogram)  # Redis fetch + checks, per load


@dataclass
class _Fetch:
    order: LoadOrder
    deadline: float  # monotonic
    done: threading.Event = field(default_factory=threading.Event)
    finished_at: float = 0.0
    result: LoadResult | None = None
    error: str | None = None  # "unavailable" when Redis failed


class StageTiers:
    def __init__(
        self,
        layout: PageLayout,
        host_slots: int,
        tier: RedisTier | None,
        writer: PageWriter | None,
        device: torch.device,
        delay_s: float = 0.0,
    ) -> None:
        self.layout = layout
        self.delay_s = delay_s  # test fault: a slow Redis for this stage
        self.tier = tier
        self.writer = writer
        self.stats = StageTierStats()
        self._failing = False  # the last load this stage answered failed (logged on each change)
        self._load_errors = RateLimitedLog(log, interval_s=60.0)  # one line a minute while Redis is down
        self.host: torch.Tensor | None = None
        if host_slots:
            layers, two, bs, kvh, d = layout.shape
            # [layers, 2, slots, block_size, kv_heads, head_dim]: the L1 pool's layout, so a copy is
            # one index_copy per direction. Pinned on CUDA (asynchronous copies); plain on the CPU.
            self.host = torch.empty(  # untouched pages cost no memory until a save writes them
                (layers, two, host_slots, bs, kvh, d),
                dtype=layout.dtype,
                pin_memory=device.type == "cuda",
            )
        self._pending: list[_Fetch] = []
        self._orders: queue.SimpleQueue[_Fetch | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        if tier is not None:
            self._thread = threading.Thread(
                target=self._load_loop, name=f"l3-loader-{layout.stage}", daemon=True
            )
            self._thread.start()

    @property
    def lost_pages(self) -> int:
        if self.writer is None:
            return 0
        ws = self.writer.stats
        return ws.dropped_full + ws.failed + ws.dropped_down

    @property
    def host_slots(self) -> int:
        return 0 if self.host is None else self.host.shape[2]

    # --- per plan (the stage's thread) -----------------------------------------
    def execute(self, plan: StepPlan, pool: torch.Tensor) -> list[LoadAck]:
        """Apply the plan's cache moves to `pool` ([layers, 2, blocks, block_size, kv_heads, head_dim])."""
        if self.host is None:
            refuse_l2_moves(plan)
        if plan.l3_stores and self.writer is not None:
            for s in plan.l3_stores:
                self.writer.submit(s.block_hash, pool[:, :, s.block_id], self.layout.block_size)
        if plan.l2_saves:
            assert self.host is not None
            blocks = torch.tensor([c.block_id for c in plan.l2_saves], device=pool.device)
            slots = torch.tensor([c.slot for c in plan.l2_saves])
            self.host.index_copy_(2, slots, pool.index_select(2, blocks).to(self.host.device))
            self.stats.l2_saves += len(plan.l2_saves)
        if plan.l2_loads:
            assert self.host is not None
            blocks = torch.tensor([c.block_id for c in plan.l2_loads], device=pool.device)
            slots = torch.tensor([c.slot for c in plan.l2_loads])
            pool.index_copy_(2, blocks, self.host.index_select(2, slots).to(pool.device))
            self.stats.l2_loads += len(plan.l2_loads)
        acks: list[LoadAck] = []
        now = time.monotonic()
        for order in plan.l3_loads:
            if self.tier is None:
                acks.append(self._answer(order, "disabled"))
                continue
            fetch = _Fetch(order, now + order.deadline_ms / 1000)
            self._pending.append(fetch)
            self._orders.put(fetch)
        return acks + self._finish_loads(pool)

    def _finish_loads(self, pool: torch.Tensor) -> list[LoadAck]:
        acks = []
        now = time.monotonic()
        still = []
        for f in self._pending:
            if not f.done.is_set():
                if now > f.deadline:
                    acks.append(self._answer(f.order, "late"))  # the loader's result will be dropped
                else:
                    still.append(f)
                continue
            if f.finished_at > f.deadline:
                acks.append(self._answer(f.order, "late"))
            elif f.error is not None or f.result is None:
                acks.append(self._answer(f.order, f.error or "unavailable"))
            elif not f.result.ok:
                acks.append(self._answer(f.order, f.result.errors[min(f.result.errors)]))
            else:
                pages = torch.stack(
                    [p for p in f.result.pages if p is not None], dim=2
                )  # [L, 2, n, bs, h, d]
                blocks = torch.tensor(f.order.block_ids, device=pool.device)
                pool.index_copy_(2, blocks, pages.to(pool.device))
                self.stats.l3_blocks_loaded += len(f.order.block_ids)
                acks.append(self._answer(f.order, "ok"))
        self._pending = still
        return acks

    def _answer(self, order: LoadOrder, status: str) -> LoadAck:
        self.stats.l3_loads[status] = self.stats.l3_loads.get(status, 0) + 1
        failing = status not in ("ok", "disabled")
        if failing != self._failing:  # one line per change of state, not one per load
            self._failing = failing
            if failing:
                log.warning(
                    "stage %d: L3 load of %d pages answered %r (the group recomputes; "
                    "hicache_load_* flags price the deadline)",
                    self.layout.stage,
                    len(order.block_ids),
                    status,
                )
            else:
                log.info("stage %d: L3 loads succeed again", self.layout.stage)
        return LoadAck(order.load_id, status)

    # --- the loader thread -----------------------------------------------------
    def _load_loop(self) -> None:
        assert self.tier is not None
        while (f := self._orders.get()) is not None:
            t0 = time.monotonic()
            if self.delay_s:
                time.sleep(self.delay_s)
            try:
                f.result = self.tier.load(self.layout, f.order.block_hashes)
                self.stats.l3_bytes_read += sum(
                    self.layout.payload_bytes for p in f.result.pages if p is not None
                )
            except TierUnavailable as e:
                f.error = "unavailable"
                self._load_errors.debug(
                    "unavailable", "stage %d: L3 load %d: %s", self.layout.stage, f.order.load_id, e
                )
            except Exception:  # a bug in decoding: the load fails, the stage goes on
                log.exception("stage %d: L3 load %d failed", self.layout.stage, f.order.load_id)
                f.error = "error"
            f.finished_at = time.monotonic()
            self.stats.l3_load_seconds.observe(f.finished_at - t0)
            f.done.set()

    def close(self, timeout_s: float = 2.0) -> None:
        if self._thread is not None:
            self._orders.put(None)
            self._thread.join(timeout_s)
        if self.writer is not None:
            self.writer.close(timeout_s)
        if self.tier is not None:
            self.tier.close()
