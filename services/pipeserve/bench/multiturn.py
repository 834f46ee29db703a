"""`pipeserve bench --workload multi-turn`: conversations sharing one system prompt, turn after turn.

Contract:
  - the workload is `workloads.multi_turn_workload`: one system prompt of `--shared-prefix-len` ids
    (default 2048 for this workload) shared by every conversation, `--num-turns` turns each;
  - turn t of a conversation is sent only after turn t-1 finished, and its prompt carries the whole
    history: the previous prompt, the ids the server generated (asked with `return_token_ids`; a
    server that does not return them gets the workload's fallback ids of the same length), and a new
    user part of `--input-len` ids. At most `--concurrency` conversations run at once;
  - a failed turn ends its conversation (later turns would need its output), counted as failed;
  - reported beside the usual summary (`metrics.summarize` over every turn): TTFT p50/p99 per turn
    index and the share of prompt tokens the server reported cached
    (`usage.prompt_tokens_details.cached_tokens`), per turn and overall;
  - when the server is `pipeserve up` (its `/groups` lists every stage's side port), the HiCache byte
    counters of every stage are read before and after the run and reported per prompt token; any
    other server, or a failed scrape, just leaves them out.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Sequence

import httpx
from tqdm import tqdm  # type: ignore[import-untyped]  # no stubs shipped

from pipeserve.bench import client, metrics, workloads
from pipeserve.bench.metrics import RequestResult
from pipeserve.bench.workloads import Conversation

DEFAULT_SHARED_PREFIX_LEN = 2048
# Counters summed over every stage of every group: bytes that moved between the cache tiers.
BYTE_COUNTERS = ("pipeserve:hicache_l3_read_bytes_total", "pipeserve:hicache_l3_written_bytes_total")


async def run_conversation(
    http: httpx.AsyncClient, model: str, conv: Conversation, timeout_s: float
) -> list[RequestResult]:
    """Every turn of `conv` in order; stops at the first failed turn."""
    results: list[RequestResult] = []
    outputs: list[list[int]] = []
    for turn in range(conv.num_turns):
        res = await client.send_request(
            http, model, conv.request(turn, outputs), timeout_s, extra={"return_token_ids": True}
        )
        results.append(res)
        if not res.success:
            break
        ids = res.token_ids if len(res.token_ids) == res.output_len else conv.fallback_outputs[turn]
        outputs.append(ids[: conv.output_lens[turn]])
    return results


async def run_conversations(
    http: httpx.AsyncClient,
    model: str,
    conversations: Sequence[Conversation],
    concurrency: int,
    timeout_s: float,
    progress: bool = False,
) -> tuple[list[list[RequestResult]], float]:
    """Runs `concurrency` conversations at a time; results per conversation, and the duration."""
    if concurrency < 1:
        raise ValueError(f"--concurrency must be >= 1, got {concurrency}")
    sem = asyncio.Semaphore(concurrency)
    bar = tqdm(
        total=len(conversations), desc="conversations", unit="conv", file=sys.stderr, disable=not progress
    )

    async def one(conv: Conversation) -> list[RequestResult]:
        async with sem:
            res = await run_conversation(http, model, conv, timeout_s)
        bar.update(1)
        return res

    start = time.perf_counter()
    with bar:
        results = list(await asyncio.gather(*(one(c) for c in conversations)))
    return results, time.perf_counter() - start


def _cached_share(results: list[RequestResult]) -> float | None:
    known = [r for r in results if r.success and r.cached_tokens is not None]
    prompt = sum(r.prompt_len for r in known)
    return sum(r.cached_tokens or 0 for r in known) / prompt if prompt else None


def summarize(
    per_conv: list[list[RequestResult]], conversations: Sequence[Conversation], duration: float
) -> dict:
    """metrics.summarize over every turn sent, plus per-turn TTFT and cached shares."""
    flat = [r for conv in per_conv for r in conv]
    num_turns = max((c.num_turns for c in conversations), default=0)
    unsent = sum(c.num_turns for c in conversations) - len(flat)
    out = metrics.summarize(flat, duration)
    out["failed"] += unsent  # turns never sent because an earlier turn failed
    turns = []
    for t in range(num_turns):
        rs = [conv[t] for conv in per_conv if len(conv) > t]
        ok = [r for r in rs if r.success]
        turns.append(
            {
                "turn": t,
                "completed": len(ok),
                "mean_prompt_len": sum(r.prompt_len for r in ok) / len(ok) if ok else None,
                "ttft_ms": metrics.stats_ms([r.ttft for r in ok]),
                "cached_share": _cached_share(rs),
            }
        )
    out["turns"] = turns
    out["cached_share"] = _cached_share(flat)
    return out


# --- pipeserve's HiCache byte counters ------------------------------------------------------------


def parse_counters(text: str, names: Sequence[str]) -> dict[str, float]:
    """Sum of every sample of each metric in `names` in a Prometheus text page (labels ignored)."""
    sums = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in sums:
            try:
                sums[name] += float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
    return sums


def scrape_pipeserve(url: str, api_key: str | None, names: Sequence[str] = BYTE_COUNTERS) -> dict | None:
    """Each counter in `names` summed over every stage `/groups` lists; None if not a pipeserve up."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        groups = httpx.get(url.rstrip("/") + "/groups", headers=headers, timeout=5, trust_env=False).json()
        total = dict.fromkeys(names, 0.0)
        for g in groups:
            for health in g["health"]:
                page = httpx.get(health + "/metrics", timeout=5, trust_env=False).text
                for k, v in parse_counters(page, names).items():
                    total[k] += v
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None
    return total


def bytes_per_token(before: dict | None, after: dict | None, prompt_tokens: int) -> dict | None:
    if before is None or after is None or prompt_tokens <= 0:
        return None
    return {k: (after[k] - before[k]) / prompt_tokens for k in before}


# --- the run and its report -------------------------------------------------------------------------


async def serve(args, conversations: list[Conversation], progress: bool | None = None) -> tuple[str, dict]:
    """Run the conversations; (model, summary). `progress` None: a bar when stderr is a terminal."""
    model, summary, _ = await serve_results(args, conversations, progress)
    return model, summary


async def serve_results(
    args, conversations: list[Conversation], progress: bool | None = None
) -> tuple[str, dict, list[RequestResult]]:
    """`serve`, with every turn's result too (what --plot draws)."""
    if progress is None:
        progress = sys.stderr.isatty()
    url, key = args.url, args.api_key
    async with client.make_client(url, args.concurrency, args.timeout_s, key) as http:
        model = args.model or await client.fetch_model(http)
        if args.warmup > 0:
            # Random prompts from another seed: connections open, the server pays its first-request
            # costs, and the shared system prompt stays unseen (turn 0 of the first conversations is
            # then what a new system prompt costs).
            vocab = workloads.resolve_vocab_size(args.vocab_size, args.tokenizer)
            warm = workloads.random_workload(
                args.warmup, args.input_len, 4, 0.0, vocab, args.seed + 1_000_003
            )
            res, _ = await client.run_requests(http, model, warm, [0.0] * len(warm), 1, args.timeout_s)
            if not any(r.success for r in res):
                raise ConnectionError(f"every warmup request failed, e.g. {res[0].error}")
        before = await asyncio.to_thread(scrape_pipeserve, url, key)
        per_conv, duration = await run_conversations(
            http, model, conversations, args.concurrency, args.timeout_s, progress=progress
        )
        after = await asyncio.to_thread(scrape_pipeserve, url, key)
    summary = summarize(per_conv, conversations, duration)
    summary["hicache_bytes_per_prompt_token"] = bytes_per_token(before, after, summary["total_input_tokens"])
    return model, summary, [r for conv in per_conv for r in conv]


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:.1f}%"


def turn_table_md(s: dict) -> list[str]:
    """Per turn: completed, mean prompt length, TTFT p50 / p99, cached share; then overall."""
    lines = [
        "| turn | completed | mean prompt tokens | TTFT p50 (ms) | TTFT p99 (ms) | cached |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    f = metrics._fmt
    for t in s["turns"]:
        st = t["ttft_ms"]
        plen = f(t["mean_prompt_len"], 0)
        row = [str(t["turn"]), str(t["completed"]), plen, f(st["p50"]), f(st["p99"]), _pct(t["cached_share"])]
        lines.append("| " + " | ".join(row) + " |")
    st = s["ttft_ms"]
    lines.append(
        f"| all | {s['completed']} | | {f(st['p50'])} | {f(st['p99'])} | {_pct(s['cached_share'])} |"
    )
    if bpt := s.get("hicache_bytes_per_prompt_token"):
        moved = ", ".join(f"{k.removeprefix('pipeserve:hicache_')}: {v:,.0f}" for k, v in bpt.items())
        lines += ["", f"HiCache bytes per prompt token (all stages): {moved}"]
    return lines


def format_turns(s: dict) -> str:
    return "\n".join([" Multi-turn ".center(50, "-"), *turn_table_md(s)])
