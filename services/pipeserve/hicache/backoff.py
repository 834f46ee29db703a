"""Backoff: how HiCache leaves a failing Redis alone (the directory's probes and loads, each writer).

After a failure, callers skip the call for a delay that starts at `base_s` and doubles with each
failure that follows the end of a wait, up to `max_s`; one success restores the base. A failure
reported while a wait is still running (an operation begun before it) is the same failure told
again: it neither doubles nor extends the wait. `failed` and `succeeded` say whether the state
changed, so a caller logs one line per change, never one per call.
"""

from __future__ import annotations

import time


class Backoff:
    def __init__(self, base_s: float, max_s: float) -> None:
        self.base_s = base_s
        self.max_s = max_s
        self.down = False  # the last outcome was a failure
        self.delay_s = base_s  # the next wait
        self._until = 0.0  # monotonic: calls are skipped until then while down

    def waiting(self, now: float | None = None) -> bool:
        """True while calls are to be skipped."""
        return self.down and (time.monotonic() if now is None else now) < self._until

    def failed(self, now: float | None = None) -> bool:
        """A failure: wait (a longer wait after each one in a row). True if it was up until now."""
        now = time.monotonic() if now is None else now
        if self.waiting(now):
            return False
        changed = not self.down
        self.down = True
        self._until = now + self.delay_s
        self.delay_s = min(2 * self.delay_s, self.max_s)
        return changed

    def succeeded(self) -> bool:
        """A success: no wait, the base delay again. True if it was down until now."""
        changed = self.down
        self.down, self.delay_s = False, self.base_s
        return changed
