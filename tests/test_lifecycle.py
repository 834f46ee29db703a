"""One lifecycle vocabulary: the side port, stage 0's engine loop and the router's view use `ProcessPhase`."""

from __future__ import annotations

import pytest

from pipeserve.care.health import StageStatus
from pipeserve.config import SupervisorConfig
from pipeserve.errors import ConfigError
from pipeserve.lifecycle import ProcessPhase


def test_phase_reads_status_lines() -> None:
    assert ProcessPhase.of_status("ready") is ProcessPhase.READY
    assert ProcessPhase.of_status("stopped: stage 1: deadline: no frame from stage 0") is ProcessPhase.STOPPED
    assert ProcessPhase.of_status("draining") is ProcessPhase.DRAINING
    assert ProcessPhase.of_status("unreachable: UNAVAILABLE") is None
    assert f"{ProcessPhase.JOINING}" == "joining"  # serialized as the words /readyz always answered


def test_ready_only_in_the_ready_phase_and_while_serving() -> None:
    status = StageStatus(0, 2)
    serving = {"on": True}
    status.serving = lambda: serving["on"]
    assert [p for p in ProcessPhase if (setattr(status, "phase", p), status.ready)[1]] == [ProcessPhase.READY]
    status.phase = ProcessPhase.READY
    serving["on"] = False  # a group stop: not ready at once
    assert not status.ready


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ({"interval_s": 0}, "interval_s"),
        ({"backoff_s": 5, "backoff_max_s": 1}, "backoff_max_s"),
        ({"unanswered_margin_s": -1}, "unanswered_margin_s"),
    ],
)
def test_supervisor_timings_are_validated(bad: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        SupervisorConfig(**bad)
