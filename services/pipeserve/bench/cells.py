"""The cells of a side-by-side sweep: prompt length × concurrency × output length.

  full     prompts {32, 128, 512, 2048} × concurrency {1, 4, 16, 64} × output {64, 256}: 32 cells,
           what benchmarks/RESULTS.md cites;
  reduced  prompts {128, 512} × concurrency {1, 16} × output {64}: 4 cells, routine checks;
  custom   the one cell `--input-len`, `--concurrency`, `--output-len` name.

A cell's pass sends `num_requests` = max(8, 2 × C) requests, at most `cap` (default 128): enough that
a pass at concurrency C runs at C for most of its length (two waves), few enough that a reduced sweep
takes minutes. `select` keeps the cells whose key (`p128-c16-o64`) matches one of a comma-separated
list of shell patterns (`p128-*,*-c1-*`).
"""

from __future__ import annotations

import fnmatch
import itertools
from dataclasses import dataclass

GRIDS: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = {
    # (prompt lengths, concurrencies, output lengths)
    "full": ((32, 128, 512, 2048), (1, 4, 16, 64), (64, 256)),
    "reduced": ((128, 512), (1, 16), (64,)),
}
MIN_REQUESTS = 8
DEFAULT_CAP = 128


@dataclass(frozen=True)
class Cell:
    prompt_len: int
    concurrency: int
    output_len: int

    @property
    def key(self) -> str:
        return f"p{self.prompt_len}-c{self.concurrency}-o{self.output_len}"

    def num_requests(self, cap: int = DEFAULT_CAP, override: int | None = None) -> int:
        if override is not None:
            return override
        return min(cap, max(MIN_REQUESTS, 2 * self.concurrency))

    @property
    def context(self) -> int:
        """Tokens one request holds at its end: prompt and output."""
        return self.prompt_len + self.output_len


def grid(name: str, custom: Cell | None = None) -> list[Cell]:
    """The sweep's cells, by output length, then prompt length, then concurrency."""
    if name == "custom":
        if custom is None:
            raise ValueError("the custom sweep needs its cell")
        return [custom]
    if name not in GRIDS:
        raise ValueError(f"unknown sweep {name!r}: one of custom, {', '.join(GRIDS)}")
    prompts, concs, outs = GRIDS[name]
    return [Cell(p, c, o) for o, p, c in itertools.product(outs, prompts, concs)]


def select(cells: list[Cell], patterns: str | None) -> list[Cell]:
    """The cells whose key matches one of the comma-separated shell patterns (all when None)."""
    if not patterns:
        return cells
    pats = [p.strip() for p in patterns.split(",") if p.strip()]
    kept = [c for c in cells if any(fnmatch.fnmatchcase(c.key, p) for p in pats)]
    if not kept:
        raise ValueError(f"--cells {patterns!r} matches none of {', '.join(c.key for c in cells)}")
    return kept
