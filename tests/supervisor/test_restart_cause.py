"""`restart_cause`: the `cause` label of pipeserve:group_restarts_total, from what the supervisor saw
(the same observation `decide` restarted the group for)."""

from __future__ import annotations

import pytest

from pipeserve.care.restarts import GroupObservation, GroupPhase, StageObservation, StageState
from pipeserve.errors import ExitCode
from pipeserve.supervisor.supervisor import RESTART_CAUSES, UNANSWERED, restart_cause

RUNNING = StageObservation(rank=0, generation=1)


def _exited(rank: int, code: int | None) -> StageObservation:
    return StageObservation(rank=rank, generation=1, state=StageState.EXITED, exit_code=code)


@pytest.mark.parametrize(
    ("stages", "phase", "cause"),
    [
        ((RUNNING, _exited(1, ExitCode.GROUP_STOP)), GroupPhase.READY, "group_stop"),
        ((RUNNING, _exited(1, ExitCode.WEDGED)), GroupPhase.READY, "wedged"),
        ((RUNNING, _exited(1, ExitCode.INTERNAL_ERROR)), GroupPhase.READY, "internal_error"),
        ((_exited(0, ExitCode.CANNOT_START),), GroupPhase.STARTING, "cannot_start"),
        ((RUNNING, _exited(1, -9)), GroupPhase.READY, "killed"),
        ((RUNNING, _exited(1, 0)), GroupPhase.READY, "exited"),
        ((RUNNING, _exited(1, None)), GroupPhase.READY, "exited"),
        # The lowest rank decides, as in decide(): stage 0 stopped the group after stage 1 was killed.
        ((_exited(1, -9), _exited(0, ExitCode.GROUP_STOP)), GroupPhase.READY, "group_stop"),
        # A divergence names the cause at any rank: the lower ranks only followed the detector's stop.
        ((_exited(0, ExitCode.GROUP_STOP), _exited(2, ExitCode.DIVERGED)), GroupPhase.READY, "diverged"),
        ((RUNNING, _exited(1, ExitCode.DIVERGED)), GroupPhase.READY, "diverged"),
        (
            (StageObservation(rank=0, generation=1, wedged="stage 0: no progress"),),
            GroupPhase.READY,
            "wedged",
        ),
        (
            (StageObservation(rank=1, generation=1, wedged=f"{UNANSWERED} for 9s"),),
            GroupPhase.READY,
            "unresponsive",
        ),
        ((RUNNING,), GroupPhase.STARTING, "startup_deadline"),
        ((), GroupPhase.READY, "exited"),
    ],
)
def test_restart_cause(stages: tuple[StageObservation, ...], phase: GroupPhase, cause: str) -> None:
    assert cause in RESTART_CAUSES
    assert restart_cause(GroupObservation(2, stages), phase) == cause
