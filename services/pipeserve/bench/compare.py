"""`pipeserve bench --compare PEER_URL`: one workload against pipeserve and another server, and the ratios.

  pipeserve bench --url http://127.0.0.1:8000 --compare http://127.0.0.1:8080 \\
      --num-requests 32 --concurrency 16 --input-len 128 --range-ratio 0.875 --output-len 64 \\
      [--self-pid PID] [--peer-pid PID] [--compare-rounds 3] [--single-stream-requests 4] [--json F]

`--url` is "self" (pipeserve), `--compare` the peer: any OpenAI-compatible server whose
`/v1/completions` streams and takes token-id prompts and `ignore_eos` (llama.cpp's `llama-server`,
vLLM, SGLang). Each round runs, for self and then for the peer — one server at a time, never both
loaded at once — the serving pass (the bench's random workload at `--concurrency`, closed loop,
greedy) and a single-stream pass (the workload's first `--single-stream-requests` prompts at
concurrency 1). The headline figures are medians over the rounds:

  - out_tok_s: the serving pass's output token throughput;
  - ttft_p50_ms: the serving pass's TTFT p50;
  - single_tok_s: the single-stream pass's output token throughput (its TTFT included);
  - peak_rss_bytes: with `--self-pid` / `--peer-pid`, the sum of VmHWM over that pid and all its
    descendants (each process's own peak; an upper bound of the tree's simultaneous peak), read
    after the last round — for `pipeserve up` the router/supervisor process and every stage.

Each ratio is self ÷ peer of two such figures (so > 1 means pipeserve is higher: better for
throughput, worse for TTFT and memory). A pass with a failed request makes the run fail (exit 1):
a ratio over a partial run would mislead. The two servers see identical requests (the same
seeded token-id prompts); `--model` names self's model, `--peer-model` the peer's (default:
the first of each server's GET /v1/models).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from pipeserve.bench.workloads import BenchRequest

# bench/serving.py's pass runner, handed in by it (this module must not import serving: a cycle).
Serve = Callable[[argparse.Namespace, list[BenchRequest]], Coroutine[Any, Any, tuple[str, dict, list[Any]]]]

SIDES = ("self", "peer")
# (key, label, how the figure prints); the order of the printed and markdown tables.
FIGURES = (
    ("out_tok_s", "Output tok/s (serving pass)", "{:.2f}"),
    ("ttft_p50_ms", "TTFT p50 (ms, serving pass)", "{:.1f}"),
    ("single_tok_s", "Single stream tok/s (C=1)", "{:.2f}"),
    ("peak_rss_bytes", "Peak RSS, process tree (GB)", "GB"),
)


def add_compare_args(b: argparse.ArgumentParser) -> None:
    """The compare mode's flags on `pipeserve bench`'s parser."""
    b.add_argument(
        "--compare", default=None, metavar="PEER_URL", help="also run the workload against this server"
    )
    b.add_argument("--peer-model", default=None, help="--compare: the peer's model name")
    b.add_argument("--self-pid", type=int, default=None, help="--compare: pid of --url's server (for RSS)")
    b.add_argument("--peer-pid", type=int, default=None, help="--compare: pid of the peer server (for RSS)")
    b.add_argument("--compare-rounds", type=int, default=1, help="--compare: rounds (medians reported)")
    b.add_argument(
        "--single-stream-requests", type=int, default=4, help="--compare: requests at C=1 per round (0: none)"
    )


def check_compare_args(args: argparse.Namespace) -> None:
    if args.router_overhead or args.workload == "multi-turn" or args.plot:
        raise ValueError(
            "--compare runs the random/shared-prefix workloads; not with --router-overhead, "
            "multi-turn or --plot"
        )
    if args.compare_rounds < 1:
        raise ValueError("--compare-rounds must be >= 1")
    if not 0 <= args.single_stream_requests <= args.num_requests:
        raise ValueError("--single-stream-requests must be in [0, --num-requests]")
    for flag in ("self_pid", "peer_pid"):
        pid = getattr(args, flag)
        if pid is not None and not Path(f"/proc/{pid}").is_dir():
            raise ValueError(f"--{flag.replace('_', '-')} {pid}: no such process")


# --- memory of a process tree ----------------------------------------------------------


def tree_pids(root: int) -> list[int]:
    """`root` and all its live descendants (from /proc/*/stat's ppid); [] when root is gone."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:  # exited while we looked
            continue
        # The command name is in parentheses and may hold spaces: the fields follow the last ')'.
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    if not Path(f"/proc/{root}").is_dir():
        return []
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return sorted(out)


def status_bytes(pid: int, field: str) -> int:
    """A memory line of /proc/PID/status (VmHWM, VmRSS) in bytes; 0 for a gone or kernel process."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tree_peak_rss(root: int) -> int:
    return sum(status_bytes(pid, "VmHWM") for pid in tree_pids(root))


# --- the passes --------------------------------------------------------------------------


def _pass_args(
    args: argparse.Namespace, url: str, model: str | None, concurrency: int, warmup: int
) -> argparse.Namespace:
    return argparse.Namespace(
        **{**vars(args), "url": url, "model": model, "concurrency": concurrency, "warmup": warmup}
    )


def _run_side(args: argparse.Namespace, side: str, requests: list[BenchRequest], serve: Serve) -> dict:
    """One round on one server: the serving pass, then the single-stream pass."""
    url, model = (args.url, args.model) if side == "self" else (args.compare, args.peer_model)
    model, serving, _ = asyncio.run(
        serve(_pass_args(args, url, model, args.concurrency, args.warmup), requests)
    )
    out = {"model": model, "serving": serving, "single": None}
    if args.single_stream_requests:
        single_args = _pass_args(args, url, model, 1, 0)  # warm from the serving pass
        single_args.request_rate = float("inf")
        _, out["single"], _ = asyncio.run(serve(single_args, requests[: args.single_stream_requests]))
    return out


def _figures(rounds: list[dict], pid: int | None) -> dict:
    """Medians over the rounds of the headline figures (None where not measured)."""

    def median(values: list[float | None]) -> float | None:
        vals = [v for v in values if v is not None]
        return statistics.median(vals) if vals else None

    return {
        "out_tok_s": median([r["serving"]["output_throughput"] for r in rounds]),
        "ttft_p50_ms": median([r["serving"]["ttft_ms"]["p50"] for r in rounds]),
        "single_tok_s": median([r["single"]["output_throughput"] if r["single"] else None for r in rounds]),
        "peak_rss_bytes": None if pid is None else tree_peak_rss(pid) or None,
    }


def ratios(self_fig: dict, peer_fig: dict) -> dict:
    """self ÷ peer for every figure both sides have (and the peer's is non-zero)."""
    out: dict[str, float | None] = {}
    for key, _, _ in FIGURES:
        a, b = self_fig.get(key), peer_fig.get(key)
        out[key] = a / b if a is not None and b else None
    return out


def run_compare(args: argparse.Namespace, requests: list[BenchRequest], serve: Serve) -> dict:
    """Every round, self then peer; returns the document `--json` writes (less date/commit/args)."""
    rounds: dict[str, list[dict]] = {side: [] for side in SIDES}
    for i in range(args.compare_rounds):
        for side in SIDES:
            r = _run_side(args, side, requests, serve)
            rounds[side].append(r)
            print(f"# round {i + 1}/{args.compare_rounds} {side}: {_one_line(r)}", flush=True)
    pids = {"self": args.self_pid, "peer": args.peer_pid}
    doc: dict = {}
    for side in SIDES:
        url = args.url if side == "self" else args.compare
        doc[side] = {"url": url, "model": rounds[side][0]["model"], "pid": pids[side], "rounds": rounds[side]}
        doc[side]["figures"] = _figures(rounds[side], pids[side])
    doc["ratios"] = ratios(doc["self"]["figures"], doc["peer"]["figures"])
    passes = [p for side in SIDES for r in rounds[side] for p in (r["serving"], r["single"]) if p]
    doc["failed_requests"] = sum(p["failed"] for p in passes)
    return doc


def _one_line(r: dict) -> str:
    s = r["serving"]
    line = f"{s['output_throughput']:.2f} out tok/s, TTFT p50 {s['ttft_ms']['p50'] or 0:.1f} ms"
    if r["single"]:
        line += f", single stream {r['single']['output_throughput']:.2f} tok/s"
    return line + (f", {s['failed']} failed" if s["failed"] else "")


def _cell(v: float | None, fmt: str) -> str:
    if v is None:
        return "n/a"
    return f"{v / 1e9:.2f}" if fmt == "GB" else fmt.format(v)


def format_compare(doc: dict) -> str:
    width = 78
    lines = [" Compare: self = --url, peer = --compare ".center(width, "=")]
    lines += [f"{side}: {doc[side]['url']} ({doc[side]['model']})" for side in SIDES]
    lines.append(f"{'metric (median of rounds)':<34} {'self':>12} {'peer':>12} {'self/peer':>12}")
    for key, label, fmt in FIGURES:
        r = doc["ratios"][key]
        cells = [_cell(doc[side]["figures"][key], fmt) for side in SIDES]
        lines.append(f"{label:<34} {cells[0]:>12} {cells[1]:>12} {'n/a' if r is None else f'{r:.3f}x':>12}")
    if doc["failed_requests"]:
        lines.append(f"FAILED requests: {doc['failed_requests']} (ratios not valid)")
    lines.append("=" * width)
    return "\n".join(lines)


def compare_table_md(doc: dict) -> list[str]:
    lines = ["| metric (median of rounds) | self | peer | self ÷ peer |", "|---|---:|---:|---:|"]
    for key, label, fmt in FIGURES:
        r = doc["ratios"][key]
        cells = [_cell(doc[side]["figures"][key], fmt) for side in SIDES]
        lines.append(f"| {label} | {cells[0]} | {cells[1]} | {'n/a' if r is None else f'{r:.3f}×'} |")
    return lines
