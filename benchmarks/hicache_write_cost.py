"""What L3 costs on traffic that never reuses a prefix: output throughput and the process tree's
peak RSS of `pipeserve up` with L3 (its defaults: a private redis-server, the default write policy)
against `--hicache-url off`, in alternating runs, medians reported with their spread.

Runs alternate, the order reversed every other round (a drift in the machine's load favours
neither side). Each run starts a fresh `up` (nothing cached anywhere: every prompt is fresh),
samples the RSS of its whole process tree (stages, router, the private redis-server) every 0.1 s
from start to stop, runs `pipeserve bench --workload random --warmup 0` against it, and reads stage
0's L3 counters (pages ordered written, first sightings, probes and the time waited for them).

    python benchmarks/hicache_write_cost.py [--runs 4] [--up-arg=--quantization=gguf] \
        [--variant "always=--hicache-write-policy always"] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
from hicache_cluster import Up, metric, scrape


class TreeRss:
    """Peak of the summed RSS of a process and its descendants, sampled on a thread."""

    def __init__(self, pid: int, interval_s: float = 0.1) -> None:
        self.root = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), daemon=True)
        self._thread.start()

    def _run(self, interval_s: float) -> None:
        while not self._stop.is_set():
            total = 0
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            for p in procs:
                try:
                    total += p.memory_info().rss
                except psutil.NoSuchProcess:
                    pass
            self.peak = max(self.peak, total)
            self._stop.wait(interval_s)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(5)
        return self.peak


def one_run(name: str, up_argv: list[str], args: argparse.Namespace, seed: int) -> dict:
    log_dir = Path(tempfile.mkdtemp(prefix=f"hicache-cost-{name}-"))
    up = Up(up_argv, log_dir)
    rss = TreeRss(up.proc.pid)
    try:
        t0 = time.monotonic()
        up.wait_ready(args.ready_timeout_s)
        ready_s = time.monotonic() - t0
        out = log_dir / "bench.json"
        cmd = [sys.executable, "-m", "pipeserve.cli", "bench", "--url", up.url, "--workload", "random"]
        cmd += ["--num-requests", str(args.num_requests), "--concurrency", str(args.concurrency)]
        cmd += ["--input-len", str(args.input_len), "--range-ratio", str(args.range_ratio)]
        cmd += ["--output-len", str(args.output_len), "--seed", str(seed), "--warmup", "0"]
        cmd += ["--quiet", "--json", str(out)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=args.bench_timeout_s)
        summary = json.loads(out.read_text())["results"]
        stage0 = scrape(up.groups()[0]["health"][0])
    finally:
        up.stop()
        peak = rss.stop()
    return {
        "variant": name,
        "seed": seed,
        "output_throughput": summary["output_throughput"],
        "ttft_p50_ms": summary["ttft_ms"]["p50"],
        "peak_rss_mib": peak / 2**20,
        "ready_s": ready_s,
        "l3_pages_ordered": metric(stage0, "pipeserve:hicache_l3_pages_ordered_total"),
        "l3_first_sightings": metric(stage0, "pipeserve:hicache_l3_first_sightings_total"),
        "l3_written_bytes": metric(stage0, "pipeserve:hicache_l3_written_bytes_total"),
        "l3_probes": metric(stage0, "pipeserve:hicache_l3_probes_total"),
        "l3_probe_wait_s": metric(stage0, "pipeserve:hicache_l3_probe_wait_seconds_total"),
        "l3_probe_waits_expired": metric(stage0, "pipeserve:hicache_l3_probe_waits_expired_total"),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--up-arg", action="append", default=None, help="an argument of every `up` (repeat)")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        help="NAME=ARGS: one more variant (ARGS space-separated `up` flags); 'l3' and 'off' always run",
    )
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--range-ratio", type=float, default=0.875)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--ready-timeout-s", type=float, default=300)
    ap.add_argument("--bench-timeout-s", type=float, default=900)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    base = args.up_arg if args.up_arg is not None else ["--quantization", "gguf"]
    variants = {"l3": [], "off": ["--hicache-url", "off"]}
    for v in args.variant:
        name, _, flags = v.partition("=")
        variants[name] = flags.split()
    rows = []
    for run in range(args.runs):  # alternating, the order reversed every other round (l3 off, off l3, ...)
        order = list(variants.items())
        for name, flags in order if run % 2 == 0 else order[::-1]:
            row = one_run(name, base + flags, args, seed=run)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    print(f"CPU: {cpu}, {psutil.cpu_count()} logical; up {' '.join(base)}")
    print(
        "| variant | runs | out tok/s median (min-max) | peak RSS MiB median (min-max) | L3 pages ordered |"
    )
    print("|---|---:|---|---|---:|")
    med: dict[str, dict[str, float]] = {}
    for name in variants:
        rs = [r for r in rows if r["variant"] == name]
        tput = [r["output_throughput"] for r in rs]
        rss = [r["peak_rss_mib"] for r in rs]
        med[name] = {"tput": statistics.median(tput), "rss": statistics.median(rss)}
        print(
            f"| {name} | {len(rs)} | {med[name]['tput']:.1f} ({min(tput):.1f}-{max(tput):.1f}) "
            f"| {med[name]['rss']:.0f} ({min(rss):.0f}-{max(rss):.0f}) "
            f"| {statistics.median(r['l3_pages_ordered'] for r in rs):.0f} |"
        )
    for name in variants:
        if name != "off":
            t, r = med[name]["tput"] / med["off"]["tput"], med[name]["rss"] / med["off"]["rss"]
            print(f"- {name} vs off: throughput {t:.3f}x, peak RSS {r:.3f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu, "up": base, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
