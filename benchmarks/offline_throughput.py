"""Offline throughput: pipeserve's `LLM.generate` vs transformers' `generate`.

Both engines run the same deterministic workload — random token-id prompts,
greedy decoding, every request generating exactly its own output length
(`ignore_eos`) — on the same demo checkpoint in float32:

* pipeserve: all requests in one `LLM.generate` call (continuous batching).
* transformers: static batches of `--hf-batch-size` requests in arrival order,
  left-padded with an attention mask; each batch runs to the longest output
  length in it. Only each request's own output length counts as useful output,
  so padding and over-generation are HF's real cost.

Each engine runs in its own subprocess (model load and a tiny warm-up are not
timed) and reports wall time, useful output tokens/s and its peak RSS
(VmHWM). For pipeserve the peak RSS is checked against
1.25 x (weights + KV pool + 300 MB), both as measured and with the pool's
never-touched pages added (they are not resident until written). The greedy
outputs of the two engines are compared as a sanity check.

`--profile` instead runs pipeserve alone on a smaller workload and prints where
its time goes: per engine phase (schedule / prepare / forward / sample / ...)
and per torch op.

    python benchmarks/offline_throughput.py --quick
    python benchmarks/offline_throughput.py --json results.json
    python benchmarks/offline_throughput.py --profile
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ENGINES = ("pipeserve", "hf")
MIB = 1 << 20
RSS_SLACK_BYTES = 300 * 1000 * 1000
BUSY_WARNING = 0.05  # others' share of the CPUs above which timings are suspect
KERNEL_PREFIX = "  kernel "  # PhaseTimer keys of pipeserve_kernels functions

# Flags whose default depends on --quick: (full benchmark, quick sanity run).
SIZED_DEFAULTS: dict[str, tuple[Any, Any]] = {
    "hidden": (1024, 256),
    "layers": (12, 4),
    "heads": (16, 8),
    "kv_heads": (4, 4),
    "num_requests": (256, 16),
    "prompt_len": ((32, 512), (16, 128)),
    "output_len": ((64, 256), (16, 64)),
    "kv_cache_gb": (2.0, 0.25),
}


# --- workload ---------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def useful_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(
    n: int, prompt_len: tuple[int, int], output_len: tuple[int, int], vocab: int, seed: int
) -> Workload:
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    output_lens: list[int] = []
    for _ in range(n):
        prompts.append([rng.randrange(vocab) for _ in range(rng.randint(*prompt_len))])
        output_lens.append(rng.randint(*output_len))
    return Workload(prompts, output_lens)


def workload_for(args: argparse.Namespace, n: int, seed: int) -> Workload:
    config = json.loads((Path(args.model_dir) / "config.json").read_text())
    return make_workload(n, args.prompt_len, args.output_len, config["vocab_size"], seed)


# --- checkpoint -------------------------------------------------------------
def default_model_dir(args: argparse.Namespace) -> Path:
    home = Path(os.environ.get("PIPESERVE_HOME", Path.home() / ".cache" / "pipeserve"))
    return home / f"bench-h{args.hidden}-l{args.layers}-q{args.heads}-kv{args.kv_heads}"


def ensure_model(args: argparse.Namespace) -> None:
    """Write the demo checkpoint unless one of the requested size is there."""
    from pipeserve.model.demo import DemoSpec, write_demo_model

    path = Path(args.model_dir)
    want = {
        "hidden_size": args.hidden,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
    }
    cfg_path = path / "config.json"
    if cfg_path.is_file() and (path / "model.safetensors").is_file():
        have = json.loads(cfg_path.read_text())
        wrong = {k: have.get(k) for k, v in want.items() if have.get(k) != v}
        if wrong:
            sys.exit(f"{path} holds a different model ({wrong}); pass another --model-dir")
        return
    print(f"# writing demo checkpoint to {path}", file=sys.stderr, flush=True)
    write_demo_model(
        path,
        DemoSpec(
            layers=args.layers,
            hidden=args.hidden,
            intermediate=int(args.hidden * 8 / 3 // 16 * 16),  # as `pipeserve demo-model`
            heads=args.heads,
            kv_heads=args.kv_heads,
        ),
    )


# --- memory -----------------------------------------------------------------
def proc_status_bytes(field: str) -> int:
    """A memory line of /proc/self/status (VmHWM, VmRSS) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


@dataclass(frozen=True)
class CpuSnapshot:
    wall: float
    machine_busy: float  # CPU-seconds all processes used since boot
    own: float  # CPU-seconds this process used

    @classmethod
    def take(cls) -> CpuSnapshot:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
        idle = ticks[3] + ticks[4]  # idle + iowait
        t = os.times()
        return cls(time.perf_counter(), (sum(ticks) - idle) / os.sysconf("SC_CLK_TCK"), t.user + t.system)

    def others_share(self, end: CpuSnapshot) -> float:
        """Share of the machine's CPU capacity other processes used between self and end."""
        other = (end.machine_busy - self.machine_busy) - (end.own - self.own)
        return max(0.0, other / ((end.wall - self.wall) * (os.cpu_count() or 1)))


# --- engines (each runs in its own worker process) ----------------------------
def make_llm(args: argparse.Namespace) -> Any:
    from pipeserve import LLM

    return LLM(
        model=args.model_dir,
        kv_cache_gb=args.kv_cache_gb,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_threads=args.threads,
    )


def run_pipeserve(args: argparse.Namespace) -> dict[str, Any]:
    from pipeserve import SamplingParams

    work = workload_for(args, args.num_requests, args.seed)
    t0 = time.perf_counter()
    llm = make_llm(args)
    load_s = time.perf_counter() - t0
    llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    rss_ready = proc_status_bytes("VmRSS")
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in work.output_lens]
    print(f"# pipeserve: {len(work.prompts)} requests", file=sys.stderr, flush=True)
    start = CpuSnapshot.take()
    outs = llm.generate(work.prompts, params)
    end = CpuSnapshot.take()
    token_ids = [o.outputs[0].token_ids for o in outs]
    if [len(t) for t in token_ids] != work.output_lens:
        raise RuntimeError("pipeserve returned outputs of the wrong length")

    runner = llm.engine.executor.runner
    pool = runner.kv_pool
    pool_bytes = pool.numel() * pool.element_size()
    weights_bytes = runner.model.weight_bytes()
    peak_rss = proc_status_bytes("VmHWM")
    # Pages of the pool never written are not resident; write them all to see how much.
    rss_before = proc_status_bytes("VmRSS")
    pool.fill_(1.0)
    untouched_pool_bytes = max(0, proc_status_bytes("VmRSS") - rss_before)
    return {
        "wall_s": end.wall - start.wall,
        "others_cpu_share": start.others_share(end),
        "load_s": load_s,
        "useful_tokens": work.useful_tokens,
        "generated_tokens": sum(len(t) for t in token_ids),
        "peak_rss_bytes": peak_rss,
        "ready_rss_bytes": rss_ready,
        "untouched_pool_bytes": untouched_pool_bytes,
        "weights_bytes": weights_bytes,
        "kv_pool_bytes": pool_bytes,
        "kv_blocks": llm.engine.num_total_blocks,
        "preemptions": llm.engine.scheduler.num_preemptions,
        "threads": torch.get_num_threads(),
        "token_ids": token_ids,
    }


def run_hf(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    if args.threads:
        torch.set_num_threads(args.threads)
    work = workload_for(args, args.num_requests, args.seed)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
    load_s = time.perf_counter() - t0
    pad = model.generation_config.pad_token_id
    if pad is None:
        raise RuntimeError("the checkpoint's generation_config has no pad_token_id")

    def generate(prompts: list[list[int]], new_tokens: int) -> torch.Tensor:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(prompts):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=pad,
                # Never stop on EOS and leave its logit alone, as pipeserve's
                # ignore_eos does, so greedy outputs stay comparable.
                eos_token_id=None,
            )
        return out[:, width:]

    generate([[1, 2, 3, 4]], 4)
    token_ids: list[list[int]] = []
    generated = 0
    bs = args.hf_batch_size
    num_batches = -(-len(work.prompts) // bs)
    print(f"# hf: {len(work.prompts)} requests in {num_batches} batches", file=sys.stderr, flush=True)
    start = CpuSnapshot.take()
    for b in range(num_batches):
        prompts = work.prompts[b * bs : (b + 1) * bs]
        lens = work.output_lens[b * bs : (b + 1) * bs]
        new = generate(prompts, max(lens))
        generated += new.numel()
        token_ids += [row[:n] for row, n in zip(new.tolist(), lens, strict=True)]
        elapsed = time.perf_counter() - start.wall
        print(f"# hf: batch {b + 1}/{num_batches} done, {elapsed:.0f}s", file=sys.stderr, flush=True)
    end = CpuSnapshot.take()
    return {
        "wall_s": end.wall - start.wall,
        "others_cpu_share": start.others_share(end),
        "load_s": load_s,
        "useful_tokens": work.useful_tokens,
        "generated_tokens": generated,
        "peak_rss_bytes": proc_status_bytes("VmHWM"),
        "threads": torch.get_num_threads(),
        "token_ids": token_ids,
    }


def run_worker(engine: str, argv: list[str]) -> dict[str, Any]:
    """Run one engine in a fresh Python process (this script with --worker-result)."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), *argv]
        subprocess.run([*cmd, "--only", engine, "--worker-result", str(result)], check=True)
        return json.loads(result.read_text())


# --- report -----------------------------------------------------------------
def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    """Identical outputs, and the mean fraction of each output before the first difference."""
    identical = sum(x == y for x, y in zip(a, b, strict=True))
    prefix = []
    for x, y in zip(a, b, strict=True):
        same = next((i for i, (p, q) in enumerate(zip(x, y, strict=True)) if p != q), len(x))
        prefix.append(same / len(x))
    return {"identical": identical, "requests": len(a), "mean_prefix_frac": sum(prefix) / len(a)}


def report(
    args: argparse.Namespace, env: dict[str, str], results: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    names = {"pipeserve": "pipeserve", "hf": "transformers"}
    threads = next(iter(results.values()))["threads"]
    print(
        f"\ncode {env['git']}, torch {env['torch']}, transformers {env['transformers']}, {env['cpus']} CPUs"
    )
    print(f"model {args.model_dir}: {args.num_params / 1e6:.1f}M params, float32")
    print(
        f"workload: {args.num_requests} requests, prompt len {args.prompt_len}, "
        f"output len {args.output_len}, seed {args.seed}, {threads} torch threads"
    )
    header = ("engine", "wall s", "useful tok", "tok/s", "generated", "peak RSS MiB", "others' CPU")
    print("\n{:<13} {:>9} {:>11} {:>9} {:>10} {:>13} {:>12}".format(*header))
    for engine, r in results.items():
        r["tok_per_s"] = r["useful_tokens"] / r["wall_s"]
        print(
            f"{names[engine]:<13} {r['wall_s']:>9.1f} {r['useful_tokens']:>11} {r['tok_per_s']:>9.1f} "
            f"{r['generated_tokens']:>10} {r['peak_rss_bytes'] / MIB:>13.0f} {r['others_cpu_share']:>12.0%}"
        )
    if any(r["others_cpu_share"] > BUSY_WARNING for r in results.values()):
        print(f"WARNING: other processes used over {BUSY_WARNING:.0%} of the CPUs during a run; rerun")
    summary: dict[str, Any] = {
        "environment": env,
        "args": {k: v for k, v in vars(args).items() if k not in ("worker_result", "only")},
        "engines": {e: {k: v for k, v in r.items() if k != "token_ids"} for e, r in results.items()},
    }
    if "pipeserve" in results and "hf" in results:
        ratio = results["pipeserve"]["tok_per_s"] / results["hf"]["tok_per_s"]
        agree = agreement(results["pipeserve"]["token_ids"], results["hf"]["token_ids"])
        print(f"\nthroughput ratio pipeserve / transformers: {ratio:.2f}x")
        print(
            f"greedy agreement: {agree['identical']}/{agree['requests']} outputs identical, "
            f"mean {100 * agree['mean_prefix_frac']:.1f}% of each output before the first difference"
        )
        summary.update(ratio=ratio, agreement=agree)
    if "pipeserve" in results:
        r = results["pipeserve"]
        bound = 1.25 * (r["weights_bytes"] + r["kv_pool_bytes"] + RSS_SLACK_BYTES)
        print(
            f"\npipeserve memory: weights {r['weights_bytes'] / MIB:.0f} MiB, KV pool "
            f"{r['kv_pool_bytes'] / MIB:.0f} MiB ({r['kv_blocks']} blocks), preemptions {r['preemptions']}"
        )
        print(f"  bound 1.25 x (weights + pool + 300 MB) = {bound / MIB:.0f} MiB")
        peak = r["peak_rss_bytes"]
        worst = peak + r["untouched_pool_bytes"]
        print(f"  RSS when ready (loaded, warmed up): {r['ready_rss_bytes'] / MIB:.0f} MiB")
        print(f"  peak RSS as measured: {peak / MIB:.0f} MiB ({peak / bound:.0%} of bound)")
        print(
            f"  pool pages never touched: {r['untouched_pool_bytes'] / MIB:.0f} MiB; peak + those: "
            f"{worst / MIB:.0f} MiB ({worst / bound:.0%} of bound)"
        )
        summary["rss_bound_bytes"] = bound
    return summary


# --- profile ----------------------------------------------------------------
class PhaseTimer:
    """Wall time per engine phase, by wrapping methods and kernel functions in place."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.rows: dict[str, int] = defaultdict(int)

    def wrap(self, obj: object, name: str, key: str | Callable[..., str]) -> None:
        fn = getattr(obj, name)

        def timed(*a: Any, **kw: Any) -> Any:
            k = key if isinstance(key, str) else key(*a)
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds[k] += time.perf_counter() - t0
                self.calls[k] += 1

        setattr(obj, name, timed)

    def forward_key(self, step: Any, *_: Any) -> str:
        rows = step.inputs.shape[0]
        key = "forward, decode-only steps" if step.batch.num_decode == rows else "forward, steps with prefill"
        self.rows[key] += rows
        return key

    def print(self, total: float) -> None:
        def line(key: str, s: float, calls: int | None = None) -> None:
            per_call = f"{1000 * s / calls:>9.1f}" if calls else ""
            rows = f"{self.rows[key] / calls:>10.1f}" if calls and key in self.rows else ""
            print(f"  {key:<46} {calls or '':>6} {s:>8.2f} {100 * s / total:>6.1f} {per_call:>9} {rows}")

        print(f"  {'phase':<46} {'calls':>6} {'s':>8} {'%':>6} {'ms/call':>9} {'rows/call':>10}")
        kernels = {k: v for k, v in self.seconds.items() if k.startswith(KERNEL_PREFIX)}
        phases = {k: v for k, v in self.seconds.items() if k not in kernels}
        for key, s in sorted(phases.items(), key=lambda kv: -kv[1]):
            line(key, s, self.calls[key])
        line("other (generate loop)", total - sum(phases.values()))
        forward = sum(v for k, v in phases.items() if k.startswith("forward"))
        print("  forward, split by kernel (both kinds of step):")
        for key, s in sorted(kernels.items(), key=lambda kv: -kv[1]):
            line(key, s, self.calls[key])
        line("  rest: projections (matmuls), embedding, adds", forward - sum(kernels.values()))


def profile(args: argparse.Namespace) -> None:
    import pipeserve_kernels
    from pipeserve import SamplingParams

    def params(work: Workload) -> list[SamplingParams]:
        return [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in work.output_lens]

    llm = make_llm(args)
    llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    n = args.profile_requests
    work = workload_for(args, n, args.seed)
    print(f"profile: {n} requests, {work.useful_tokens} output tokens, {torch.get_num_threads()} threads")

    timer = PhaseTimer()
    sched, runner = llm.engine.scheduler, llm.engine.executor.runner
    for obj, name in ((sched, "schedule"), (sched, "update"), (runner, "apply"), (runner, "prepare")):
        timer.wrap(obj, name, name)
    timer.wrap(runner, "forward", timer.forward_key)
    timer.wrap(runner, "sample", "sample")
    for name in pipeserve_kernels.__all__:  # layers.py looks these up on the module at each call
        timer.wrap(pipeserve_kernels, name, KERNEL_PREFIX + name)
    start = CpuSnapshot.take()
    llm.generate(work.prompts, params(work))
    end = CpuSnapshot.take()
    total = end.wall - start.wall
    print(
        f"\nphases (wall {total:.1f}s, {work.useful_tokens / total:.1f} tok/s, "
        f"others' CPU share {start.others_share(end):.0%}):"
    )
    timer.print(total)
    print(f"  preemptions: {llm.engine.scheduler.num_preemptions}")
    if args.profile_top == 0:
        return

    # Same sizes, other tokens (a rerun of the same prompts would hit the prefix cache).
    work = workload_for(args, n, args.seed + 1)
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as prof:
        llm.generate(work.prompts, params(work))
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    op_total = sum(e.self_cpu_time_total for e in events)
    print(f"\ntorch ops by self CPU time (second run, profiled; ops total {op_total / 1e6:.1f}s):")
    print(f"  {'op':<48} {'calls':>7} {'s':>8} {'%':>6}")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[: args.profile_top]:
        s = e.self_cpu_time_total / 1e6
        print(f"  {e.key[:48]:<48} {e.count:>7} {s:>8.2f} {100 * e.self_cpu_time_total / op_total:>6.1f}")


# --- main -------------------------------------------------------------------
def int_pair(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"need 1 <= LO <= HI, got {text!r}")
    return lo, hi


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small model and workload, a sanity run")
    p.add_argument("--model-dir", help="checkpoint dir, written if missing (default: under $PIPESERVE_HOME)")
    p.add_argument("--hidden", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--kv-heads", type=int)
    p.add_argument("--num-requests", type=int)
    p.add_argument("--prompt-len", type=int_pair, metavar="LO,HI", help="uniform range (default 32,512)")
    p.add_argument("--output-len", type=int_pair, metavar="LO,HI", help="uniform range (default 64,256)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-gb", type=float, help="pipeserve KV pool size (default 2.0)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--threads", type=int, help="torch threads for both engines (default: torch's)")
    p.add_argument("--only", choices=ENGINES, help="run one engine only")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--profile", action="store_true", help="profile pipeserve alone instead")
    p.add_argument("--profile-requests", type=int, default=32)
    p.add_argument("--profile-top", type=int, default=20, help="torch ops to list; 0: skip the op profile")
    p.add_argument("--worker-result", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name, (full, quick) in SIZED_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if args.model_dir is None:
        args.model_dir = str(default_model_dir(args))
    return args


def num_params(model_dir: str) -> int:
    from safetensors import safe_open

    with safe_open(str(Path(model_dir) / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def environment() -> dict[str, str]:
    """Code revision and library versions, for the report."""
    import transformers

    try:
        git = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        git = "unknown"
    return {
        "git": git,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpus": str(os.cpu_count()),
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker_result is not None:
        run = run_pipeserve if args.only == "pipeserve" else run_hf
        args.worker_result.write_text(json.dumps(run(args)))
        return 0
    ensure_model(args)
    args.num_params = num_params(args.model_dir)
    if args.profile:
        profile(args)
        return 0
    env = environment()
    results = {e: run_worker(e, argv) for e in ENGINES if args.only in (None, e)}
    summary = report(args, env, results)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
