"""`pipeserve bench --plot FILE.png`: TTFT and ITL CDFs and output throughput over time, one figure.

matplotlib is the `plot` extra (`pip install 'pipeserve[plot]'`): it is imported only here, only
when --plot is given, and drawn on the Agg canvas (no display, no pyplot global state). `require()`
is called before the benchmark runs, so a missing matplotlib is said at once, not after the run.

Throughput over time: each successful request's token-bearing chunks arrive at
start + TTFT + cumsum(ITL); its output tokens are spread evenly over those chunks (a chunk may
carry several) and counted in 1-second bins (wider for long runs: at most ~200 bins).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from pipeserve.bench.metrics import RequestResult

MAX_BINS = 200


def require() -> None:
    """Raise ValueError naming the extra when matplotlib is not installed."""
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot needs matplotlib, the `plot` extra: pip install 'pipeserve[plot]'")


def token_times(results: Sequence[RequestResult]) -> tuple[np.ndarray, np.ndarray]:
    """(seconds since the first request was sent, output tokens) per token-bearing chunk."""
    ok = [r for r in results if r.success]
    if not ok:
        return np.zeros(0), np.zeros(0)
    t0 = min(r.start for r in ok)
    times: list[np.ndarray] = []
    weights: list[np.ndarray] = []
    for r in ok:
        t = r.start - t0 + r.ttft + np.concatenate([[0.0], np.cumsum(r.itl)])
        times.append(t)
        weights.append(np.full(len(t), r.output_len / len(t)))
    return np.concatenate(times), np.concatenate(weights)


def throughput_series(results: Sequence[RequestResult]) -> tuple[np.ndarray, np.ndarray]:
    """(bin start in s, output tokens/s in that bin)."""
    t, w = token_times(results)
    if not len(t):
        return np.zeros(0), np.zeros(0)
    end = float(t.max())
    width = max(1.0, end / MAX_BINS)
    edges = np.arange(0.0, end + width, width)
    if len(edges) < 2:
        edges = np.array([0.0, width])
    counts, _ = np.histogram(t, bins=edges, weights=w)
    return edges[:-1], counts / width


def _cdf(ax, values_ms: Sequence[float], title: str) -> None:
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of samples")
    ax.grid(True, alpha=0.3)
    if len(values_ms) == 0:
        ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
        return
    v = np.sort(np.asarray(values_ms, dtype=np.float64))
    ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post")
    for p in (50, 90, 99):
        ax.axvline(float(np.percentile(v, p)), linestyle=":", linewidth=0.8, color="gray")


def write_plot(results: Sequence[RequestResult], path: str | Path, title: str = "") -> Path:
    """Draw the figure into `path` (PNG by its suffix); returns the path."""
    require()
    from matplotlib.figure import Figure

    ok = [r for r in results if r.success]
    fig = Figure(figsize=(15, 4.5), dpi=100, layout="constrained")
    ax_ttft, ax_itl, ax_tp = fig.subplots(1, 3)
    _cdf(ax_ttft, [r.ttft * 1000 for r in ok], "TTFT CDF")
    _cdf(ax_itl, [gap * 1000 for r in ok for gap in r.itl], "ITL CDF")
    x, y = throughput_series(ok)
    ax_tp.set_title("output throughput over time")
    ax_tp.set_xlabel("s since the first request")
    ax_tp.set_ylabel("tokens/s")
    ax_tp.grid(True, alpha=0.3)
    if len(x):
        ax_tp.step(x, y, where="post")
    if title:
        fig.suptitle(title)
    out = Path(path)
    fig.savefig(out)
    return out
