"""Executor: the contract by which stage 0's engine gets plans executed (the engine knows only this).

Contract (every implementation):
  max_inflight   plans the executor takes before a result must be collected
  num_blocks     KV blocks in every stage's pool (the group's agreed count): the block manager's size
  meter          stage 0's BusyMeter; the engine measures its own scheduling into it too
  lock           held by the engine around one step, so a background heartbeat never
                 interleaves with a step
  can_submit()   True while fewer than `max_inflight` plans await results
  submit(plan)   run stage 0's part of the plan and pass it on; never waits
                 for a result (ordering rule 3: send what is owed first)
  collect()      the StepOutput of the oldest submitted plan, in submit order;
                 blocks only here, within a deadline; raises GroupStopped
  stop_group(r)  stage 0 found a divergence: stop every executor, raise GroupStopped
  close()        stop the executors and stage 0's HiCache tiers (clean shutdown); idempotent

Plans go in and StepOutputs come out, both typed in engine/plan.py. A plan that does not fit an
executing side's state raises PlanMismatch (on a follower, a group stop): the runner (worker/), the
HiCache tiers (hicache/) and the ring (ring/) all raise it, so it is declared here, with the one
check they share (`refuse_l2_moves`). The implementations
are on the executing side: worker/local.py's LocalExecutor runs the whole model in-process
(one stage, one plan at a time); ring/leader.py's PipelineExecutor drives a ring of stage
processes. stage/assemble.py builds one and hands it in: engine/ imports nothing from worker/,
ring/ or stage/ (tests/test_import_graph.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn, Protocol

from pipeserve.engine.plan import StepOutput, StepPlan


class Executor(Protocol):
    max_inflight: int
    lock: threading.RLock

    @property
    def num_blocks(self) -> int: ...
    @property
    def meter(self) -> BusyMeter: ...
    def can_submit(self) -> bool: ...
    def submit(self, plan: StepPlan) -> None: ...
    def collect(self) -> StepOutput: ...
    @property
    def num_inflight(self) -> int: ...
    def stop_group(self, reason: str) -> NoReturn: ...
    def close(self) -> None: ...


class PlanMismatch(RuntimeError):
    """The plan is inconsistent with this executor's state."""


def refuse_l2_moves(plan: StepPlan) -> None:
    """On a stage without an L2 pool, a plan that moves blocks through L2 is a divergence."""
    if plan.l2_saves or plan.l2_loads:
        raise PlanMismatch(f"step {plan.step_id}: moves blocks through L2, but this stage has no L2 pool")


class BusyMeter:
    """Seconds a stage spends working, against seconds since its first work.

    Nested measure() blocks count once (stage 0 measures scheduling around
    the runner's own measurement). `busy_s` includes the outermost block in
    progress: a report the runner takes inside stage 0's step then counts that
    step, not only the steps before it (the step pace divides a plan's busy
    seconds by that plan's cost, engine/fairness.py). Read from other threads
    (the metrics), so it is read and changed under a lock: a counter never goes back.
    """

    def __init__(self) -> None:
        self.started: float | None = None
        self._done_s = 0.0  # closed outermost blocks
        self._open_t0: float | None = None  # start of the outermost block in progress
        self._depth = 0
        self._lock = threading.Lock()

    @contextmanager
    def measure(self) -> Iterator[None]:
        with self._lock:
            if self._depth == 0:
                self._open_t0 = time.perf_counter()
                if self.started is None:
                    self.started = self._open_t0
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0 and self._open_t0 is not None:
                    self._done_s += time.perf_counter() - self._open_t0
                    self._open_t0 = None

    @property
    def busy_s(self) -> float:
        with self._lock:
            t0 = self._open_t0
            return self._done_s + (time.perf_counter() - t0 if t0 is not None else 0.0)

    @property
    def wall_s(self) -> float:
        return 0.0 if self.started is None else time.perf_counter() - self.started
