"""PipelineExecutor: stage 0's side of the ring (see engine/executor.py for the contract).

submit() runs stage 0's layers for a plan and posts Forward(plan, [report])
with the activations to stage 1; collect() waits for the Result of the oldest
plan from stage S-1. Results come back in plan order because every stage
handles frames in arrival order. The engine keeps at most max_inflight plans
in the ring and sends all it owes before collecting (transport rule 3).

Stage 0 also keeps an idle ring inside its deadlines: a keepalive thread
sends a Heartbeat round the ring when nothing has moved for heartbeat_s.
Any failure — a Stop from a follower, a broken link, an expired deadline —
makes the executor failed for good: the reason is kept, a Stop(error) is sent
to stage 1 so the rest of the group exits, and every later call raises
GroupStopped with that reason.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import NoReturn, TypeVar

import torch

from pipeserve.engine.executor import BusyMeter
from pipeserve.engine.plan import StepOutput, StepPlan
from pipeserve.errors import GroupStopped
from pipeserve.ring.member import RingStage
from pipeserve.ring.messages import Forward, Heartbeat, Hello, Result, Stop
from pipeserve.ring.replay import activation_digest, recorder_for
from pipeserve.ring.transport import RingLink

log = logging.getLogger(__name__)
T = TypeVar("T")


def warm_activation(stage: RingStage) -> torch.Tensor:
    """One row for the Hello frame: the first send on a data link may be a rendezvous (NCCL)."""
    cfg = stage.model_config
    return torch.zeros((1, cfg.hidden_size), dtype=cfg.dtype, device=stage.runner.device)


class PipelineExecutor:
    def __init__(self, stage: RingStage) -> None:
        if stage.link is None:
            raise ValueError("PipelineExecutor needs a ring link")
        self.stage = stage
        self.link: RingLink = stage.link
        self.runner = stage.runner
        self.faults = stage.faults
        self.max_inflight = stage.config.inflight
        self.heartbeat_s = stage.config.heartbeat_s
        self.lock = threading.RLock()
        self.failed: str | None = None
        self._inflight: deque[int] = deque()  # step ids awaiting their Result
        self._early: deque[StepOutput] = deque()  # results taken by the return_first fault
        self._last_activity = time.monotonic()
        self._heartbeats = 0
        self._closing = threading.Event()
        self._keepalive: threading.Thread | None = None
        self.flight = recorder_for(stage)  # plans as sent and their results (obs/flight.py)

    # --- start-up -------------------------------------------------------------
    def form_ring(self) -> None:
        """Send a Hello round the ring and wait for it (transport rule 5), then start heartbeats."""
        self.link.start()
        with self.lock:
            self._guard(lambda: self.link.send(Hello([0]), warm_activation(self.stage)))
            frame = self._guard(lambda: self.link.recv()[0])
            want = list(range(self.stage.config.stages))
            if not isinstance(frame, Hello) or frame.visited != want:
                self._fail(f"ring formation: expected Hello through {want}, got {frame!r}")
        log.info("ring formed: %d stages, max_inflight %d", len(want), self.max_inflight)
        if not self.faults.no_heartbeat:
            self._keepalive = threading.Thread(
                target=self._keepalive_loop, name="ring-keepalive", daemon=True
            )
            self._keepalive.start()

    # --- executor contract ----------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    @property
    def meter(self) -> BusyMeter:
        return self.runner.meter

    def can_submit(self) -> bool:
        return len(self._inflight) < self.max_inflight

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    def submit(self, plan: StepPlan) -> None:
        self._check()
        hidden, _, report = self.runner.run(plan)
        sent, acts = self.faults.outgoing(0, plan, hidden, self.runner.num_blocks)
        if self.faults.return_first:
            self._early.append(self._receive_result())  # the broken rule: wait before sending
        payload = self._guard(lambda: self.link.send(Forward(sent, [report]), acts))
        if self.flight.enabled:
            self.flight.record(plan.step_id, payload, plan.digest, activation_digest(hidden))
        self._inflight.append(plan.step_id)
        self._last_activity = time.monotonic()

    def collect(self) -> StepOutput:
        self._check()
        out = self._early.popleft() if self._early else self._receive_result()
        self._last_activity = time.monotonic()
        return out

    def _receive_result(self) -> StepOutput:
        frame = self._guard(lambda: self.link.recv()[0])
        if isinstance(frame, Stop):
            self._fail(frame.reason)
        if not isinstance(frame, Result):
            self._fail(f"stage 0: expected a Result on the return link, got {type(frame).__name__}")
        want = self._inflight.popleft() if self._inflight else None
        if frame.output.step_id != want:
            self._fail(f"stage 0: result of step {frame.output.step_id} arrived, expected step {want}")
        self.flight.complete(self.flight.find(frame.output.step_id), self.link.last_payload)
        return frame.output

    # --- idle ring ------------------------------------------------------------
    def _keepalive_loop(self) -> None:
        while not self._closing.wait(self.heartbeat_s / 2):
            with self.lock:
                idle = time.monotonic() - self._last_activity >= self.heartbeat_s
                if self.failed or self._closing.is_set() or self._inflight or not idle:
                    continue
                try:
                    self._heartbeat()
                except GroupStopped:
                    return  # recorded in self.failed; the next step raises it

    def _heartbeat(self) -> None:
        self._heartbeats += 1
        seq = self._heartbeats
        self._guard(lambda: self.link.send(Heartbeat(seq)))
        frame = self._guard(lambda: self.link.recv()[0])
        if isinstance(frame, Stop):
            self._fail(frame.reason)
        if frame != Heartbeat(seq):
            self._fail(f"stage 0: expected heartbeat {seq} back, got {frame!r}")
        self._last_activity = time.monotonic()

    # --- failure and shutdown -------------------------------------------------
    def _guard(self, fn: Callable[[], T]) -> T:
        """Run one link call; a failure stops the group (named by a follower's Stop if one came)."""
        self._check()
        try:
            return fn()
        except GroupStopped as e:
            stop = self.link.poll_stop(1.0)  # a follower's Stop names the cause better than a broken link
            self._fail(stop.reason if stop else str(e))
            raise  # unreachable: _fail raises

    def _check(self) -> None:
        if self.failed:
            raise GroupStopped(self.failed, logged=True)

    def stop_group(self, reason: str) -> NoReturn:
        """Stop the whole group (stage 0 found a divergence); raises GroupStopped."""
        self._fail(reason)

    def _fail(self, reason: str) -> NoReturn:
        if self.failed is None:
            self.failed = reason
            log.error("GROUP STOP: %s", reason)
            try:
                self.link.send(Stop(0, reason, True))
            except GroupStopped:
                pass  # stage 1 is already gone
            self.flight.dump(f"group stop: {reason}")
        raise GroupStopped(self.failed, logged=True)

    def close(self) -> None:
        """Clean shutdown: a Stop goes round the ring and comes back; results in flight are dropped.
        Stage 0's HiCache tiers close last (pages still queued for L3 get a bounded chance)."""
        try:
            self._close_ring()
        finally:
            if self.stage.tiers is not None:
                self.stage.tiers.close()

    def _close_ring(self) -> None:
        self._closing.set()
        if self._keepalive is not None:
            self._keepalive.join(timeout=self.heartbeat_s + 1)
        with self.lock:
            if self.failed:
                return
            try:
                self.link.send(Stop(0, "shutdown", False))
                while not isinstance(frame := self.link.recv()[0], Stop):
                    if not isinstance(frame, Result | Heartbeat):
                        break
                self.link.flush()
            except GroupStopped as e:
                log.warning("ring shutdown incomplete: %s", e)
            self.failed = "the group was shut down"
