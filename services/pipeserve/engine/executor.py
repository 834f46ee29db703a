"""Executor: how stage 0's engine gets plans executed.

Contract (both implementations):
  can_submit()   True while fewer than `max_inflight` plans await results
  submit(plan)   run stage 0's part of the plan and pass it on; never waits
                 for a result (ordering rule 3: send what is owed first)
  collect()      the StepOutput of the oldest submitted plan, in submit order;
                 blocks only here, within a deadline; raises GroupStopped
  lock           held by the engine around one step, so a background
                 heartbeat never interleaves with a step
  stop_group(r)  stage 0 found a divergence: stop every executor, raise GroupStopped
  close()        stop the executors (clean shutdown); idempotent

LocalExecutor runs the whole model in-process (one stage, one plan at a
time); ring/leader.py's PipelineExecutor drives a ring of stage processes.
The engine knows only this Protocol: stage/factory.py builds the executor
and hands it in, so engine/ imports nothing from stage/.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import NoReturn, Protocol

from pipeserve.engine.model_runner import ModelRunner
from pipeserve.engine.plan import StepOutput, StepPlan
from pipeserve.errors import GroupStopped


class Executor(Protocol):
    max_inflight: int
    lock: threading.RLock

    def can_submit(self) -> bool: ...
    def submit(self, plan: StepPlan) -> None: ...
    def collect(self) -> StepOutput: ...
    @property
    def num_inflight(self) -> int: ...
    def stop_group(self, reason: str) -> NoReturn: ...
    def close(self) -> None: ...


class LocalExecutor:
    max_inflight = 1

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.lock = threading.RLock()
        self._done: deque[StepOutput] = deque()

    def can_submit(self) -> bool:
        return not self._done

    def submit(self, plan: StepPlan) -> None:
        self._done.append(self.runner.execute(plan))

    def collect(self) -> StepOutput:
        return self._done.popleft()

    @property
    def num_inflight(self) -> int:
        return len(self._done)

    def stop_group(self, reason: str) -> NoReturn:
        raise GroupStopped(reason)

    def close(self) -> None:
        pass
