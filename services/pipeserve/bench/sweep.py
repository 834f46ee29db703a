"""A side-by-side sweep: rounds × servers, alternating, × cells; every pass on fresh prompts, checked.

Order: round 1 runs every cell on self, then every cell on the peer; round 2 again self, then the
peer; ... — servers alternate, and a slow drift of the machine falls on both. Within a server's turn
the cells are grouped by the launch they need (`Server.launch_key`): one session per group, so a
launched server is started fresh per round (its ready time and start-up memory are measured each
time) and never runs beside the other.

A pass is one server × one round × one cell: `warmup` fresh short requests (open the connections,
pay first-request costs for the cell's shape), then `cell.num_requests()` fresh requests of the cell's
prompt and output length, all sent at once and at most C in flight (closed loop), streamed, greedy,
`ignore_eos`. Both servers get the same prompt set for a cell and round (each sees it once); no other
pass gets it (bench/prompts.py). After the pass `cachecheck.check_pass` proves from the server's own
reports that no prompt token was a cache hit, and raises otherwise — which ends the sweep: the
runs already made stay in `record`, for the caller to write.

A pass's figures (`pass_figures`): output throughput (tokens / duration, TTFT included), TTFT p50 and
p99, TPOT p50, at C=1 the prompt processing rate (median over requests of the server's own prompt
token count / TTFT), and the peak of the process tree's sampled RSS over the pass. Beside them, the
share of the CPUs other processes took during the pass (`host.ForeignCpu`): above `QUIET` the pass
is flagged, on the console and in the report, as measured on a machine that was not quiet.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

from pipeserve.bench import cachecheck, client, metrics
from pipeserve.bench.cells import Cell
from pipeserve.bench.host import ForeignCpu
from pipeserve.bench.launch import Live
from pipeserve.bench.metrics import RequestResult
from pipeserve.bench.prompts import FreshPrompts
from pipeserve.bench.workloads import BenchRequest

SIDES = ("self", "peer")
READY_PROMPT_LEN = 16
QUIET = 0.05  # the share of the CPUs other processes may use during a pass before it is flagged


class Server(Protocol):
    """What a sweep needs of a server (bench/launch.py: RunningServer, LaunchedServer)."""

    pipeserve: bool
    api_key: str | None
    model: str | None

    def describe(self) -> str: ...

    def launch_key(self, cell: Cell) -> str: ...

    def session(self, key: str, ready: BenchRequest) -> AbstractContextManager[Live]: ...


@dataclass
class SweepSpec:
    cells: list[Cell]
    rounds: int = 3
    cap: int = 128  # most requests per pass
    requests: int | None = None  # every pass sends this many instead (a quick check)
    warmup: int = 2
    timeout_s: float = 600.0
    measures_caching: bool = False  # the passes report cache hits instead of failing on them


def pass_figures(results: list[RequestResult], duration: float, cell: Cell, rss: int | None) -> dict:
    s = metrics.summarize(results, duration)
    ok = [r for r in results if r.success]
    rates = [r.prompt_len / r.ttft for r in ok if r.ttft > 0]
    return {
        "out_tok_s": s["output_throughput"] if ok else None,
        "ttft_p50_ms": s["ttft_ms"]["p50"],
        "ttft_p99_ms": s["ttft_ms"]["p99"],
        "tpot_p50_ms": s["tpot_ms"]["p50"],
        # Prompt tokens the server read per second of TTFT: a prefill rate only with nothing else
        # in flight, so at C=1 alone.
        "pp_tok_s": statistics.median(rates) if rates and cell.concurrency == 1 else None,
        "peak_rss_bytes": rss or None,
    }


def _summary_brief(s: dict) -> dict:
    keep = ("completed", "failed", "retried", "duration_s", "total_input_tokens", "total_output_tokens")
    return {k: s[k] for k in keep} | {"errors": s["errors"], "ttft_ms": s["ttft_ms"], "tpot_ms": s["tpot_ms"]}


async def _send(
    url: str, server: Server, warm: list[BenchRequest], timed: list[BenchRequest], cell: Cell, timeout: float
) -> tuple[str, list[RequestResult], list[RequestResult], float]:
    # A new client (new connections) per pass, as a user's requests would come.
    async with client.make_client(url, cell.concurrency, timeout, server.api_key) as http:
        model = server.model or await client.fetch_model(http)
        warm_res: list[RequestResult] = []
        if warm:
            warm_res, _ = await client.run_requests(
                http, model, warm, [0.0] * len(warm), cell.concurrency, timeout
            )
            if not any(r.success for r in warm_res):
                raise ConnectionError(f"{url}: every warmup request failed, e.g. {warm_res[0].error}")
        results, duration = await client.run_requests(
            http, model, timed, [0.0] * len(timed), cell.concurrency, timeout
        )
    return model, warm_res, results, duration


def run_pass(
    side: str, server: Server, live: Live, prompts: FreshPrompts, spec: SweepSpec, rnd: int, cell: Cell
) -> dict:
    """One pass: its figures, the cache check's report, the summary; raises CacheHitError on hits."""
    n = cell.num_requests(spec.cap, spec.requests)
    timed = prompts.requests(f"r{rnd}/{cell.key}", n, cell.prompt_len, cell.output_len)
    nwarm = min(spec.warmup, n)
    warm = prompts.requests(f"r{rnd}/{cell.key}/warmup", nwarm, cell.prompt_len, 4) if nwarm else []
    counters = cachecheck.Counters(live.url, server.api_key, required=server.pipeserve)
    before = counters.read()
    if live.sampler:
        live.sampler.mark()
    others = ForeignCpu(live.pid)
    sent = _send(live.url, server, warm, timed, cell, spec.timeout_s)
    model, warm_res, results, duration = asyncio.run(sent)
    rss = live.sampler.read_window() if live.sampler else None
    foreign = others.share()
    cache = cachecheck.check_pass(side, warm_res + results, before, counters.read(), spec.measures_caching)
    summary = metrics.summarize(results, duration)
    return {
        "side": side,
        "round": rnd,
        "cell": cell.key,
        "model": model,
        "requests": n,
        "figures": pass_figures(results, duration, cell, rss),
        "cache": cache,
        "server_prompt_tokens_mean": summary["total_input_tokens"] / max(1, summary["completed"]),
        "failed": summary["failed"],
        "foreign_cpu_share": foreign,
        "summary": _summary_brief(summary),
    }


def _groups(server: Server, cells: list[Cell]) -> Iterator[tuple[str, list[Cell]]]:
    """The cells by launch key, in the order each key first appears."""
    groups: dict[str, list[Cell]] = {}
    for c in cells:
        groups.setdefault(server.launch_key(c), []).append(c)
    yield from groups.items()


def run_sweep(
    servers: dict[str, Server],
    prompts: FreshPrompts,
    spec: SweepSpec,
    record: dict,
    say: Callable[[str], None] = print,
) -> dict:
    """Every round, every server in turn, every cell; fills `record["passes"]` and `record["sessions"]`
    as it goes (so a run that ends on an error keeps what it made) and returns it."""
    prompts.check_distance(max(16, *(c.concurrency for c in spec.cells)))
    record.setdefault("passes", [])
    record.setdefault("sessions", [])
    for rnd in range(1, spec.rounds + 1):
        for side in SIDES:
            server = servers[side]
            for key, cells in _groups(server, spec.cells):
                ready = prompts.requests(f"r{rnd}/{side}/{key}/ready", 1, READY_PROMPT_LEN, 1)[0]
                with server.session(key, ready) as live:
                    session = {"side": side, "round": rnd, "launch": key, "ready_s": live.ready_s}
                    session["argv"] = live.argv
                    record["sessions"].append(session)
                    if live.ready_s is not None:
                        say(f"# round {rnd} {side} [{key}]: ready in {live.ready_s:.2f} s")
                    for cell in cells:
                        p = run_pass(side, server, live, prompts, spec, rnd, cell)
                        record["passes"].append(p)
                        say(f"# round {rnd}/{spec.rounds} {side} {cell.key}: {one_line(p)}")
                    session["peak_rss_bytes"] = live.sampler.peak if live.sampler else None
    return record


def one_line(p: dict) -> str:
    f = p["figures"]

    def num(v: float | None, fmt: str) -> str:
        return "n/a" if v is None else fmt.format(v)

    line = f"{num(f['out_tok_s'], '{:.1f}')} out tok/s, TTFT p50 {num(f['ttft_p50_ms'], '{:.0f}')} ms"
    line += f", TPOT p50 {num(f['tpot_p50_ms'], '{:.1f}')} ms"
    if f["pp_tok_s"] is not None:
        line += f", prompt {f['pp_tok_s']:.0f} tok/s"
    if f["peak_rss_bytes"]:
        line += f", RSS {f['peak_rss_bytes'] / 2**20:.0f} MiB"
    line += f", cached tokens {p['cache']['hit_tokens']}"
    if (share := p.get("foreign_cpu_share")) and share > QUIET:
        line += f", NOT QUIET: other processes used {share:.0%} of the CPUs"
    return line + (f", {p['failed']} FAILED" if p["failed"] else "")
