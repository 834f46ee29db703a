"""The wedge detector: work pending and no progress ⇒ one report, /livez red, exit; idle never.

The first tests drive the real WedgeDetector thread with a recorded exit
function; the last ones freeze a live stage (SIGSTOP) and idle a live group.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest

from pipeline_support import pid_alive
from pipeserve.care.wedge import WedgeDetector
from pipeserve.errors import ExitCode
from serving_support import greedy_request, live_group, stub, wait_until


class _Work:
    def __init__(self) -> None:
        self.pending: str | None = None
        self.exits: list[int] = []

    def detector(self, timeout_s: float, grace_s: float) -> WedgeDetector:
        return WedgeDetector("stage 9", lambda: self.pending, timeout_s, grace_s, exit_fn=self.exits.append)


def test_pending_without_progress_is_one_report_then_exit(caplog: pytest.LogCaptureFixture) -> None:
    work = _Work()
    det = work.detector(timeout_s=0.4, grace_s=0.3)
    caplog.set_level(logging.ERROR, logger="pipeserve.care.wedge")
    det.start()
    work.pending = "3 plans in the ring"
    t0 = time.monotonic()
    wait_until(lambda: det.wedged, 3.0, "the wedge")
    assert 0.4 <= time.monotonic() - t0 < 1.5
    wait_until(lambda: work.exits, 2.0, "the exit")
    assert work.exits == [ExitCode.WEDGED]
    reports = [r for r in caplog.records if r.getMessage().startswith("WEDGE:")]
    assert len(reports) == 1
    text = reports[0].getMessage()
    assert "3 plans in the ring" in text and "--- thread MainThread" in text and "wedge-detector" in text


def test_progress_keeps_a_busy_stage_alive() -> None:
    work = _Work()
    det = work.detector(timeout_s=0.4, grace_s=0.1)
    det.start()
    work.pending = "decoding"
    for _ in range(30):  # 1.5 s of steady progress, well past the timeout
        det.beat()
        time.sleep(0.05)
    det.stop()
    assert not det.wedged and not work.exits


def test_idle_is_never_a_wedge_and_the_clock_starts_when_work_arrives() -> None:
    work = _Work()
    det = work.detector(timeout_s=0.4, grace_s=0.1)
    det.start()
    time.sleep(1.5)  # idle for several timeouts with no beat at all
    assert not det.wedged
    work.pending = "1 queued command"
    time.sleep(0.2)  # work is younger than the timeout: not a wedge yet
    assert not det.wedged
    wait_until(lambda: det.wedged, 2.0, "the wedge")
    det.stop()


def test_frozen_stage_is_caught_by_stage_0_which_goes_red_and_exits(llama_dir: Path, tmp_path: Path) -> None:
    with live_group(llama_dir, 2, tmp_path, wedge_timeout_s=3.0, wedge_grace_s=2.0) as slot:
        procs = slot.group.procs  # type: ignore[union-attr]
        s = stub(slot.grpc_target)
        result: dict = {}

        def long_request() -> None:
            try:
                for _ in s.Generate(greedy_request("long", [4, 5, 6], 1500, ignore_eos=True), timeout=60):
                    pass
                result["end"] = "finished"
            except grpc.RpcError as e:
                result["end"] = e.code()

        t = threading.Thread(target=long_request)
        t.start()
        time.sleep(1.0)
        procs[1].send_signal(signal.SIGSTOP)
        frozen_at = time.monotonic()
        try:
            livez = slot.health_url(0) + "/livez"
            wait_until(lambda: httpx.get(livez).status_code == 503, 10, "/livez 503", interval_s=0.1)
            body = httpx.get(slot.health_url(0) + "/livez").json()
            assert body["status"] == "wedged" and "plans in the ring" in body["report"]
            assert procs[0].wait(timeout=10) == ExitCode.WEDGED
            took = time.monotonic() - frozen_at
            assert took < 3.0 + 2.0 + 3.0, f"stage 0 exited {took:.1f}s after the freeze"
            t.join(10)
            assert result["end"] == grpc.StatusCode.UNAVAILABLE
            log = (tmp_path / "group-t-stage-0.log").read_text()
            assert log.count("WEDGE: stage 0") == 1 and "--- thread engine-loop" in log
        finally:
            procs[1].send_signal(signal.SIGCONT)


def test_an_idle_group_is_not_wedged_and_logs_nothing(llama_dir: Path, tmp_path: Path) -> None:
    with live_group(llama_dir, 2, tmp_path, wedge_timeout_s=1.0, wedge_grace_s=0.5) as slot:
        time.sleep(1.5)  # the first heartbeat has made stage 1 ready: start-up lines are done
        before = [(tmp_path / f"group-t-stage-{r}.log").read_text() for r in (0, 1)]
        time.sleep(4.0)  # four wedge timeouts of an idle ring (heartbeats only, ~80 idle engine passes)
        after = [(tmp_path / f"group-t-stage-{r}.log").read_text() for r in (0, 1)]
        assert after == before, "an idle group wrote log lines"
        for rank in (0, 1):
            assert httpx.get(slot.health_url(rank) + "/livez").json()["status"] == "ok"
        assert all(pid_alive(pid) for pid in slot.pids.values())
        logs = "".join((tmp_path / f"group-t-stage-{r}.log").read_text() for r in (0, 1))
        assert "WEDGE" not in logs
