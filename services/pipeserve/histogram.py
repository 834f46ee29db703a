"""Histogram: a cumulative latency histogram owned by the code that measures (read at scrape time).

Buckets span 1 ms to 10 s: HiCache loads of a few pages to prefixes of
thousands of tokens. `observe` is called on one thread; a scrape on another
thread reads a slightly stale but well-formed copy (`snapshot`).
"""

from __future__ import annotations

import bisect

BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...] = BUCKETS_S) -> None:
        self.buckets = buckets
        self._counts = [0] * (len(buckets) + 1)  # the last one: above every bucket (+Inf)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def snapshot(self) -> tuple[list[tuple[str, float]], float]:
        """([(upper bound, cumulative count)] ending with +Inf, sum): Prometheus' histogram form."""
        out, total = [], 0
        for bound, n in zip((*self.buckets, float("inf")), list(self._counts), strict=True):
            total += n
            out.append(("+Inf" if bound == float("inf") else repr(bound), float(total)))
        return out, self.sum
