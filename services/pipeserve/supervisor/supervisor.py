"""Supervisor: starts R pipeline groups and keeps them serving, the way the operator will.

Every `interval_s` (SupervisorConfig: every timing below is named there) it looks at each group:
- a stage process exited (crash, group stop, a wedge the stage detected
  itself) ⇒ the whole group is stopped and restarted;
- a stage's /livez says wedged (503), or has not answered for longer than
  its own wedge detector needs (timeout + grace + margin: a stage frozen so
  hard it cannot even exit, e.g. SIGSTOP) ⇒ the same;
- a group not ready within connect_timeout_s + margin of its start ⇒ the same.
Restarts back off exponentially (backoff_s doubling up to backoff_max_s; a
group ready for `stable_s` is forgiven its past failures) and are counted in
`pipeserve_group_restarts_total{group}`. The router is told at once
(`set_down`), so it stops routing to the group before its next health poll,
and keeps serving from the other groups. Blocking process calls run in a
worker thread.

In `pipeserve up` the supervisor runs on its own thread and event loop
(`SupervisorThread`): a client that stalls the router's loop (a CPU-heavy
request) must not stall the watching and restarting of groups. Whatever it
calls into the router (`on_down`) must therefore be thread-safe (the caller
wraps it in `loop.call_soon_threadsafe`); `all_ready` and `failed` are
threading.Events any thread may read.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge

from pipeserve.config import SupervisorConfig
from pipeserve.errors import ExitCode
from pipeserve.supervisor.group import GroupSlot, SlotState

log = logging.getLogger(__name__)


class Supervisor:
    def __init__(
        self,
        slots: list[GroupSlot],
        registry: CollectorRegistry,
        on_down: Callable[[str, str], None] = lambda name, reason: None,
        config: SupervisorConfig | None = None,
    ) -> None:
        self.slots = slots
        self.on_down = on_down
        self.config = config = config or SupervisorConfig()
        self.restarts = Counter(
            "pipeserve_group_restarts", "whole-group restarts by the supervisor", ["group"], registry=registry
        )
        self.group_ready = Gauge(
            "pipeserve_group_ready", "1 when every stage of the group is ready", ["group"], registry=registry
        )
        for slot in slots:
            self.restarts.labels(slot.name)
            self.group_ready.labels(slot.name).set(0)
        self.all_ready = threading.Event()  # every group was ready at least once
        # A stage that cannot start (exit 2: configuration or checkpoint) before its group was ever
        # ready will not start on a retry either: `pipeserve up` gives up instead of looping.
        self.fatal: str | None = None
        self.failed = threading.Event()
        self._stopping = False
        self._client = httpx.AsyncClient(timeout=config.probe_timeout_s)

    async def start(self) -> None:
        for slot in self.slots:
            slot.start()
            log.info("%s: starting %d stages (gRPC %s)", slot.name, slot.config.stages, slot.grpc_target)

    async def run(self) -> None:
        while not self._stopping:
            await asyncio.gather(*(self._watch(slot) for slot in self.slots))
            if all(s.state is SlotState.READY for s in self.slots):
                self.all_ready.set()
            await asyncio.sleep(self.config.interval_s)

    async def _watch(self, slot: GroupSlot) -> None:
        now = time.monotonic()
        if slot.state is SlotState.BACKOFF:
            if now >= slot.restart_at and not self._stopping:
                slot.start()
                log.info("%s: restarting (restart %d)", slot.name, slot.restarts)
            return
        if slot.state not in (SlotState.STARTING, SlotState.READY):
            return
        if exited := slot.exited():
            rank, code = next(iter(sorted(exited.items())))
            if code == ExitCode.CANNOT_START and slot.ready_at is None and not slot.restarts:
                self.fatal = f"{slot.name}: stage {rank} cannot start (see its log)"
                self.failed.set()
                return
            await self._fail(slot, f"stage {rank} exited with status {code}")
            return
        cause = await self._probe(slot)
        if cause:
            await self._fail(slot, cause)
            return
        if slot.state is SlotState.STARTING:
            if await self._all_ready(slot):
                slot.state = SlotState.READY
                slot.ready_at = now
                self.group_ready.labels(slot.name).set(1)
                log.info("%s: ready after %.1fs", slot.name, now - slot.started_at)
            elif now - slot.started_at > slot.config.connect_timeout_s + self.config.ready_margin_s:
                await self._fail(slot, f"not ready {now - slot.started_at:.0f}s after start")
        elif slot.ready_at is not None and now - slot.ready_at > self.config.stable_s:
            slot.failures_in_a_row = 0

    async def _probe(self, slot: GroupSlot) -> str | None:
        """A wedged stage, or one that stopped answering; None when every stage is alive."""
        c = self.config
        limit = slot.serve.wedge_timeout_s + slot.serve.wedge_grace_s + c.unanswered_margin_s
        for rank in range(slot.config.stages):
            try:
                r = await self._client.get(slot.health_url(rank) + "/livez")
            except httpx.HTTPError:
                if slot.state is SlotState.STARTING and time.monotonic() - slot.started_at < c.start_grace_s:
                    continue  # the side port opens a moment after the process starts
                slot.probe_failures[rank] = slot.probe_failures.get(rank, 0) + 1
                if slot.probe_failures[rank] * (c.interval_s + c.probe_timeout_s) > limit:
                    return f"stage {rank} has not answered /livez for {limit:.0f}s"
                continue
            slot.probe_failures[rank] = 0
            if r.status_code == 503:
                return f"stage {rank} is wedged: {r.json().get('report', '')[:300]}"
        return None

    async def _all_ready(self, slot: GroupSlot) -> bool:
        for rank in range(slot.config.stages):
            try:
                r = await self._client.get(slot.health_url(rank) + "/readyz")
            except httpx.HTTPError:
                return False
            if r.status_code != 200:
                return False
        return True

    async def _fail(self, slot: GroupSlot, cause: str) -> None:
        if self._stopping:
            return
        slot.last_failure = cause
        self.on_down(slot.name, cause)
        self.group_ready.labels(slot.name).set(0)
        codes = await asyncio.to_thread(slot.kill, self.config.kill_grace_s)
        slot.restarts += 1
        self.restarts.labels(slot.name).inc()
        delay = min(self.config.backoff_max_s, self.config.backoff_s * 2**slot.failures_in_a_row)
        slot.failures_in_a_row += 1
        slot.state = SlotState.BACKOFF
        slot.restart_at = time.monotonic() + delay
        log.error(
            "GROUP RESTART: %s: %s; stopped stages %s; restarting in %.1fs (restart %d)",
            slot.name,
            cause,
            codes,
            delay,
            slot.restarts,
        )

    async def shutdown(self, drain_s: float) -> None:
        """Drain and stop every group (stage 0 first, the ring's Stop ends the rest)."""
        self._stopping = True
        codes = await asyncio.gather(*(asyncio.to_thread(s.shutdown, drain_s) for s in self.slots))
        for slot, c in zip(self.slots, codes, strict=True):
            log.info("%s: stopped, exit statuses %s", slot.name, c)
        await self._client.aclose()


class SupervisorThread:
    """A Supervisor on its own thread and event loop; `start()` starts the groups, `stop()` drains them."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._drain_s = 0.0
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._main, name="pipeserve-supervisor", daemon=True)

    def start(self, timeout_s: float = 120.0) -> None:
        """Start the thread and every group's processes (blocking: call it from a worker thread)."""
        self._thread.start()
        if not self._started.wait(timeout_s):
            raise RuntimeError(f"the supervisor did not start its groups within {timeout_s}s")

    def stop(self, drain_s: float, timeout_s: float) -> None:
        """Drain and stop every group; blocks at most timeout_s (call it from a worker thread)."""
        self._drain_s = drain_s
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None:
            try:
                loop.call_soon_threadsafe(stop.set)
            except RuntimeError:  # the loop has already ended
                pass
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.error("the supervisor did not stop within %.0fs", timeout_s)

    def _main(self) -> None:
        sup = self.supervisor
        try:
            asyncio.run(self._serve())
        except Exception as e:  # a supervisor bug: `pipeserve up` must give up, not serve unwatched
            log.exception("the supervisor failed")
            sup.fatal = sup.fatal or f"the supervisor failed: {e}"
            sup.failed.set()
        finally:
            self._started.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            await self.supervisor.start()
        finally:
            self._started.set()
        watch = asyncio.create_task(self.supervisor.run())
        stop = asyncio.create_task(self._stop.wait())
        await asyncio.wait({watch, stop}, return_when=asyncio.FIRST_COMPLETED)
        crashed = watch.exception() if watch.done() and not watch.cancelled() else None
        watch.cancel()
        stop.cancel()
        await asyncio.gather(watch, stop, return_exceptions=True)
        # A crashed watch stops the groups at once (no drain): nothing would restart them any more.
        await self.supervisor.shutdown(0.0 if crashed else self._drain_s)
        if crashed is not None:
            raise crashed
