"""Supervisor: starts R pipeline groups and keeps them serving, with the operator's restart rules.

Every `interval_s` (SupervisorConfig: every timing below is named there) it observes each group and
hands the observation to the one decision function the operator uses too (care/restarts.py):
- a stage process exited (crash, group stop, a wedge the stage detected itself);
- a stage's /livez says wedged (503), or has not answered for longer than its own wedge detector
  needs (timeout + grace + margin: a stage frozen so hard it cannot even exit, e.g. SIGSTOP);
- a group not ready within connect_timeout_s + ready_margin_s of its start (the startup deadline)
⇒ RESTART: the whole group is stopped and, after the backoff (backoff_s doubling up to backoff_max_s;
a group ready for `stable_s` is forgiven its past failures), started again as a new generation.
Restarts are counted in `pipeserve:group_restarts_total{group,cause}` (`restart_cause`). A stage that
cannot start (exit 2) before its group was ever ready ⇒ FAIL: `pipeserve up` gives up instead of
looping. The router is told at once (`on_down`), so it stops routing to the group before its next
health poll and keeps serving from the other groups. Blocking process calls run in a worker thread.

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

from pipeserve.care.restarts import (
    Action,
    GroupObservation,
    GroupPhase,
    RestartPolicy,
    StageState,
    decide,
)
from pipeserve.config import SupervisorConfig
from pipeserve.errors import ExitCode
from pipeserve.supervisor.group import GroupSlot

STARTING_INTERVAL_S = 0.05  # how often a starting group's /readyz is asked

log = logging.getLogger(__name__)

UNANSWERED = "/livez has not answered"  # how _probe words a stage too frozen to answer
# `cause` of pipeserve:group_restarts_total: a stage's exit status by name (ExitCode), a signal, a
# wedge its own detector reported (/livez 503), a stage that stopped answering, the startup deadline.
RESTART_CAUSES = (
    "diverged",
    "group_stop",
    "wedged",
    "internal_error",
    "cannot_start",
    "killed",
    "exited",
    "unresponsive",
    "startup_deadline",
)


def restart_cause(obs: GroupObservation, phase: GroupPhase) -> str:
    """The RESTART_CAUSES value of a restart `decide` ordered for `obs`: the lowest rank's failure, in
    the order decide's own check reads it (an exit before a wedge); a group with no failing stage was
    restarted for its startup deadline (not yet ready) or because a stage was gone ("exited"). A stage
    that exited DIVERGED names the cause whatever its rank: the others only followed its stop."""
    if any(s.exit_code == ExitCode.DIVERGED for s in obs.stages):
        return "diverged"
    for s in sorted(obs.stages, key=lambda s: s.rank):
        if s.state is StageState.EXITED or s.restarts > 0:
            code = s.exit_code
            if code is not None and code < 0:
                return "killed"  # Popen's -N: ended by signal N (the OOM killer, a kill -9)
            if code in (ExitCode.GROUP_STOP, ExitCode.WEDGED, ExitCode.INTERNAL_ERROR, ExitCode.CANNOT_START):
                return "wedged" if code == ExitCode.WEDGED else ExitCode(code).name.lower()
            return "exited"
        if s.wedged:
            return "unresponsive" if s.wedged.startswith(UNANSWERED) else "wedged"
    return "startup_deadline" if phase is not GroupPhase.READY else "exited"


def _where_its_output_is(slot: GroupSlot) -> str:
    """Where a failed group's stages wrote their error: their log files with --log-dir, else this
    process's own stderr (a stage inherits it), never a log that does not exist."""
    ranks = sorted(slot.exited()) or list(range(slot.config.stages))
    files = [str(f) for r in ranks if (f := slot.log_file(r)) is not None]
    if files:
        return f"see {', '.join(files)}"
    return "the stage's error is in the output above; --log-dir DIR keeps each stage's log in DIR"


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
            "pipeserve:group_restarts",
            "whole-group restarts by the supervisor, by cause (docs/metrics.md)",
            ["group", "cause"],
            registry=registry,
        )
        self.group_ready = Gauge(
            "pipeserve:group_ready", "1 when every stage of the group is ready", ["group"], registry=registry
        )
        for slot in slots:
            for cause in RESTART_CAUSES:  # every series exists from 0, so increase() sees the first one
                self.restarts.labels(slot.name, cause)
            self.group_ready.labels(slot.name).set(0)
        self.all_ready = threading.Event()  # every group was ready at least once
        self.fatal: str | None = None
        self.failed = threading.Event()
        self._stopping = False
        self._client = httpx.AsyncClient(timeout=config.probe_timeout_s)

    def policy(self, slot: GroupSlot) -> RestartPolicy:
        c = self.config
        return RestartPolicy(
            startup_deadline_s=slot.config.connect_timeout_s + c.ready_margin_s,
            backoff_s=c.backoff_s,
            backoff_max_s=c.backoff_max_s,
            stable_s=c.stable_s,
            fatal_exit_codes=frozenset({ExitCode.CANNOT_START}),
        )

    async def start(self) -> None:
        for slot in self.slots:
            await self._watch(slot)  # PENDING: the decision is START

    async def run(self) -> None:
        while not self._stopping:
            await asyncio.gather(*(self._watch(slot) for slot in self.slots))
            if all(s.record.phase is GroupPhase.READY for s in self.slots):
                self.all_ready.set()
            # A starting group is looked at often, so `up` is ready as soon as its stages are; only within
            # start_grace_s, where unanswered probes are not counted (_probe prices each at an interval).
            now = time.monotonic()
            starting = any(
                s.record.phase is GroupPhase.STARTING and now - s.started_at < self.config.start_grace_s
                for s in self.slots
            )
            await asyncio.sleep(
                min(STARTING_INTERVAL_S, self.config.interval_s) if starting else self.config.interval_s
            )

    async def _watch(self, slot: GroupSlot) -> None:
        if self._stopping or slot.stopped:
            return
        phase = slot.record.phase
        ready: dict[int, bool] = {}
        wedged: dict[int, str] = {}
        if phase in (GroupPhase.STARTING, GroupPhase.READY) and not slot.group_exited():
            wedged = await self._probe(slot)
            if phase is GroupPhase.READY:
                # Once ready, liveness and exits decide (a /readyz that times out on a busy machine
                # must not take a serving group out of routing); the router polls Health itself.
                ready = dict.fromkeys(range(slot.config.stages), True)
            elif not wedged:
                ready = await self._ready(slot)
        obs = GroupObservation(slot.config.stages, slot.observe(ready, wedged))
        now = time.monotonic()
        d = decide(slot.record, obs, self.policy(slot), now)
        slot.record = d.record
        if d.action is Action.START:
            slot.start()
            log.info(
                "%s: starting %d stages (gRPC %s, generation %d)",
                slot.name,
                slot.config.stages,
                slot.grpc_target,
                slot.generation,
            )
        elif d.action in (Action.RESTART, Action.ROLL):  # ROLL: never here (local stages are never outdated)
            await self._stop_failed(slot, d.reason, d.delay_s, restart_cause(obs, phase))
        elif d.action is Action.FAIL:
            self.on_down(slot.name, d.reason)
            where = _where_its_output_is(slot)
            await asyncio.to_thread(slot.kill, self.config.kill_grace_s)
            self.fatal = f"{slot.name}: {d.reason} ({where})"
            self.failed.set()
        elif d.phase is not phase:
            if d.phase is GroupPhase.READY:
                self.group_ready.labels(slot.name).set(1)
                log.info("%s: ready after %.1fs", slot.name, now - slot.started_at)
            elif phase is GroupPhase.READY:
                self.group_ready.labels(slot.name).set(0)
                self.on_down(slot.name, d.reason)
                log.warning("%s: %s", slot.name, d.reason)

    async def _probe(self, slot: GroupSlot) -> dict[int, str]:
        """rank -> why it is wedged (or stopped answering); empty when every stage is alive."""
        c = self.config
        limit = slot.serve.wedge_timeout_s + slot.serve.wedge_grace_s + c.unanswered_margin_s
        for rank in range(slot.config.stages):
            try:
                r = await self._client.get(slot.health_url(rank) + "/livez")
            except httpx.HTTPError:
                starting = slot.record.phase is GroupPhase.STARTING
                if starting and time.monotonic() - slot.started_at < c.start_grace_s:
                    continue  # the side port opens a moment after the process starts
                slot.probe_failures[rank] = slot.probe_failures.get(rank, 0) + 1
                if slot.probe_failures[rank] * (c.interval_s + c.probe_timeout_s) > limit:
                    return {rank: f"{UNANSWERED} for {limit:.0f}s"}
                continue
            slot.probe_failures[rank] = 0
            if r.status_code == 503:
                return {rank: r.json().get("report", "")[:300]}
        return {}

    async def _ready(self, slot: GroupSlot) -> dict[int, bool]:
        ready: dict[int, bool] = {}
        for rank in range(slot.config.stages):
            try:
                r = await self._client.get(slot.health_url(rank) + "/readyz")
            except httpx.HTTPError:
                return ready
            ready[rank] = r.status_code == 200
            if not ready[rank]:
                return ready
        return ready

    async def _stop_failed(self, slot: GroupSlot, cause: str, delay_s: float, kind: str) -> None:
        self.on_down(slot.name, cause)
        self.group_ready.labels(slot.name).set(0)
        codes = await asyncio.to_thread(slot.kill, self.config.kill_grace_s)
        self.restarts.labels(slot.name, kind).inc()
        log.error(
            "GROUP RESTART: %s: %s; stopped stages %s; restarting in %.1fs (restart %d)",
            slot.name,
            cause,
            codes,
            delay_s,
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
