"""Per-request measurements and the summary `pipeserve bench` reports.

The figures and their definitions follow SGLang's `bench_serving`:
  - TTFT: request sent -> first streamed chunk carrying a token (or text);
  - ITL: gaps between successive token-bearing chunks, pooled over all requests;
  - TPOT: (E2E - TTFT) / (output tokens - 1) per request with more than one output token;
  - E2E: request sent -> stream finished;
  - throughputs: totals over successful requests / benchmark duration;
  - concurrency: sum of successful requests' E2E / duration (mean requests in flight).
Percentiles use numpy's default linear interpolation, as SGLang does.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_len: int = 0  # generated tokens: the usage chunk's count, else token-bearing chunks
    ttft: float = 0.0  # seconds
    latency: float = 0.0  # seconds, end to end
    itl: list[float] = field(default_factory=list)  # seconds
    error: str = ""
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when sent
    cache_n: int | None = None  # llama.cpp's `timings.cache_n` (prompt tokens a slot reused), when sent
    token_ids: list[int] = field(default_factory=list)  # generated ids, when the server returns them
    start: float = 0.0  # time.perf_counter() when sent (plots over time: bench/plot.py)
    retried: bool = False  # sent twice: the first try hit a connection the server had closed


def stats_ms(values_s: list[float]) -> dict[str, float | None]:
    """mean / p50 / p90 / p99 in milliseconds; None when there is nothing to measure."""
    keys = ["mean", *(f"p{p}" for p in PERCENTILES)]
    if not values_s:
        return dict.fromkeys(keys)
    a = np.asarray(values_s, dtype=np.float64) * 1000.0
    out: dict[str, float | None] = {"mean": float(a.mean())}
    out.update({f"p{p}": float(np.percentile(a, p)) for p in PERCENTILES})
    return out


def summarize(results: list[RequestResult], duration_s: float) -> dict:
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    dur = max(duration_s, 1e-9)
    errors = Counter(r.error for r in results if not r.success)
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "retried": sum(r.retried for r in results),
        "duration_s": duration_s,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / dur,
        "input_throughput": total_in / dur,
        "output_throughput": total_out / dur,
        "total_throughput": (total_in + total_out) / dur,
        "concurrency": sum(r.latency for r in ok) / dur,
        "ttft_ms": stats_ms([r.ttft for r in ok]),
        "itl_ms": stats_ms([gap for r in ok for gap in r.itl]),
        "tpot_ms": stats_ms([(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]),
        "e2e_ms": stats_ms([r.latency for r in ok]),
        # The most frequent failure reasons, so a run full of 503s says so.
        "errors": dict(errors.most_common(5)),
    }


def _fmt(v: float | None, digits: int = 2) -> str:
    return "n/a" if v is None else f"{v:,.{digits}f}"


LATENCIES = (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("tpot_ms", "TPOT"), ("e2e_ms", "E2E latency"))


def _headline_rows(s: dict) -> list[tuple[str, str]]:
    return [
        ("Successful requests", str(s["completed"])),
        ("Failed requests", str(s["failed"])),
        ("Benchmark duration (s)", _fmt(s["duration_s"])),
        ("Total input tokens", str(s["total_input_tokens"])),
        ("Total generated tokens", str(s["total_output_tokens"])),
        ("Request throughput (req/s)", _fmt(s["request_throughput"])),
        ("Input token throughput (tok/s)", _fmt(s["input_throughput"])),
        ("Output token throughput (tok/s)", _fmt(s["output_throughput"])),
        ("Total token throughput (tok/s)", _fmt(s["total_throughput"])),
        ("Concurrency", _fmt(s["concurrency"])),
    ]


def format_table(s: dict, header: dict[str, str]) -> str:
    """The stdout report, laid out like SGLang's."""
    width = 50
    lines = [" Serving Benchmark Result ".center(width, "=")]
    rows = [*header.items(), *_headline_rows(s)]
    lines += [f"{k + ':':<40} {v}" for k, v in rows]
    for key, name in LATENCIES:
        lines.append(f" {name} ".center(width, "-"))
        for stat, label in (("mean", "Mean"), ("p50", "Median"), ("p90", "P90"), ("p99", "P99")):
            lines.append(f"{f'{label} {name} (ms):':<40} {_fmt(s[key][stat])}")
    for err, n in s["errors"].items():
        lines.append(f"{'Error (x' + str(n) + '):':<40} {err}")
    lines.append("=" * width)
    return "\n".join(lines)


def latency_table_md(s: dict) -> list[str]:
    lines = ["| latency (ms) | mean | p50 | p90 | p99 |", "|---|---:|---:|---:|---:|"]
    for key, name in LATENCIES:
        st = s[key]
        lines.append(f"| {name} | " + " | ".join(_fmt(st[k]) for k in ("mean", "p50", "p90", "p99")) + " |")
    return lines


def overhead_table_md(o: dict) -> list[str]:
    lines = [
        "| 1-token request (ms) | ok | failed | mean | p50 | p90 | p99 |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for key, name in (("router", "via router HTTP"), ("direct", "stage 0 gRPC direct")):
        st = o[key]
        cells = [str(st["ok"]), str(st["failed"])] + [_fmt(st[k], 3) for k in ("mean", "p50", "p90", "p99")]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    diff = o["overhead_p50_ms"]
    verdict = "n/a" if diff is None else ("met" if diff <= o["goal_ms"] else "NOT met")
    goal = f"goal ≤ {o['goal_ms']:g} ms: {verdict}"
    lines += ["", f"**Router overhead (p50 difference): {_fmt(diff, 3)} ms** ({goal})"]
    return lines


def markdown_section(
    title: str, meta: dict[str, str], args_line: str, summary: dict | None, overhead: dict | None
) -> str:
    """A section for benchmarks/RESULTS.md: when, what, the command, the tables."""
    lines = [f"## {title}", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items()]
    lines += ["", "```sh", args_line, "```", ""]
    if summary is not None:
        lines += ["| metric | value |", "|---|---:|"]
        lines += [f"| {k} | {v} |" for k, v in _headline_rows(summary)]
        lines += ["", *latency_table_md(summary), ""]
        lines += [f"- error (x{n}): `{err}`" for err, n in summary["errors"].items()]
    if overhead is not None:
        lines += [*overhead_table_md(overhead), ""]
    return "\n".join(lines).rstrip() + "\n"
