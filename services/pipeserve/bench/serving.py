"""`pipeserve bench`: throughput and latency of an OpenAI-compatible server, like SGLang's bench_serving.

  pipeserve bench --url http://127.0.0.1:8000 --workload random|shared-prefix \\
      --num-requests N --concurrency C [--request-rate R] [--input-len 128] [--output-len 64] ...
  pipeserve bench --workload multi-turn --num-conversations N --num-turns 3 --concurrency C ...
  pipeserve bench --router-overhead --url http://127.0.0.1:8000 --grpc HOST:PORT [--num-requests 200]

The serving mode sends N streamed `/v1/completions` requests (token-id prompts from
`workloads.py`, `ignore_eos` so every request generates exactly its drawn output length),
at most C in flight, arriving as a Poisson process at R req/s (default: all at once), and
reports what `metrics.py` defines: request/token throughput and TTFT / ITL / TPOT / E2E
mean, p50, p90, p99. The multi-turn workload (conversations over one shared system prompt, turns
sent in order) is run and reported by `multiturn.py`. The router-overhead mode is described in
`overhead.py`. Results go to stdout, and optionally to a JSON file and a markdown section
appended to a results file; `--plot FILE.png` draws TTFT/ITL CDFs and throughput over time
(`plot.py`). A progress bar of completed requests goes to stderr when it is a terminal (not with
`--quiet`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeserve.bench.metrics import RequestResult
    from pipeserve.bench.workloads import BenchRequest, Conversation

_SECRET_ARGS = ("api_key",)


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="benchmark an OpenAI-compatible server (like SGLang bench_serving)")
    b.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (no /v1)")
    b.add_argument("--workload", choices=("random", "shared-prefix", "multi-turn"), default="random")
    b.add_argument("--num-requests", type=int, default=200)
    b.add_argument("--concurrency", type=int, default=16, help="most requests in flight at once")
    b.add_argument("--request-rate", type=float, default=math.inf, help="req/s, Poisson (default: inf)")
    b.add_argument("--input-len", type=int, default=128, help="prompt tokens (the suffix for shared-prefix)")
    b.add_argument("--output-len", type=int, default=64)
    b.add_argument("--range-ratio", type=float, default=0.5, help="lengths uniform in [len*(1-ratio), len]")
    b.add_argument(
        "--shared-prefix-len",
        type=int,
        default=None,
        help="default: 256; 2048 for multi-turn (system prompt)",
    )
    b.add_argument("--num-turns", type=int, default=3, help="multi-turn: turns per conversation")
    b.add_argument(
        "--num-conversations", type=int, default=None, help="multi-turn (default: num-requests / num-turns)"
    )
    b.add_argument("--num-prefixes", type=int, default=4)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--model", default=None, help="model name (default: the first of GET /v1/models)")
    b.add_argument("--api-key", default=None)
    b.add_argument("--tokenizer", default=None, help="model directory; its config.json gives --vocab-size")
    b.add_argument("--vocab-size", type=int, default=None, help="token ids are drawn from [3, vocab)")
    b.add_argument("--json", default=None, metavar="FILE", help="write the results and arguments as JSON")
    b.add_argument("--results-md", default=None, metavar="FILE", help="append a markdown section")
    b.add_argument("--label", default="", help="a name for this run in --results-md / --json")
    b.add_argument("--warmup", type=int, default=2, help="untimed requests before the run")
    b.add_argument("--timeout-s", type=float, default=600.0, help="limit for each request")
    b.add_argument(
        "--router-overhead",
        action="store_true",
        help="measure router latency over stage 0's gRPC instead (needs --grpc)",
    )
    b.add_argument("--grpc", default=None, metavar="HOST:PORT", help="stage 0's Generation service")
    b.add_argument(
        "--plot",
        default=None,
        metavar="FILE.png",
        help="draw TTFT/ITL CDFs and output throughput over time (e.g. next to --json; needs matplotlib)",
    )
    b.add_argument(
        "--quiet", action="store_true", help="no progress bar (there is none when stderr is no TTY)"
    )
    from pipeserve.bench.compare import add_compare_args  # no heavy imports there

    add_compare_args(b)
    b.set_defaults(func=run_bench)


def _public_args(args: argparse.Namespace) -> dict:
    out = {}
    for k, v in vars(args).items():
        if k in ("func", "command", "progress"):  # progress: derived from --quiet and the TTY
            continue
        if k in _SECRET_ARGS and v:
            v = "***"  # results files get committed; a key must not be
        out[k] = None if isinstance(v, float) and math.isinf(v) else v
    return out


def _args_line(args: argparse.Namespace) -> str:
    """An equivalent command line (secrets hidden) for the results file."""
    parts = ["pipeserve bench"]
    if args.router_overhead:  # the serving workload's knobs do not apply
        unused = {"workload", "concurrency", "request_rate", "input_len", "output_len", "range_ratio"}
        unused |= {"shared_prefix_len", "num_prefixes", "seed", "tokenizer", "vocab_size"}
    elif args.workload == "random":
        unused = {"shared_prefix_len", "num_prefixes", "num_turns", "num_conversations"}
    elif args.workload == "shared-prefix":
        unused = {"num_turns", "num_conversations"}
    else:
        unused = {"num_prefixes", "request_rate"}
    if not getattr(args, "compare", None):  # --compare's own
        unused |= {"compare_rounds", "sweep", "cells", "prompt_kind", "prompt_seed", "max_requests"}
        unused |= {"cell_requests"}
    for k, v in _public_args(args).items():
        if v is None or v is False or v == "" or k in unused:
            continue
        flag = "--" + k.replace("_", "-")
        parts.append(flag if v is True else f"{flag} {shlex.quote(str(v))}")
    return " ".join(parts)


def _git_commit() -> str:
    from pipeserve.bench.host import git_commit

    return git_commit()


# The measuring modules (httpx, grpc, numpy) are imported inside the functions that use them:
# every `pipeserve` command builds this parser, and they should not pay for those imports.


def build_workload(args: argparse.Namespace) -> list[BenchRequest]:
    from pipeserve.bench import workloads

    vocab = workloads.resolve_vocab_size(args.vocab_size, args.tokenizer)
    common = (args.num_requests, args.input_len, args.output_len, args.range_ratio, vocab, args.seed)
    if args.workload == "random":
        return workloads.random_workload(*common)
    prefix_len = 256 if args.shared_prefix_len is None else args.shared_prefix_len
    return workloads.shared_prefix_workload(*common, prefix_len, args.num_prefixes)


def build_conversations(args: argparse.Namespace) -> list[Conversation]:
    from pipeserve.bench import multiturn, workloads

    vocab = workloads.resolve_vocab_size(args.vocab_size, args.tokenizer)
    n = args.num_conversations or max(1, args.num_requests // max(1, args.num_turns))
    prefix = multiturn.DEFAULT_SHARED_PREFIX_LEN if args.shared_prefix_len is None else args.shared_prefix_len
    return workloads.multi_turn_workload(
        n, args.num_turns, args.input_len, args.output_len, args.range_ratio, vocab, args.seed, prefix
    )


async def _serve(
    args: argparse.Namespace, requests: list[BenchRequest]
) -> tuple[str, dict, list[RequestResult]]:
    from pipeserve.bench import client, metrics, workloads

    arrivals = workloads.arrival_offsets(len(requests), args.request_rate, args.seed)
    async with client.make_client(args.url, args.concurrency, args.timeout_s, args.api_key) as http:
        model = args.model or await client.fetch_model(http)
        if args.warmup > 0:
            # Short copies of the first prompts: connections open and the server's first-request
            # costs are paid before timing starts.
            firsts = [requests[i % len(requests)] for i in range(args.warmup)]
            warm = [workloads.BenchRequest(r.prompt, min(r.output_len, 4)) for r in firsts]
            zeros = [0.0] * len(warm)
            res, _ = await client.run_requests(http, model, warm, zeros, args.concurrency, args.timeout_s)
            if not any(r.success for r in res):
                raise ConnectionError(f"every warmup request failed, e.g. {res[0].error}")
        results, duration = await client.run_requests(
            http, model, requests, arrivals, args.concurrency, args.timeout_s, progress=args.progress
        )
    return model, metrics.summarize(results, duration), results


def _model_name(args: argparse.Namespace) -> str:
    from pipeserve.bench import client

    if args.model:
        return args.model

    async def fetch() -> str:
        async with client.make_client(args.url, 1, args.timeout_s, args.api_key) as http:
            return await client.fetch_model(http)

    return asyncio.run(fetch())


def _check_args(args: argparse.Namespace) -> None:
    if args.num_requests < 1:
        raise ValueError("--num-requests must be >= 1")
    if args.router_overhead and not args.grpc:
        raise ValueError("--router-overhead needs --grpc HOST:PORT (stage 0's Generation service)")
    if args.plot and args.router_overhead:
        raise ValueError("--plot draws the serving workloads' latencies; not with --router-overhead")
    if args.plot:
        from pipeserve.bench import plot

        plot.require()  # before the run: a missing matplotlib is said at once


def _measure(args: argparse.Namespace) -> tuple[str, dict | None, list[RequestResult], dict | None]:
    """(model, the workload's summary, its requests' results, the router-overhead figures)."""
    from pipeserve.bench import multiturn, overhead

    if args.router_overhead:
        model = _model_name(args)
        over = overhead.measure_router_overhead(
            args.url, args.grpc, model, args.num_requests, args.warmup, args.timeout_s, args.api_key
        )
        print(overhead.format_overhead(over))
        return model, None, [], over
    if args.workload == "multi-turn":
        conversations = build_conversations(args)
        model, summary, results = asyncio.run(multiturn.serve_results(args, conversations, args.progress))
    else:
        model, summary, results = asyncio.run(_serve(args, build_workload(args)))
    return model, summary, results, None


def _report(
    args: argparse.Namespace,
    started: str,
    model: str,
    summary: dict | None,
    results: list[RequestResult],
    over: dict | None,
) -> None:
    """The table on stdout, and the JSON, plot and RESULTS.md section asked for."""
    from pipeserve.bench import metrics, multiturn

    mode = "router overhead" if args.router_overhead else f"{args.workload} workload"
    header = {
        "Mode": mode,
        "Model": model,
        "Traffic request rate": f"{args.request_rate:g}",
        "Max request concurrency": str(args.concurrency),
    }
    if summary is not None:
        print(metrics.format_table(summary, header))
    if summary is not None and "turns" in summary:
        print(multiturn.format_turns(summary))
    if args.json:
        doc = {
            "date": started,
            "label": args.label,
            "commit": _git_commit(),
            "model": model,
            "args": _public_args(args),
            "results": summary,
            "router_overhead": over,
        }
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    if args.plot:
        from pipeserve.bench import plot

        title = f"{args.label or mode}: {model}, concurrency {args.concurrency}"
        print(f"# plot written to {plot.write_plot(results, args.plot, title)}", file=sys.stderr)
    if args.results_md:
        title = f"Serving benchmark: {args.label or mode}"
        meta = {"date": started, "commit": _git_commit(), "url": args.url, "model": model, "mode": mode}
        section = metrics.markdown_section(title, meta, _args_line(args), summary, over)
        if summary is not None and "turns" in summary:
            section += "\n" + "\n".join(multiturn.turn_table_md(summary)) + "\n"
        with open(args.results_md, "a", encoding="utf-8") as f:
            f.write("\n" + section)


def run_bench(args: argparse.Namespace) -> int:
    import httpx

    _check_args(args)
    args.progress = sys.stderr.isatty() and not args.quiet
    if args.compare:
        from pipeserve.bench import compare

        return compare.run_compare_cli(args, _args_line(args))
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    try:
        model, summary, results, over = _measure(args)
    except (httpx.HTTPError, ConnectionError) as e:
        print(f"pipeserve bench: cannot benchmark {args.url}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    _report(args, started, model, summary, results, over)
    if over is not None:
        return 0 if over["router"]["ok"] and over["direct"]["ok"] else 1
    return 0 if summary is not None and summary["completed"] else 1
