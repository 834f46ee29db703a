"""Progress of a long start-up task (reading weights, zeroing the KV pool) that people can see.

    with Progress("stage 0: loading weights", total_bytes, log) as p:
        for ...: p.update(nbytes)

On a terminal (stderr is a TTY) a tqdm bar on stderr, removed when done; otherwise log lines, at
most one per `interval_s` (the first after interval_s: a task shorter than that logs nothing),
and a closing "done" line only when a progress line was written. `update` costs an addition and
a clock read (tqdm's own update is throttled the same way), so it may be called per tensor
without slowing the load measurably; it never formats anything it is handed.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from types import TracebackType
from typing import IO, Any, Self


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class Progress:
    def __init__(
        self,
        desc: str,
        total: int,
        logger: logging.Logger,
        *,
        interval_s: float = 2.0,
        stream: IO[str] | None = None,
        tty: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`total` in bytes. `tty` None: a bar iff `stream` (default stderr) is a terminal."""
        self.desc = desc
        self.total = max(0, int(total))
        self.done = 0
        self.logger = logger
        self.interval_s = interval_s
        self.clock = clock
        self.lines = 0  # progress lines logged (not counting the closing one)
        stream = stream if stream is not None else sys.stderr
        if tty is None:
            tty = bool(getattr(stream, "isatty", lambda: False)())
        self._bar: Any = None
        if tty:
            from tqdm import tqdm  # type: ignore[import-untyped]  # no stubs shipped

            self._bar = tqdm(
                total=self.total,
                desc=desc,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                file=stream,
                leave=False,
                dynamic_ncols=True,
            )
        self._start = clock()
        self._next = self._start + interval_s

    def update(self, n: int) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
            return
        now = self.clock()
        if now < self._next:
            return
        self._next = now + self.interval_s
        self.lines += 1
        self.logger.info(
            "%s: %s of %s (%d%%)",
            self.desc,
            human_bytes(self.done),
            human_bytes(self.total),
            100 * self.done // max(1, self.total),
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self.lines:
            self.logger.info(
                "%s: done, %s in %.1f s", self.desc, human_bytes(self.done), self.clock() - self._start
            )
            self.lines = 0

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
