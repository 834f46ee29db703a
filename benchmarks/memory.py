"""Total RSS of `pipeserve up --stages 1` with a KV pool of a fixed token capacity, per KV dtype.

For each `--kv-cache-dtype` it starts `pipeserve up` on the benchmark checkpoint with
`--num-kv-blocks tokens/16` (default 16,384 tokens: llama-server's `-c 16384`), and
reads the summed RSS of the process tree (router + supervisor, stage, local Redis):
once ready, and after `--fill` requests that together hold the whole pool (prompt
token ids, 1 output token each, `--max-num-seqs` large enough to hold them at once),
which makes every page of the pool resident — the pool's pages are resident only
once written (docs/memory.md). The peak over the run (VmHWM of each process,
summed) is printed too.

    python benchmarks/memory.py
    python benchmarks/memory.py --dtypes float32 float16 --tokens 16384
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from startup import Up, bench_model, complete, tree_rss

BLOCK = 16


def tree_hwm(pid: int) -> int:
    """Summed peak RSS (VmHWM) of `pid` and its descendants."""
    total = 0
    root = psutil.Process(pid)
    for p in [root, *root.children(recursive=True)]:
        try:
            with open(f"/proc/{p.pid}/status") as f:
                total += next(int(x.split()[1]) * 1024 for x in f if x.startswith("VmHWM:"))
        except (OSError, StopIteration):
            pass
    return total


def measure(model: Path, dtype: str, tokens: int, seqs: int, tmp: Path) -> dict:
    extra = [
        "--num-kv-blocks",
        str(tokens // BLOCK),
        "--kv-cache-dtype",
        dtype,
        "--max-num-seqs",
        str(seqs),
        "--no-enable-prefix-caching",
    ]
    body = {"model": str(model), "prompt": [1, 2, 3], "max_tokens": 1}
    up = Up(model, 1, extra, tmp / f"up-{dtype}.log")
    try:
        ready_s = up.wait_first_200(180.0, body)
        ready = tree_rss(up.proc.pid)
        # `seqs` prompts of tokens/seqs - 16 ids each, at once: every block of the pool is written.
        length = tokens // seqs - BLOCK
        fill = [
            {"model": str(model), "prompt": [(7 * i + j) % 1000 + 3 for j in range(length)], "max_tokens": 1}
            for i in range(seqs)
        ]
        with ThreadPoolExecutor(seqs) as pool:
            codes = list(pool.map(lambda b: complete(up.url, b, 300.0), fill))
        filled = tree_rss(up.proc.pid)
        peak = tree_hwm(up.proc.pid)
    finally:
        up.stop()
    return {
        "kv_cache_dtype": dtype,
        "tokens": tokens,
        "ready_s": round(ready_s, 2),
        "rss_ready_gb": round(ready / 1e9, 3),
        "rss_filled_gb": round(filled / 1e9, 3),
        "peak_gb": round(peak / 1e9, 3),
        "fill_codes": {str(c): codes.count(c) for c in sorted(set(codes))},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", nargs="+", default=["float32", "float16"])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--fill-seqs", type=int, default=16, help="concurrent requests that fill the pool")
    p.add_argument("--model", help="checkpoint dir (default: the benchmark checkpoint)")
    args = p.parse_args()
    model = Path(args.model) if args.model else bench_model()
    with tempfile.TemporaryDirectory(prefix="pipeserve-memory-") as tmp:
        for dtype in args.dtypes:
            print(json.dumps(measure(model, dtype, args.tokens, args.fill_seqs, Path(tmp))), flush=True)


if __name__ == "__main__":
    main()
