"""Follower: the loop of stage k > 0. It executes plans or stops the group; it decides nothing.

For each frame from stage k-1, in arrival order:
  Hello      forward it (with a one-row activation: warms the data link)
  Heartbeat  forward it
  Forward    check the step id increases, run this stage's layers on the
             activations (the runner validates the plan: digest, request ids,
             block ids, positions, row count), append this stage's report;
             pass Forward + activations on, or — on the last stage — sample
             and send Result(step output with every stage's report) to stage 0
  Stop       pass it on and exit: 0 for a clean shutdown, 3 for a group stop

Any mismatch or link failure is a group stop: one log line naming it, a
Stop(error) sent on to the next stage, exit status 3 (an unexpected exception:
the same Stop, its traceback, exit status 1). Nothing is repaired locally
(DESIGN.md section 2). A failure of one request (its sampling on the last
stage) is not a stop: the runner reports it and stage 0 fails the request.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from pipeserve.engine.executor import PlanMismatch
from pipeserve.engine.plan import StepOutput
from pipeserve.errors import ExitCode, GroupStopped
from pipeserve.obs import tracing
from pipeserve.ring.leader import warm_activation
from pipeserve.ring.member import RingStage
from pipeserve.ring.messages import Forward, Heartbeat, Hello, Result, Stop
from pipeserve.ring.plan_trace import PlanTraces
from pipeserve.ring.replay import activation_digest, recorder_for
from pipeserve.ring.transport import RingLink

log = logging.getLogger(__name__)


class Follower:
    def __init__(self, stage: RingStage) -> None:
        if stage.link is None or stage.spec.rank == 0:
            raise ValueError("a follower is a stage k > 0 of a ring")
        self.stage = stage
        self.rank = stage.spec.rank
        self.link: RingLink = stage.link
        self.runner = stage.runner
        self.faults = stage.faults
        self.is_last = stage.spec.is_last
        self.last_step = 0
        self.in_step = False
        self.ready = False
        self.on_frame: Callable[[], None] = lambda: None  # forward progress (the wedge detector's beat)
        self.on_ready: Callable[[], None] = lambda: None  # the ring is formed and warm
        # Spans for sampled requests' plans (ring/plan_trace.py): only when this process traces.
        self.traces = PlanTraces(self.rank) if tracing.enabled() else None
        self.flight = recorder_for(stage)  # the plans this stage executed (obs/flight.py)

    def pending_work(self) -> str | None:
        """What this stage owes, for the wedge detector; None when idle."""
        backlog = self.link.backlog
        if not backlog and not self.in_step:
            return None
        return (
            f"stage {self.rank}: {backlog} frames queued, in a step: {self.in_step} "
            f"(last step {self.last_step})"
        )

    def run(self) -> int:
        """Serve frames until a Stop; returns the process exit status."""
        self.link.start()
        try:
            while True:
                frame, acts = self.link.recv()
                self.on_frame()
                if isinstance(frame, Forward | Heartbeat) and not self.ready:
                    # Stage 0 sends these only after the Hello came back: the whole ring is formed.
                    self.ready = True
                    self.on_ready()
                if isinstance(frame, Forward):
                    self.in_step = True
                    self._step(frame, acts)
                    self.in_step = False
                    self.on_frame()
                elif isinstance(frame, Hello):
                    self.link.send(Hello([*frame.visited, self.rank]), warm_activation(self.stage))
                    log.info("stage %d: ring link warm, serving", self.rank)
                elif isinstance(frame, Heartbeat):
                    self.link.send(frame)
                elif isinstance(frame, Stop):
                    return self._stop(frame)
                else:
                    raise PlanMismatch(f"stage {self.rank}: unexpected {type(frame).__name__} frame")
        except GroupStopped as e:
            return self._group_stop(str(e))
        except PlanMismatch as e:
            self._group_stop(f"stage {self.rank}: {e}")
            return ExitCode.DIVERGED
        except Exception as e:  # a bug, not a request's fault (those are in reports): stop the group, loudly
            log.exception("stage %d: unexpected error", self.rank)
            self._group_stop(f"stage {self.rank}: unexpected {type(e).__name__}: {e}")
            return ExitCode.INTERNAL_ERROR

    def _step(self, fwd: Forward, acts) -> None:
        plan = fwd.plan
        if plan.step_id <= self.last_step:
            raise PlanMismatch(f"stage {self.rank}: step {plan.step_id} arrived after step {self.last_step}")
        self.last_step = plan.step_id
        flight = self.flight.record(plan.step_id, self.link.last_payload)  # before a mismatch can raise
        if plan.chunks and acts is None:
            raise PlanMismatch(f"stage {self.rank}: step {plan.step_id} has tokens but no activations")
        traced = self.traces.before(plan) if self.traces is not None else None
        hidden, sampled, report = self.runner.run(plan, acts)
        if traced is not None and self.traces is not None:
            self.traces.after(plan, traced)
        if self.faults.corrupts(self.rank, plan):
            report = self.faults.corrupt_report(report)
        reports = [*fwd.reports, report]
        if self.is_last:
            self.flight.complete(
                flight,
                self.link.send(Result(StepOutput(plan.step_id, sampled, reports, self.runner.prompt_scores))),
            )
            return
        produced = activation_digest(hidden) if self.flight.enabled else None
        sent, hidden = self.faults.outgoing(self.rank, plan, hidden, self.runner.num_blocks)
        self.flight.complete(flight, self.link.send(Forward(sent, reports), hidden), produced)

    def _stop(self, stop: Stop) -> int:
        try:  # the last stage passes it back to stage 0, which waits for it on shutdown
            self.link.send(stop)
            self.link.flush()
        except GroupStopped as e:  # expected in a group stop: the next stage may be gone already
            (log.info if stop.error else log.warning)(
                "stage %d: could not pass the stop on: %s", self.rank, e
            )
        if stop.error:
            log.error("stage %d: GROUP STOP from stage %d: %s", self.rank, stop.origin, stop.reason)
            self.flight.dump(f"group stop from stage {stop.origin}: {stop.reason}")
            return ExitCode.GROUP_STOP
        log.info("stage %d: shutdown", self.rank)
        return 0

    def _group_stop(self, reason: str) -> int:
        log.error("GROUP STOP: %s", reason)
        try:
            self.link.send(Stop(self.rank, reason, True))
            self.link.flush()
        except GroupStopped:
            pass  # the next stage is gone or stuck; its own deadline stops it
        self.flight.dump(f"group stop: {reason}")
        return ExitCode.GROUP_STOP
