"""HiCache on multi-turn traffic: TTFT of a conversation's first turn over a ~2k-token system prompt.

One command starts `pipeserve up` itself (the default model, or --model DIR) with two groups
(`--replicas 2 --policy round_robin`), a small L1 (`--num-kv-blocks`, so one 2k prefix pushes the
previous one out to L2), an L2 per stage and the private Redis (`--hicache-url local`), on free
loopback ports, and measures in one run, each case `--reps` times:

  (a) recompute  prefix never seen, on group 0;
  (b) L3 hit     the same prefix on group 1 (it never saw it: L1 and L2 empty there) once group 0
                 has seen it a second time (an L1 hit, untimed: the default write policy, second-hit,
                 stores a prefix when it is seen again) and its store queue drained; stage 0's
                 hit_tokens{tier="l3"} must grow;
  (c) L2 hit     the previous rep's prefix on group 0, pushed from L1 to L2 by (a);
                 hit_tokens{tier="l2"} must grow;
  (d) restart    every stage of both groups killed, `up` restarts them; once /groups says both are
                 ready again, the first request on one group is a never-seen prefix (a cold start),
                 the first on the other a prefix stored in L3 before the restart.

Which group served a request is read from stage 0's prefix_queried_tokens, and round_robin is
steered with short fillers (`hicache_cluster.py`, which also starts, scrapes and restarts `up`).
Every request: 2 output tokens, `ignore_eos`, greedy, a fresh random suffix so whole prompts never
repeat. Bytes read from L3 per prompt token come from every stage's
pipeserve:hicache_l3_read_bytes_total. A short `pipeserve bench --workload multi-turn` run follows
(per-turn TTFT and cached share) unless --no-multi-turn.

Every wait has a deadline; `up` runs in its own session and is stopped (SIGTERM, then SIGKILL of its
process group) on exit, error or Ctrl-C.

    python benchmarks/hicache_multiturn.py [--reps 5] [--restarts 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from pathlib import Path

import httpx
import numpy as np
from hicache_cluster import SMOLLM2_VOCAB, Cluster, Up, ids, metric, restart_groups

GOAL_L3 = 0.30  # L3 hit TTFT <= 0.3 x recompute
GOAL_RESTART = 0.35  # first conversation after a restart <= 0.35 x a cold start


def tiers_delta(before: dict, after: dict) -> dict[str, float]:
    name = "pipeserve:prefix_cache_hits_total"
    return {t: metric(after, name, tier=t) - metric(before, name, tier=t) for t in ("l1", "l2", "l3")}


def load_seconds(before: dict, after: dict) -> float | None:
    """Mean time of the group's L3 loads between two scrapes of stage 0 (ordered -> every stage answered)."""
    n = "pipeserve:hicache_l3_group_load_seconds"
    count = metric(after, n + "_count") - metric(before, n + "_count")
    return (metric(after, n + "_sum") - metric(before, n + "_sum")) / count if count else None


def measured(c: Cluster, name: str | None, prompt: list[int], rng: np.random.Generator) -> dict:
    """A request on group `name` (None: wherever round_robin sends it, without fillers) with its hit
    tiers, the group's L3 load outcomes and mean load time, and the bytes its stages read from L3."""
    if name is not None:
        c.steer(name, rng)
    before = {n: c.stage0(n) for n in c.names}
    rb = {n: c.read_bytes(n) for n in c.names}
    res, served = c.send(prompt)
    if name is not None and served != name:
        raise RuntimeError(f"asked of {name}, served by {served}")
    b, after = before[served], c.stage0(served)
    outcomes = "pipeserve:hicache_l3_group_loads_total"
    loads = {
        k.split('outcome="')[1].split('"')[0]: v - b.get(k, 0.0)
        for k, v in after.items()
        if k.startswith(outcomes) and v - b.get(k, 0.0) > 0
    }
    res |= {"group": served, "hit_tokens": tiers_delta(b, after), "l3_loads": loads}
    res |= {"l3_load_s": load_seconds(b, after), "l3_read_bytes": c.read_bytes(served) - rb[served]}
    return res


def run_reps(c: Cluster, args: argparse.Namespace, rng: np.random.Generator) -> tuple[dict, list]:
    """Cases (a) recompute, (b) L3 and (c) L2, `args.reps` times; returns them and the prefixes used."""
    g0, g1 = c.names
    blocks = args.prefix_len // args.block_size
    cases: dict[str, list[dict]] = {"recompute": [], "l3": [], "l2": []}
    # Warm-up (untimed): each group's first-request costs, and a prefix for rep 0's L2 case.
    prev = ids(rng, args.prefix_len)
    measured(c, g0, prev + ids(rng, args.suffix_len), rng)
    measured(c, g1, ids(rng, 256), rng)
    prefixes = [prev]
    for rep in range(args.reps):
        prefix = ids(rng, args.prefix_len)
        stores = metric(c.stage0(g0), "pipeserve:hicache_l3_stores_total")
        cases["recompute"].append(measured(c, g0, prefix + ids(rng, args.suffix_len), rng))
        measured(c, g0, prefix + ids(rng, args.suffix_len), rng)  # seen again: stored (second-hit)
        c.wait_stored(g0, stores, blocks)
        cases["l3"].append(measured(c, g1, prefix + ids(rng, args.suffix_len), rng))
        cases["l2"].append(measured(c, g0, prev + ids(rng, args.suffix_len), rng))
        prefixes.append(prefix)
        prev = prefix
        r = cases["recompute"][-1]["ttft_s"], cases["l3"][-1]["ttft_s"], cases["l2"][-1]["ttft_s"]
        print(
            f"# rep {rep}: recompute {r[0]:.3f}s  L3 {r[1]:.3f}s  L2 {r[2]:.3f}s", file=sys.stderr, flush=True
        )
    return cases, prefixes


def run_restarts(c: Cluster, args: argparse.Namespace, rng: np.random.Generator, stored: list) -> dict:
    """Case (d): after each restart, the first request is a cold start, the second an L3-stored prefix."""
    out: dict[str, list] = {"cold_after_restart": [], "l3_after_restart": [], "restart_s": []}
    for k in range(args.restarts):
        out["restart_s"].append(restart_groups(c, args.ready_timeout_s))
        cold = measured(c, None, ids(rng, args.prefix_len) + ids(rng, args.suffix_len), rng)
        warm = measured(c, None, stored[k] + ids(rng, args.suffix_len), rng)
        if warm["group"] == cold["group"]:
            raise RuntimeError("both first requests went to one group")
        out["cold_after_restart"].append(cold)
        out["l3_after_restart"].append(warm)
        print(
            f"# restart {k} ({out['restart_s'][-1]:.0f}s): cold {cold['ttft_s']:.3f}s  "
            f"L3 {warm['ttft_s']:.3f}s",
            file=sys.stderr,
            flush=True,
        )
    return out


def stats(rows: list[dict]) -> dict:
    t = np.array([r["ttft_s"] for r in rows]) * 1000
    prompt = sum(r["prompt_tokens"] or 0 for r in rows)
    hits = {tier: sum(r["hit_tokens"][tier] for r in rows) for tier in ("l1", "l2", "l3")}
    loads = [r["l3_load_s"] for r in rows if r["l3_load_s"] is not None]
    outcomes: dict[str, float] = {}
    for r in rows:
        for k, v in r["l3_loads"].items():
            outcomes[k] = outcomes.get(k, 0) + v
    return {
        "n": len(rows),
        "ttft_p50_ms": float(np.percentile(t, 50)),
        "ttft_p99_ms": float(np.percentile(t, 99)),
        "cached_share": sum(r["cached_tokens"] or 0 for r in rows) / prompt if prompt else None,
        "hit_tokens": hits,
        "requests_hit": {tier: sum(r["hit_tokens"][tier] > 0 for r in rows) for tier in ("l1", "l2", "l3")},
        "l3_outcomes": outcomes,
        "l3_load_ms_mean": 1000 * float(np.mean(loads)) if loads else None,
        "l3_read_bytes_per_prompt_token": sum(r["l3_read_bytes"] for r in rows) / prompt if prompt else None,
    }


def multi_turn_run(url: str, seed: int) -> dict:
    """`pipeserve bench --workload multi-turn` on the same `up`: 4 conversations x 3 turns, one at a time."""
    from pipeserve.bench import multiturn
    from pipeserve.bench.serving import add_bench_parser, build_conversations

    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    argv = ["bench", "--url", url, "--workload", "multi-turn", "--num-conversations", "4", "--num-turns", "3"]
    argv += ["--concurrency", "1", "--input-len", "64", "--output-len", "16", "--range-ratio", "0"]
    argv += ["--vocab-size", str(SMOLLM2_VOCAB), "--warmup", "1", "--seed", str(seed), "--timeout-s", "300"]
    bench = parser.parse_args(argv)
    _, summary = asyncio.run(multiturn.serve(bench, build_conversations(bench)))
    summary["command"] = "pipeserve " + " ".join(argv)
    return summary


def _f(v: float | None, digits: int = 0) -> str:
    return "n/a" if v is None else f"{v:,.{digits}f}"


def report(s: dict[str, dict], restart_s: list[float]) -> list[str]:
    rows = [
        ("recompute", "(a) recompute: prefix never seen"),
        ("l3", "(b) L3 hit: stored by group 0, asked on group 1"),
        ("l2", "(c) L2 hit: evicted from L1, same group"),
        ("cold_after_restart", "(d) first request after a restart, never-seen prefix (cold start)"),
        ("l3_after_restart", "(d) first request after a restart, prefix in L3"),
    ]
    lines = [
        "| case | n | TTFT p50 (ms) | TTFT p99 (ms) | cached | hit tokens l1/l2/l3 | L3 loads "
        "| L3 load (ms, mean) | L3 bytes read / prompt token |",
        "|---|---:|---:|---:|---:|---|---|---:|---:|",
    ]
    for key, label in rows:
        if key not in s:
            continue
        st = s[key]
        h = st["hit_tokens"]
        cached = "n/a" if st["cached_share"] is None else f"{100 * st['cached_share']:.0f}%"
        cells = [label, str(st["n"]), _f(st["ttft_p50_ms"]), _f(st["ttft_p99_ms"]), cached]
        loads = " ".join(f"{k} {v:.0f}" for k, v in sorted(st["l3_outcomes"].items())) or "-"
        cells += [f"{h['l1']:.0f}/{h['l2']:.0f}/{h['l3']:.0f}", loads, _f(st["l3_load_ms_mean"])]
        cells.append(_f(st["l3_read_bytes_per_prompt_token"]))
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for num, den, goal, what in (
        ("l3", "recompute", GOAL_L3, "L3 hit / recompute"),
        ("l2", "recompute", None, "L2 hit / recompute"),
        ("l3_after_restart", "cold_after_restart", GOAL_RESTART, "after restart, L3 / cold start"),
    ):
        if num in s and den in s:
            ratio = s[num]["ttft_p50_ms"] / s[den]["ttft_p50_ms"]
            verdict = "" if goal is None else f" (goal <= {goal}: {'met' if ratio <= goal else 'NOT met'})"
            lines.append(f"- {what}, TTFT p50: **{ratio:.3f}x**{verdict}")
    # The tier each case is about must have served it: say how often it did (the brief's check).
    for key, tier in (("l3", "l3"), ("l2", "l2"), ("l3_after_restart", "l3")):
        if key in s:
            hit, n = s[key]["requests_hit"][tier], s[key]["n"]
            note = "" if hit == n else " — the other requests were not served from that tier"
            lines.append(f"- {key}: {hit} of {n} requests had {tier} hit tokens{note}")
    if restart_s:
        lines.append(f"- restart to ready (both groups): {', '.join(f'{t:.0f}s' for t in restart_s)}")
    return lines


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: up's, SmolLM2-135M)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--restarts", type=int, default=2)
    ap.add_argument("--prefix-len", type=int, default=2048)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-kv-blocks", type=int, default=192, help="L1 per stage: one 2k prefix and a bit")
    ap.add_argument("--host-cache-gb", type=float, default=0.5, help="L2 per stage")
    ap.add_argument("--up-arg", action="append", default=[], help="one more argument for pipeserve up")
    ap.add_argument("--ready-timeout-s", type=float, default=300)
    ap.add_argument("--no-multi-turn", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-dir", default=None, help="up's logs (default: a new temporary directory)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.reps < 1 or args.prefix_len % args.block_size:
        ap.error("--reps must be >= 1 and --prefix-len a multiple of --block-size")
    import tempfile

    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="hicache-bench-"))
    argv = ["--replicas", "2", "--policy", "round_robin", "--hicache-url", "local"]
    argv += ["--num-kv-blocks", str(args.num_kv_blocks), "--host-cache-gb", str(args.host_cache_gb)]
    # One request may fill L1 (up refuses a pool smaller than one request of max_model_len).
    argv += [
        "--block-size",
        str(args.block_size),
        "--max-model-len",
        str(args.num_kv_blocks * args.block_size),
    ]
    argv += [*(["--model", args.model] if args.model else []), *args.up_arg]
    signal.signal(signal.SIGTERM, _interrupt)  # a SIGTERM unwinds through the finally that stops `up`
    rng = np.random.default_rng(args.seed)
    began = time.monotonic()
    up = Up(argv, log_dir)
    print(f"# pipeserve up {' '.join(argv)} (logs: {log_dir})", file=sys.stderr, flush=True)
    try:
        up.wait_ready(args.ready_timeout_s)
        model = httpx.get(up.url + "/v1/models", timeout=10, trust_env=False).json()["data"][0]["id"]
        c = Cluster(up, model)
        cases, prefixes = run_reps(c, args, rng)
        restarts = run_restarts(c, args, rng, prefixes[1:]) if args.restarts > 0 else {"restart_s": []}
        mt = None if args.no_multi_turn else multi_turn_run(up.url, args.seed + 7)
    finally:
        up.stop()
    raw = {**cases, **{k: v for k, v in restarts.items() if k != "restart_s"}}
    summary = {k: stats(v) for k, v in raw.items() if v}
    lines = [f"pipeserve up {' '.join(argv)}", "", *report(summary, restarts["restart_s"])]
    if mt is not None:
        from pipeserve.bench import multiturn

        lines += ["", f"`{mt['command']}`", "", *multiturn.turn_table_md(mt)]
    lines.append(f"\n(total {time.monotonic() - began:.0f}s)")
    print("\n".join(lines))
    if args.json:
        doc = {"args": vars(args), "up_args": argv, "summary": summary, "raw": raw, "multi_turn": mt}
        doc["restart_s"] = restarts["restart_s"]
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
