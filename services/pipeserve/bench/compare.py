"""`pipeserve bench --compare PEER_URL`: pipeserve beside another server, honestly, and the ratios.

  pipeserve bench --url http://127.0.0.1:8000 --compare http://127.0.0.1:8080 \\
      --tokenizer MODEL_DIR [--sweep custom|reduced|full] [--cells 'p128-*'] [--compare-rounds 3] \\
      [--prompt-kind text|ids] [--self-pid PID] [--peer-pid PID] [--json F] [--results-md F] [--plot F.png]

`--url` is "self" (pipeserve), `--compare` the peer: any OpenAI-compatible server whose
`/v1/completions` streams and takes `ignore_eos` (llama.cpp's `llama-server`, vLLM, SGLang).
The sweep (bench/cells.py: one cell from --input-len/--concurrency/--output-len, or the reduced or
full grid) runs round after round, self then peer (bench/sweep.py); every pass gets fresh prompts
(bench/prompts.py: text of random corpus words sized with --tokenizer, the default, or token ids),
and every pass is checked from the servers' own reports for cache hits (bench/cachecheck.py) —
a hit ends the run with exit status 1 unless `--measures-caching` says the passes time a cache.
With `--self-pid` / `--peer-pid` the RSS of each server's process tree is sampled (~100 ms) during
each pass. Servers given as URLs are already running: ready time is measured only where the bench
starts them itself (benchmarks/peer.py, which drives this module with `LaunchedServer`s).

The figures, their medians over rounds, spreads and ratios: bench/sweep_report.py. Outputs: the
ratio tables on stdout; `--json` the raw runs (every pass, every session) and the aggregate;
`--results-md` appends the section (CPU, commands, tables); `--plot` a PNG of the ratios.
A failed request or a cache hit makes the exit status 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pipeserve.bench.cells import DEFAULT_CAP, GRIDS, Cell, grid, select

if TYPE_CHECKING:
    from pipeserve.bench.prompts import FreshPrompts
    from pipeserve.bench.sweep import Server

SWEEPS = ("custom", *GRIDS)


def add_compare_args(b: argparse.ArgumentParser) -> None:
    """The compare mode's flags on `pipeserve bench`'s parser."""
    b.add_argument(
        "--compare", default=None, metavar="PEER_URL", help="also run the workload against this server"
    )
    b.add_argument("--peer-model", default=None, help="--compare: the peer's model name")
    b.add_argument("--self-pid", type=int, default=None, help="--compare: pid of --url's server (for RSS)")
    b.add_argument("--peer-pid", type=int, default=None, help="--compare: pid of the peer server (for RSS)")
    b.add_argument("--compare-rounds", type=int, default=3, help="--compare: rounds (medians reported)")
    b.add_argument("--sweep", choices=SWEEPS, default="custom", help="--compare: the cells (custom: one)")
    b.add_argument("--cells", default=None, help="--compare: keep cells matching these patterns (p128-*)")
    b.add_argument(
        "--prompt-kind", choices=("text", "ids"), default="text", help="--compare: text needs --tokenizer"
    )
    b.add_argument("--max-requests", type=int, default=DEFAULT_CAP, help="--compare: most requests a pass")
    b.add_argument("--cell-requests", type=int, default=None, help="--compare: every pass sends this many")
    b.add_argument(
        "--measures-caching", action="store_true", help="--compare: report cache hits instead of failing"
    )
    b.add_argument(
        "--prompt-seed", type=int, default=None, help="--compare: the fresh prompts' (default: new each run)"
    )


def check_compare_args(args: argparse.Namespace) -> None:
    if args.router_overhead or args.workload != "random":
        raise ValueError(
            "--compare runs its own fresh-prompt workload; not with --router-overhead or --workload"
        )
    if args.compare_rounds < 1:
        raise ValueError("--compare-rounds must be >= 1")
    if args.prompt_kind == "text" and not args.tokenizer:
        raise ValueError("--compare with text prompts needs --tokenizer MODEL_DIR (or --prompt-kind ids)")
    if args.cell_requests is not None and args.cell_requests < 1:
        raise ValueError("--cell-requests must be >= 1")
    for flag in ("self_pid", "peer_pid"):
        pid = getattr(args, flag)
        if pid is not None and not Path(f"/proc/{pid}").is_dir():
            raise ValueError(f"--{flag.replace('_', '-')} {pid}: no such process")


def cells_of(args: argparse.Namespace) -> list[Cell]:
    return select(grid(args.sweep, Cell(args.input_len, args.concurrency, args.output_len)), args.cells)


def new_record(
    label: str, sweep: str, rounds: int, cells: list[Cell], prompts: FreshPrompts, servers: dict[str, Server]
) -> dict:
    """The run's JSON document before any pass: where, what, with which prompts and servers."""
    from pipeserve.bench.host import cpu_info, git_commit

    return {
        "label": label,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "commit": git_commit(),
        "cpu": cpu_info(),
        "sweep": sweep,
        "rounds": rounds,
        "cells": [c.key for c in cells],
        "prompt_kind": prompts.maker.kind,
        "seed": prompts.seed,
        "reuse_distance": prompts.reuse_distance,
        "servers": {side: {"describe": s.describe()} for side, s in servers.items()},
        "passes": [],
        "sessions": [],
    }


def finish(
    record: dict,
    servers: dict[str, Server],
    json_path: str | None,
    results_md: Sequence[str],
    plot_path: str | None,
    prompts_issued: int,
) -> dict:
    """Aggregate, print the tables, write what was asked (the section appended to each of
    `results_md`); returns the aggregate."""
    from pipeserve.bench import sweep_report

    record["prompts_issued"] = prompts_issued
    for side, s in servers.items():
        record["servers"][side]["commands"] = dict(getattr(s, "commands", {}))
    agg = sweep_report.aggregate(record)
    record["aggregate"] = agg
    record["failed_requests"] = sum(p["failed"] for p in record["passes"])
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(record, indent=2) + "\n")
    plot = None
    if plot_path and agg["cells"]:
        from pipeserve.bench import sweep_plot

        plot = sweep_plot.write_ratio_plot(agg, plot_path, record["label"]).resolve()
    print("\n".join(["", *sweep_report.ratio_table(agg), "", *sweep_report.server_table(agg)]))
    for md in results_md:
        ref = None
        if plot is not None:  # the markdown links the plot relative to itself where it can
            base = Path(md).resolve().parent
            ref = str(plot.relative_to(base)) if plot.is_relative_to(base) else str(plot)
        with open(md, "a", encoding="utf-8") as f:
            f.write("\n" + sweep_report.markdown(record, agg, ref))
    return agg


def run_compare_cli(args: argparse.Namespace, args_line: str) -> int:
    """`--compare PEER_URL` on two running servers; see the module docstring."""
    import httpx

    from pipeserve.bench import prompts as prompts_mod
    from pipeserve.bench import workloads
    from pipeserve.bench.cachecheck import CacheHitError
    from pipeserve.bench.launch import RunningServer
    from pipeserve.bench.sweep import SweepSpec, run_sweep

    check_compare_args(args)
    cells = cells_of(args)
    if args.prompt_kind == "text":
        maker: prompts_mod.Maker = prompts_mod.hf_text_prompts(args.tokenizer)
    else:
        maker = prompts_mod.IdPrompts(workloads.resolve_vocab_size(args.vocab_size, args.tokenizer))
    # A new seed per run unless one is given: servers that stay up between runs must not see a
    # prompt twice (the cache check would say so).
    seed = args.prompt_seed if args.prompt_seed is not None else time.time_ns() % 2**31
    fresh = prompts_mod.FreshPrompts(maker, seed)
    servers: dict[str, Server] = {
        "self": RunningServer(args.url, args.self_pid, api_key=args.api_key, model=args.model),
        "peer": RunningServer(args.compare, args.peer_pid, api_key=args.api_key, model=args.peer_model),
    }
    spec = SweepSpec(
        cells, args.compare_rounds, args.max_requests, args.cell_requests, args.warmup, args.timeout_s,
        args.measures_caching,
    )  # fmt: skip
    label = args.label or f"{args.sweep} sweep, {args.prompt_kind} prompts"
    record = new_record(label, args.sweep, args.compare_rounds, cells, fresh, servers)
    record["command"] = args_line
    status = 0
    try:
        run_sweep(servers, fresh, spec, record)
    except CacheHitError as e:
        print(f"pipeserve bench --compare: {e}", file=sys.stderr)
        status = 1
    except (httpx.HTTPError, ConnectionError) as e:
        print(f"pipeserve bench --compare: cannot benchmark: {type(e).__name__}: {e}", file=sys.stderr)
        status = 1
    mds = [args.results_md] if args.results_md and status == 0 else []
    finish(record, servers, args.json, mds, args.plot, fresh.issued)
    return status or (1 if record["failed_requests"] else 0)
