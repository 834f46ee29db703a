"""A sweep's ratios self ÷ peer as one PNG: a panel per figure, a bar per cell, misses in red.

Bars are the ratios of medians, grown from parity on a log scale (0.5× and 2× equally far from
1.0×); the whisker spans the per-round ratios. Drawn with matplotlib's Agg canvas (no display, no pyplot
state), like bench/plot.py, and needing matplotlib (the `plot` extra) only when called.
"""

from __future__ import annotations

import math
from pathlib import Path

from pipeserve.bench import plot
from pipeserve.bench.sweep_report import FIGURES

MISS, MET = "#c0392b", "#2e8b57"
TICKS = (0.1, 0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0, 10.0)


def write_ratio_plot(agg: dict, path: str | Path, title: str) -> Path:
    plot.require()
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    keys = list(agg["cells"])
    panels = [f for f in FIGURES if any(agg["cells"][k][f[0]]["ratio"] is not None for k in keys)]
    cols = 2
    rows = max(1, math.ceil(len(panels) / cols))
    width = max(10.0, 0.45 * len(keys) * cols)
    fig = Figure(figsize=(width, 3.2 * rows + 0.8), dpi=100, layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, (fig_key, label, higher, _) in zip(axes, panels, strict=False):
        xs, ys, colors, lo, hi = [], [], [], [], []
        for i, k in enumerate(keys):
            c = agg["cells"][k][fig_key]
            if c["ratio"] is None or agg["cells"][k]["failed"]:
                continue
            xs.append(i)
            ys.append(c["ratio"])
            colors.append(MISS if c["miss"] else MET)
            rs = c["ratio_spread"] or {"min": c["ratio"], "max": c["ratio"]}
            lo.append(rs["min"])
            hi.append(rs["max"])
        # Bars grow from parity, up or down; a dot marks each ratio (a bar of 1.0× has no height).
        ax.bar(xs, [y - 1.0 for y in ys], bottom=1.0, color=colors, width=0.7)
        ax.vlines(xs, lo, hi, color="black", linewidth=1)
        ax.scatter(xs, ys, color=colors, edgecolors="black", zorder=3, s=14)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_yscale("log")
        reach = max([1.25, *(max(v, 1 / v) for v in [*lo, *hi, *ys] if v > 0)]) * 1.1
        ax.set_ylim(1 / reach, reach)
        ax.yaxis.set_major_locator(FixedLocator([t for t in TICKS if 1 / reach <= t <= reach]))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}×"))
        ax.yaxis.set_minor_locator(NullLocator())
        for x, y in zip(xs, ys, strict=True):
            ax.annotate(f"{y:.2f}", (x, y), textcoords="offset points", xytext=(0, 4 if y >= 1 else -10),
                        ha="center", fontsize=7)  # fmt: skip
        ax.set_title(f"{label}: self ÷ peer ({'higher' if higher else 'lower'} is better)")
        ax.set_xticks(range(len(keys)), keys, rotation=60, ha="right", fontsize=7)
        ax.set_xlim(-0.6, len(keys) - 0.4)
        ax.grid(True, axis="y", alpha=0.3)
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(title)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return out
