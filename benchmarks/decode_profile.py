"""Decode-step profile and single-stream speed of the CPU engine (issue 14).

On the offline benchmark's checkpoint (written by offline_throughput.py on first use: hidden 1024,
12 layers, 16 / 4 heads, float32) this measures, in one process:

* the machine's memory read bandwidth (median of repeated sums over a 1 GiB tensor), and so the
  single-stream bound: weight bytes read per token x tok/s <= bandwidth;
* per decode batch size (default 1 and 16, every row at context `--context`): the median wall time
  of an engine step, split into schedule / prepare / forward / sample, and a torch.profiler
  breakdown of forward's ops (matmul, attention, KV gather, norms/rotary/SiLU, KV store, other);
  "python" is the step's wall time minus the time inside torch ops;
* with `--variants ref,fast`, the same decode steps with the kernel ops pipeserve_kernels/cpu.py provides
  swapped between reference.py's and the exported (dispatched) ones, rounds interleaved so a
  shared machine's load falls on both alike.

    python benchmarks/decode_profile.py                      # profile, batch 1 and 16
    python benchmarks/decode_profile.py --variants ref,fast  # A/B, interleaved
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
import offline_throughput as ot  # the checkpoint writer and its defaults

# torch.profiler op name -> category (self CPU time); anything else is "other ops".
CATEGORIES = {
    "matmul": (
        "mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear",
        "aten::baddbmm",
    ),
    "attention (SDPA)": ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_softmax"),
    "KV gather": ("aten::index_select", "aten::index"),
    "KV store": ("aten::index_copy_",),
    "norms / rotary / SiLU": (
        "aten::mul", "aten::add", "aten::pow", "aten::mean", "aten::rsqrt", "aten::cat", "aten::neg",
        "aten::silu", "aten::_to_copy", "aten::copy_", "aten::mul_", "aten::add_", "aten::silu_",
        "aten::addcmul", "aten::sub", "aten::roll",
    ),
}  # fmt: skip


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def read_bandwidth(gib: float = 1.0, reps: int = 7) -> float:
    """Bytes/s of a float32 sum over `gib` GiB (median of reps): the machine's read rate."""
    x = torch.ones(int(gib * (1 << 30)) // 4)
    x.sum()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return x.numel() * 4 / statistics.median(times)


def category(op: str) -> str:
    return next((c for c, ops in CATEGORIES.items() if op in ops), "other ops")


class StepTimer:
    """Per-phase wall time of engine steps, by wrapping the engine's methods in place."""

    def __init__(self, engine: Any) -> None:
        self.seconds: dict[str, list[float]] = defaultdict(list)
        sched, runner = engine.scheduler, engine.executor.runner
        for obj, name in ((sched, "schedule"), (runner, "prepare"), (runner, "forward"), (runner, "sample")):
            self._wrap(obj, name)

    def _wrap(self, obj: object, name: str) -> None:
        fn = getattr(obj, name)

        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds[name].append(time.perf_counter() - t0)

        setattr(obj, name, timed)

    def reset(self) -> None:
        self.seconds.clear()


def start_decodes(llm: Any, batch: int, context: int, steps: int, seed: int) -> list[Any]:
    """Queue `batch` requests of `context` prompt tokens and step until every one decodes."""
    from pipeserve import SamplingParams

    rng = random.Random(seed)
    vocab = llm.engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    reqs = [
        llm.engine.add_request([rng.randrange(vocab) for _ in range(context)], params) for _ in range(batch)
    ]
    while not all(r.output_token_ids for r in reqs):
        llm.engine.step()
    return reqs


def drain(llm: Any) -> None:
    while llm.engine.has_unfinished():
        llm.engine.step()


def timed_steps(llm: Any, n: int, clock: Any = time.perf_counter) -> list[float]:
    out = []
    for _ in range(n):
        t0 = clock()
        llm.engine.step()
        out.append(clock() - t0)
    return out


def profile_batch(llm: Any, timer: StepTimer, batch: int, args: argparse.Namespace) -> None:
    start_decodes(llm, batch, args.context, 2 * args.steps, args.seed + batch)
    timer.reset()
    walls = timed_steps(llm, args.steps)
    phases = {k: statistics.median(v) for k, v in timer.seconds.items()}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        prof_walls = timed_steps(llm, args.steps)
    drain(llm)
    by_cat: dict[str, float] = defaultdict(float)
    calls = 0
    for e in prof.key_averages():
        by_cat[category(e.key)] += e.self_cpu_time_total / 1e6 / args.steps
        calls += e.count
    step = statistics.median(walls)
    in_ops = sum(by_cat.values())
    layers = llm.engine.model_config.num_layers
    print(
        f"\nbatch {batch}, context {args.context}: step {1000 * step:.2f} ms median "
        f"({batch / step:.1f} tok/s); under the profiler {1000 * statistics.median(prof_walls):.2f} ms"
    )
    for k in ("schedule", "prepare", "forward", "sample"):
        print(f"  {k:<10} {1000 * phases.get(k, 0.0):>8.3f} ms")
    per_step = calls / args.steps
    print(f"  ops per step (profiled, self CPU time; per layer = / {layers}; {per_step:.0f} op calls):")
    for cat, s in sorted(by_cat.items(), key=lambda kv: -kv[1]):
        print(f"    {cat:<24} {1000 * s:>8.3f} ms  {1000 * s / layers:>7.3f} ms/layer")
    py = statistics.median(prof_walls) - in_ops
    print(f"    {'python (wall - ops)':<24} {1000 * py:>8.3f} ms  {1000 * py / layers:>7.3f} ms/layer")
    if args.top_ops:
        print(f"  most called ops (calls per layer, self CPU ms per step), top {args.top_ops}:")
        events = sorted(prof.key_averages(), key=lambda e: -e.count)[: args.top_ops]
        for e in events:
            per_layer = e.count / args.steps / layers
            print(f"    {e.key:<48} {per_layer:>6.1f}  {e.self_cpu_time_total / 1e3 / args.steps:>8.3f}")


def ab(llm: Any, args: argparse.Namespace) -> None:
    """Decode steps with the kernel ops of each variant, rounds interleaved; medians.

    ref: every op from reference.py; fast: the exported (dispatched) ops, pipeserve_kernels/cpu.py on a CPU.
    """
    import pipeserve_kernels
    from pipeserve_kernels import cpu, reference

    names = [n for n in pipeserve_kernels.__all__ if hasattr(cpu, n)]
    variants = {
        "ref": {n: getattr(reference, n) for n in names},
        "fast": {n: getattr(pipeserve_kernels, n) for n in names},
    }
    chosen = {v: variants[v] for v in args.variants.split(",")}
    for batch in args.batches:
        results: dict[str, list[float]] = defaultdict(list)
        start_decodes(llm, batch, args.context, len(chosen) * args.rounds * args.steps + 2, args.seed)
        for _ in range(args.rounds):
            for name, fns in chosen.items():
                for op, fn in fns.items():  # layers.py looks them up on the module at each call
                    setattr(pipeserve_kernels, op, fn)
                results[name] += timed_steps(llm, args.steps, CLOCKS[args.clock])
        for op, fn in variants["fast"].items():
            setattr(pipeserve_kernels, op, fn)
        drain(llm)
        line = ", ".join(
            f"{n} {1000 * statistics.median(v):.2f} ms ({batch / statistics.median(v):.1f} tok/s)"
            for n, v in results.items()
        )
        print(f"batch {batch}, context {args.context}, {args.clock} time per step: {line}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    p.add_argument("--context", type=int, default=256, help="prompt tokens of every decoding row")
    p.add_argument("--steps", type=int, default=20, help="decode steps per measurement")
    p.add_argument("--rounds", type=int, default=5, help="A/B rounds (--variants)")
    p.add_argument("--variants", help="e.g. ref,fast: A/B paged_attention_decode instead of profiling")
    p.add_argument("--threads", type=int)
    p.add_argument(
        "--clock",
        choices=CLOCKS,
        default="wall",
        help="A/B clock; cpu (process CPU time) with --threads 1 is robust to a loaded machine",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--top-ops", type=int, default=0, help="also list the N most called ops")
    p.add_argument("--model", help="another checkpoint (e.g. the default model's directory)")
    p.add_argument("--quantization", default="none", help="none | int8 | int4 | gguf")
    args = p.parse_args(argv)
    bench = ot.parse_args(["--threads", str(args.threads)] if args.threads else [])
    if args.model:
        bench.model_dir = args.model
    else:
        ot.ensure_model(bench)
    from pipeserve import LLM

    bw = read_bandwidth()
    llm = LLM(
        model=bench.model_dir,
        kv_cache_gb=0.5,
        max_num_seqs=64,
        num_threads=args.threads,
        quantization=args.quantization,
    )
    weights = llm.engine.executor.runner.model.weight_bytes()
    print(
        f"model {bench.model_dir}: weights {weights / 1e6:.0f} MB; read bandwidth {bw / 1e9:.1f} GB/s "
        f"-> single-stream bound {bw / weights:.1f} tok/s; {torch.get_num_threads()} threads"
    )
    start_decodes(llm, 1, 16, 4, args.seed)  # warm-up
    drain(llm)
    if args.variants:
        ab(llm, args)
        return 0
    timer = StepTimer(llm.engine)
    for batch in args.batches:
        profile_batch(llm, timer, batch, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
