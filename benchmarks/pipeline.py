"""Pipeline groups at saturation: output tokens/s, each stage's busy ratio and peak RSS.

For each (model, S) — S = 1 and 2 on the main model, S = 1, 2 and 4 on the
small demo model — a fresh driver process runs `LLM(model, stages=S)` with
`num_threads = cores // S` per stage (so the stages together use the machine's
cores; S = 4 on 2 cores has to oversubscribe) and the same KV token capacity
(the group's KV budget split over its stages), and drives its engine in a
closed loop: `concurrency` requests are in the system at all times (a new one
arrives when one finishes) until `requests` have arrived; greedy, `ignore_eos`,
so each request produces exactly its output length.

Reported per run:
* whole-run wall time and useful output tokens/s; S=k relative to S=1;
* at saturation — the window from the `concurrency/2`-th completion until the
  last request arrives, while `concurrency` requests are in the system — the
  output tokens/s and each stage's busy ratio (seconds executing plans; stage 0
  also scheduling — over wall seconds, from the stage reports that travel
  with every result);
* each stage's peak RSS (VmHWM) against 1.25 x (its own weights + its own KV
  pool) + 300 MB.

    python benchmarks/pipeline.py            # main + small model (~12 min on 2 cores)
    python benchmarks/pipeline.py --quick    # small model only
    python benchmarks/pipeline.py --json results.json
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from offline_throughput import make_workload

MIB = 1 << 20
RSS_SLACK_BYTES = 300 * 1000 * 1000
MODELS = {
    # name: (hidden, layers, heads, kv_heads, requests, concurrency, prompt_len, output_len,
    #        KV cache GB of the whole group, split evenly over its stages)
    "main": (1024, 12, 16, 4, 288, 96, (32, 256), (64, 128), 1.0),
    "small": (None, None, None, None, 288, 96, (16, 128), (32, 64), 0.2),
}


def model_dir(name: str) -> Path:
    from pipeserve.model.demo import DemoSpec, write_demo_model

    home = Path(os.environ.get("PIPESERVE_HOME", Path.home() / ".cache" / "pipeserve"))
    hidden, layers, heads, kv_heads, *_ = MODELS[name]
    path = home / f"pipeline-bench-{name}"
    if not (path / "model.safetensors").is_file():
        spec = (
            DemoSpec()
            if hidden is None
            else DemoSpec(
                hidden=hidden,
                layers=layers,
                heads=heads,
                kv_heads=kv_heads,
                intermediate=int(hidden * 8 / 3 // 16 * 16),
            )
        )
        print(f"# writing {name} model to {path}", file=sys.stderr, flush=True)
        write_demo_model(path, spec)
    return path


def tensor_bytes(path: Path) -> dict[str, int]:
    """tensor name -> bytes, from the safetensors header (no weights read)."""
    with open(path / "model.safetensors", "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}


def stage_bounds(engine: Any, path: Path) -> list[dict[str, int]]:
    """Each stage's own weights and KV pool bytes, and its RSS bound."""
    from pipeserve.model.loader import stage_tensor_names
    from pipeserve.model.stage_model import StageSpec
    from pipeserve.stage.assemble import layer_split
    from pipeserve.worker.kv_cache import block_bytes

    cfg, config = engine.model_config, engine.config
    sizes = tensor_bytes(path)
    out = []
    for rank, (lo, hi) in enumerate(layer_split(config, cfg)):
        spec = StageSpec(rank, config.stages, lo, hi)
        weights = sum(sizes[n] for n in stage_tensor_names(cfg, spec, sizes))
        pool = block_bytes(cfg, hi - lo, config.block_size) * engine.num_total_blocks
        out.append(
            {"weights": weights, "pool": pool, "bound": int(1.25 * (weights + pool)) + RSS_SLACK_BYTES}
        )
    return out


def vm_hwm(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmHWM not found")


def run_child(name: str, stages: int, max_inflight: int | None) -> dict[str, Any]:
    from pipeserve import LLM, SamplingParams

    path = model_dir(name)
    *_, n, concurrency, prompt_len, output_len, kv_gb = MODELS[name]
    cores = os.cpu_count() or 1
    config = json.loads((path / "config.json").read_text())
    work = make_workload(n, prompt_len, output_len, config["vocab_size"], seed=7)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in work.output_lens]
    with LLM(
        str(path),
        stages=stages,
        num_threads=max(1, cores // stages),
        kv_cache_gb=kv_gb / stages,  # the same token capacity for every S
        max_model_len=512,
        max_inflight=max_inflight,
    ) as llm:
        llm.generate(work.prompts[:4], params[:4])  # warm-up, not timed
        eng = llm.engine
        reqs = [eng.add_request(work.prompts[i], params[i]) for i in range(concurrency)]
        done = 0
        window: dict[str, Any] = {}

        def mark(key: str) -> None:
            window[key] = (
                time.perf_counter(),
                list(eng.stage_reports),
                sum(len(r.output_token_ids) for r in reqs),
            )

        t0 = time.perf_counter()
        while eng.has_unfinished():
            for _ in eng.step():
                done += 1
                if len(reqs) < n:
                    reqs.append(eng.add_request(work.prompts[len(reqs)], params[len(reqs)]))
                    if len(reqs) == n:
                        mark("end")
                if done == concurrency // 2:
                    mark("start")
        wall = time.perf_counter() - t0
        tokens = sum(len(r.output_token_ids) for r in reqs)
        assert tokens == work.useful_tokens
        (ts, before, tok0), (te, after, tok1) = window["start"], window["end"]
        busy = [(a.busy_s - b.busy_s) / (a.wall_s - b.wall_s) for a, b in zip(after, before, strict=True)]
        bounds = stage_bounds(eng, path)
        pids = ["self"] + ([llm.group.pids[r] for r in range(1, stages)] if llm.group else [])
        rss = [vm_hwm(p) for p in pids]
    return {
        "model": name,
        "stages": stages,
        "max_inflight": llm.engine.executor.max_inflight,
        "threads_per_stage": max(1, cores // stages),
        "requests": n,
        "concurrency": concurrency,
        "output_tokens": tokens,
        "wall_s": wall,
        "tok_per_s": tokens / wall,
        "saturated_s": te - ts,
        "saturated_tok_per_s": (tok1 - tok0) / (te - ts),
        "busy": busy,
        "peak_rss": rss,
        "bounds": bounds,
        "tokens": [r.output_token_ids for r in reqs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="the small model only")
    parser.add_argument("--json", default=None)
    parser.add_argument("--only", choices=sorted(MODELS), default=None, help="one model only")
    parser.add_argument(
        "--extra-inflight",
        action="store_true",
        help="also run S > 1 with max_inflight = S + 1 (one microbatch more than stages)",
    )
    parser.add_argument("--child", nargs=3, metavar=("MODEL", "STAGES", "INFLIGHT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        inflight = int(args.child[2]) or None
        print(json.dumps(run_child(args.child[0], int(args.child[1]), inflight)))
        return
    runs = ([] if args.quick else [("main", 1), ("main", 2)]) + [("small", 1), ("small", 2), ("small", 4)]
    if args.only:
        runs = [r for r in runs if r[0] == args.only]
    plan = [(name, stages, 0) for name, stages in runs]
    if args.extra_inflight:
        plan += [(name, stages, stages + 1) for name, stages in runs if stages > 1]
    results = []
    for name, stages, inflight in plan:
        model_dir(name)  # written once, outside the timed children
        out = subprocess.run(
            [sys.executable, __file__, "--child", name, str(stages), str(inflight)],
            capture_output=True,
            text=True,
            check=False,
        )
        if out.returncode:
            sys.exit(f"{name} S={stages} failed:\n{out.stderr[-3000:]}")
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
        report(results[-1], results)
    if args.json:
        Path(args.json).write_text(
            json.dumps([{k: v for k, v in r.items() if k != "tokens"} for r in results])
        )


def report(r: dict[str, Any], results: list[dict[str, Any]]) -> None:
    base = next(x for x in results if x["model"] == r["model"] and x["stages"] == 1)
    same = r["tokens"] == base["tokens"]
    print(
        f"{r['model']:5s} S={r['stages']} inflight={r['max_inflight']} "
        f"threads/stage={r['threads_per_stage']}: "
        f"{r['wall_s']:6.1f} s {r['tok_per_s']:7.1f} tok/s "
        f"(x{r['tok_per_s'] / base['tok_per_s']:.2f} of S=1); "
        f"saturated {r['saturated_s']:5.1f} s {r['saturated_tok_per_s']:7.1f} tok/s "
        f"(x{r['saturated_tok_per_s'] / base['saturated_tok_per_s']:.2f}); "
        f"outputs {'==' if same else '!='} S=1",
        flush=True,
    )
    for rank, (busy, rss, b) in enumerate(zip(r["busy"], r["peak_rss"], r["bounds"], strict=True)):
        print(
            f"    stage {rank}: busy {100 * busy:5.1f} %  peak RSS {rss / MIB:7.1f} MiB  "
            f"bound {b['bound'] / MIB:7.1f} MiB ({100 * rss / b['bound']:.0f} %; "
            f"weights {b['weights'] / MIB:.1f} + KV {b['pool'] / MIB:.1f} MiB)",
            flush=True,
        )


if __name__ == "__main__":
    main()
