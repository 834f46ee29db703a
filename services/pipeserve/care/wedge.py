"""WedgeDetector: "work pending and no forward progress" in a stage, whatever the cause.

The stage says what progress is (`beat()`: a step finished, a frame was
handled) and what pending work is (`pending()`: a description of queued or
running work, or None when idle). A thread checks both; when work has been
pending for `timeout_s` with no beat, it writes ONE report — the pending
work and every thread's stack — marks the stage wedged (`/livez` goes red),
and after `grace_s` ends the process with ExitCode.WEDGED. The supervisor (or
Kubernetes' liveness probe) then restarts the whole group.

Idle is never a wedge: while nothing is pending the clock is reset, so the
timeout counts from the moment work arrived or last moved. The detector
does not look at any one cause (a ring deadlock at 0 % utilisation, a stuck
send, a hung kernel all look the same from here), and it never touches the
ring: a wedged stage is left to be restarted, not repaired.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from pipeserve.errors import ExitCode
from pipeserve.obs.stacks import thread_stacks

log = logging.getLogger(__name__)


class WedgeDetector:
    def __init__(
        self,
        name: str,
        pending: Callable[[], str | None],
        timeout_s: float,
        grace_s: float,
        exit_fn: Callable[[int], None] = os._exit,
    ) -> None:
        self.name = name
        self.pending = pending
        self.timeout_s = timeout_s
        self.grace_s = grace_s
        self._exit = exit_fn
        # Called once on the detector's thread right after the report (the flight recorder's dump).
        self.on_wedge: Callable[[], object] = lambda: None
        self._last_progress = time.monotonic()
        self.report: str | None = None  # set once, when the wedge is declared
        self.wedged_at: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self) -> None:
        """Forward progress (a plain store: cheap enough for every step and frame)."""
        self._last_progress = time.monotonic()

    @property
    def wedged(self) -> bool:
        return self.report is not None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="wedge-detector", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        period = min(1.0, self.timeout_s / 4)
        while not self._stop.wait(period):
            if self.check(time.monotonic()):
                break
        if self.wedged and not self._stop.wait(self.grace_s):
            log.error("%s: exiting after a wedge (status %d)", self.name, ExitCode.WEDGED)
            logging.shutdown()
            self._exit(ExitCode.WEDGED)

    def check(self, now: float) -> bool:
        """One look; True once the stage is declared wedged."""
        what = self.pending()
        if what is None:
            self._last_progress = now  # idle: nothing is owed, the clock starts when work arrives
            return False
        stalled = now - self._last_progress
        if stalled < self.timeout_s:
            return False
        self.wedged_at = now
        self.report = f"{self.name}: no progress for {stalled:.1f}s with work pending: {what}"
        log.error("WEDGE: %s\n%s", self.report, thread_stacks())
        self.on_wedge()
        return True
