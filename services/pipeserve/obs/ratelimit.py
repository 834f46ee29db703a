"""RateLimitedLog: a repeated log line at most once per interval per key, with a roll-up of the rest.

    self.rlog = RateLimitedLog(log, interval_s=60.0)
    self.rlog.warning(("probe", group), "health probe of group %s failed: %s", group, why)

The first line of a key goes through at once. Lines of the same key within `interval_s` of the
last one let through are suppressed (counted, never formatted: a suppressed call costs a dict
look-up). The next line let through after the interval carries the count:

    health probe of group g0 failed: ... (37 more suppressed in 60 s)

`flush()` (e.g. at shutdown) writes one roll-up line per key that still has suppressed lines, so
no count is lost. Keys must come from a small set (a group, a cause, a status code), never from
request ids: at most `max_keys` are remembered, the least recently let through forgotten first.
Thread-safe (one lock; the log call itself is made outside it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass


@dataclass
class _KeyState:
    last_emit: float  # clock time the last line of this key was let through
    suppressed: int = 0
    level: int = logging.INFO


class RateLimitedLog:
    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        max_keys: int = 1024,
    ) -> None:
        if interval_s < 0:
            raise ValueError(f"interval_s must be >= 0, got {interval_s}")
        self.logger = logger
        self.interval_s = interval_s
        self.clock = clock
        self.max_keys = max_keys
        self._keys: OrderedDict[Hashable, _KeyState] = OrderedDict()
        self._lock = threading.Lock()

    def log(self, level: int, key: Hashable, msg: str, *args: object, **kwargs: object) -> bool:
        """Log `msg % args` unless a line of `key` went through less than interval_s ago; True if
        it was let through. A line below the logger's level is neither logged nor counted."""
        if not self.logger.isEnabledFor(level):
            return False
        now = self.clock()
        with self._lock:
            state = self._keys.get(key)
            if state is not None and now - state.last_emit < self.interval_s:
                state.suppressed += 1
                state.level = max(state.level, level)
                return False
            suppressed, since = (state.suppressed, now - state.last_emit) if state else (0, 0.0)
            self._keys[key] = _KeyState(now, 0, level)
            self._keys.move_to_end(key)
            while len(self._keys) > self.max_keys:
                self._keys.popitem(last=False)
        if suppressed:
            msg = msg + " (%d more suppressed in %.0f s)"
            args = (*args, suppressed, since)
        kwargs.setdefault("stacklevel", 2)  # the record names the caller, not this helper
        self.logger.log(level, msg, *args, **kwargs)  # type: ignore[arg-type]
        return True

    def debug(self, key: Hashable, msg: str, *args: object, **kwargs: object) -> bool:
        kwargs.setdefault("stacklevel", 3)
        return self.log(logging.DEBUG, key, msg, *args, **kwargs)

    def info(self, key: Hashable, msg: str, *args: object, **kwargs: object) -> bool:
        kwargs.setdefault("stacklevel", 3)
        return self.log(logging.INFO, key, msg, *args, **kwargs)

    def warning(self, key: Hashable, msg: str, *args: object, **kwargs: object) -> bool:
        kwargs.setdefault("stacklevel", 3)
        return self.log(logging.WARNING, key, msg, *args, **kwargs)

    def suppressed(self, key: Hashable) -> int:
        """Lines of `key` suppressed since its last line let through."""
        with self._lock:
            state = self._keys.get(key)
            return state.suppressed if state else 0

    def flush(self) -> int:
        """One roll-up line per key with suppressed lines ("<key>: N more suppressed in S s"); the
        counts restart. Returns how many lines were suppressed in all."""
        now = self.clock()
        with self._lock:
            pending = [
                (k, s.suppressed, now - s.last_emit, s.level) for k, s in self._keys.items() if s.suppressed
            ]
            for k, *_ in pending:
                self._keys[k] = _KeyState(now, 0, logging.INFO)
        for key, n, since, level in pending:
            self.logger.log(level, "%s: %d more suppressed in %.0f s", key, n, since)
        return sum(n for _, n, _, _ in pending)
