"""Device checks for a machine with a GPU (not part of the CPU test suite).

Run as one short script where a GPU is lent (prepared; not yet run: no GPU was lent so far):

    python benchmarks/gpu_check.py            # ~4 minutes on an H200, well under 10

1. The demo checkpoint in float32 on `cuda`: greedy ids of pipeserve with
   S = 1 and S = 2 (two stage processes; on one GPU the activations go through
   host memory over gloo, since NCCL cannot pair two ranks on one device) equal
   transformers' on the same GPU, with TF32 off. The layer ops are the Triton
   kernels (PIPESERVE_KERNELS=auto picks them for CUDA tensors; printed).
   With two or more GPUs, S = 2 puts a GPU under each stage and activations go
   over NCCL (the first send on each link is warmed by the ring's Hello).
2. Offline tokens/s of each run, for the record.
3. HiCache on `cuda` (S = 2): a small device pool so blocks move to the pinned
   host pool (L2) and back, then a fresh group reading L3 from a private
   redis-server (skipped when redis-server is not installed) — the same ids,
   with L2 and L3 hits counted.
4. Each Triton kernel against its PyTorch reference and, for attention, SDPA
   on contiguous K/V, float32 and bfloat16, with achieved GB/s against the
   device's measured copy bandwidth (benchmarks/gpu_kernels.py); the weight-only int4 / int8
   projections against F.linear over their dequantized weight and timed against the dense
   bfloat16 matmul (benchmarks/gpu_quant.py).
5. Serving tok/s: `pipeserve up --device cuda` on the demo model driven by
   `pipeserve bench` (random 128/64, C=16).
Exit status 0 only if every comparison holds.
"""

from __future__ import annotations

import random
import sys
import tempfile
import time

import torch


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 1
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from transformers import AutoModelForCausalLM

    import pipeserve_kernels
    from pipeserve import LLM, SamplingParams
    from pipeserve.model.demo import DemoSpec, write_demo_model

    print(f"kernel backend: {pipeserve_kernels.BACKEND} (Triton for CUDA tensors under auto)", flush=True)
    model = write_demo_model(tempfile.mkdtemp() + "/demo", DemoSpec())
    rng = random.Random(0)
    prompts = [[rng.randrange(1024) for _ in range(rng.randint(4, 200))] for _ in range(24)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).cuda().eval()
    want = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=24,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            want.append(out[0, len(p) :].tolist())
    ok = True
    shared = torch.cuda.device_count() < 2  # stage k runs on cuda:(k % device_count)
    configs = [(1, "one GPU"), (2, "one GPU shared, gloo via host memory" if shared else "a GPU each, NCCL")]
    for stages, label in configs:
        with LLM(str(model), stages=stages, device="cuda", max_model_len=512, kv_cache_gb=1.0) as llm:
            t0 = time.perf_counter()
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            dt = time.perf_counter() - t0
        same = sum(g == w for g, w in zip(got, want, strict=True))
        ok &= same == len(prompts)
        print(
            f"S={stages} {label}: {same}/{len(prompts)} equal to transformers, "
            f"{24 * len(prompts) / dt:.0f} tok/s",
            flush=True,
        )
    ok &= hicache_check(model, prompts + prompts, want + want, params)
    from gpu_kernels import kernel_checks

    ok &= kernel_checks()
    ok &= serving_check(model)
    return 0 if ok else 1


def serving_check(model: str) -> bool:
    """`pipeserve up --device cuda` + `pipeserve bench`; prints the bench summary. True if it ran."""
    import os
    import subprocess

    bin_dir = os.path.dirname(sys.executable)
    logs = tempfile.mkdtemp()
    up = subprocess.Popen(
        [
            f"{bin_dir}/pipeserve",
            "up",
            "--model",
            model,
            "--port",
            "18123",
            "--device",
            "cuda",
            "--log-dir",
            logs,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        line = ""
        while "pipeserve: serving" not in line:
            line = up.stdout.readline() if up.stdout else ""
            if not line and (up.poll() is not None or time.monotonic() > deadline):
                print(f"serving: pipeserve up did not come up (logs in {logs})")
                return False
        bench = subprocess.run(
            [f"{bin_dir}/pipeserve", "bench", "--url", "http://127.0.0.1:18123", "--tokenizer", model,
             "--workload", "random", "--num-requests", "128", "--concurrency", "16", "--input-len", "128",
             "--output-len", "64", "--label", "gpu_check serving, demo model, S=1, cuda"],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        print(
            "serving (pipeserve bench, random 128/64, C=16, S=1, cuda):\n" + bench.stdout[-2000:], flush=True
        )
        return bench.returncode == 0
    finally:
        up.terminate()
        up.wait(timeout=60)


def hicache_check(model: str, prompts: list, want: list, params) -> bool:
    import shutil

    from pipeserve import LLM
    from pipeserve.local.redis_server import LocalRedis

    small = dict(device="cuda", max_model_len=256, num_kv_blocks=64, block_size=4, max_num_seqs=8)
    ok = True
    redis = LocalRedis().start() if shutil.which("redis-server") else None
    l3 = {"hicache_url": redis.url} if redis else {}
    try:
        runs = [("L2", {"host_cache_gb": 0.05, **l3})] + (
            [("L3", {"host_cache_gb": 0, **l3})] if redis else []
        )
        for label, kw in runs:
            with LLM(model, stages=2, **small, **kw) as llm:
                got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
                hits = dict(llm.engine.scheduler.fetch.stats.hit_tokens)
            same = sum(g == w for g, w in zip(got, want, strict=True))
            tier = label.lower()
            ok &= same == len(prompts) and hits.get(tier, 0) > 0
            print(f"HiCache {label} on cuda: {same}/{len(prompts)} equal to transformers, hit tokens {hits}")
    finally:
        if redis:
            redis.stop()
    return ok


if __name__ == "__main__":
    sys.exit(main())
