"""LocalExecutor: a one-stage group's executor, the whole model in this process (engine/executor.py
states the contract it implements).

submit() runs the plan on the stage's ModelRunner at once (the model, then sampling) and keeps
its StepOutput; collect() hands it back. One plan at a time: there is no ring to fill.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import NoReturn

from pipeserve.engine.executor import BusyMeter
from pipeserve.engine.plan import StepOutput, StepPlan
from pipeserve.errors import GroupStopped
from pipeserve.worker.model_runner import ModelRunner


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

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    @property
    def meter(self) -> BusyMeter:
        return self.runner.meter

    def close(self) -> None:
        if self.runner.tiers is not None:
            self.runner.tiers.close()
