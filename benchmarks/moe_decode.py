"""MoE decode tokens/s beside a dense model of equal active parameters (issue 28's MoE goal).

Each pair is one MoE checkpoint and its dense twin, created by transformers (config class ->
from_config -> save_pretrained, transformers' own random init; the demo tokenizer beside them):

* qwen3_moe (E experts, top-k, expert size I) vs qwen3 with intermediate_size = k * I;
* mixtral (the same experts) vs mistral with intermediate_size = k * I.

Attention, embedding and head are the same in both, so a token reads the same weights in each
(the MoE model adds only its router, E x hidden per layer); the MoE model holds E / k times the
MLP weights. Both run in this one process, float32, one stage: every decoding row first gets its
prompt (`--context` tokens), then rounds of `--steps` decode steps alternate between the two
models (`--rounds`, medians). What runs the decode step is printed: qwen3 and qwen3_moe use the
PyTorch layers (q/k norm), mistral the native step, mixtral the PyTorch layers (routed experts).

    python benchmarks/moe_decode.py                  # the measurement (needs a quiet machine)
    python benchmarks/moe_decode.py --quick          # a small sanity run
    python benchmarks/moe_decode.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from decode_profile import drain, start_decodes, timed_steps

from pipeserve.bench.host import cpu_info, git_commit

PAIRS = {"qwen3_moe": "qwen3", "mixtral": "mistral"}
# (full, --quick)
SIZES = {
    "hidden": (512, 128),
    "layers": (8, 2),
    "heads": (8, 4),
    "kv_heads": (4, 2),
    "experts": (8, 4),
    "top_k": (2, 2),
    "expert_size": (512, 64),
}


def write_checkpoint(out: Path, model_type: str, sizes: dict[str, int]) -> Path:
    """A checkpoint of `model_type` at `sizes`; the dense twin's MLP is top_k experts wide."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from pipeserve.model.demo import write_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    vocab, eos_ids, _ = write_tokenizer(out, 1024, bos=False, max_len=4096)
    fields: dict[str, Any] = {
        "vocab_size": vocab,
        "hidden_size": sizes["hidden"],
        "num_hidden_layers": sizes["layers"],
        "num_attention_heads": sizes["heads"],
        "num_key_value_heads": sizes["kv_heads"],
        "head_dim": sizes["hidden"] // sizes["heads"],
        "max_position_embeddings": 4096,
        "eos_token_id": eos_ids[0],
        "tie_word_embeddings": False,
        "intermediate_size": sizes["top_k"] * sizes["expert_size"],
    }
    if model_type == "qwen3_moe":
        fields.update(
            num_experts=sizes["experts"],
            num_experts_per_tok=sizes["top_k"],
            moe_intermediate_size=sizes["expert_size"],
            norm_topk_prob=True,
        )
    elif model_type == "mixtral":
        fields.update(
            num_local_experts=sizes["experts"],
            num_experts_per_tok=sizes["top_k"],
            intermediate_size=sizes["expert_size"],
        )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **fields), dtype=torch.float32)
    model.save_pretrained(out)
    return out


def stage_model(llm: Any) -> Any:
    return llm.engine.executor.runner.model  # one stage: the whole model


def param_counts(llm: Any) -> tuple[int, int]:
    """(total, active per token) parameters of the loaded model: an MoE layer's experts count k / E."""
    from pipeserve.model.moe import Experts, TopKRouter

    model = stage_model(llm)
    top_k = next((r.top_k for r in model.modules() if isinstance(r, TopKRouter)), 0)
    total = active = 0
    for m in model.modules():
        own = sum(p.numel() for p in m.parameters(recurse=False))
        total += own
        active += own * top_k // m.num_experts if isinstance(m, Experts) else own
    return total, active


def measure_pair(moe_type: str, root: Path, sizes: dict[str, int], args: argparse.Namespace) -> dict:
    from pipeserve import LLM

    dense_type = PAIRS[moe_type]
    paths = {
        moe_type: write_checkpoint(root / moe_type, moe_type, sizes),
        dense_type: write_checkpoint(root / dense_type, dense_type, sizes),
    }
    max_len = args.context + args.steps * (args.rounds + 1) + 16  # a row's prompt and every step
    blocks = max(args.batches) * (max_len // 16 + 1) + 16
    llms = {name: LLM(str(path), num_kv_blocks=blocks, max_model_len=max_len) for name, path in paths.items()}
    result: dict[str, Any] = {"models": {}}
    for name, llm in llms.items():
        total, active = param_counts(llm)
        result["models"][name] = {
            "params": total,
            "active_params": active,
            "native_step": stage_model(llm).native is not None,
        }
    for batch in args.batches:
        steps: dict[str, list[float]] = {name: [] for name in llms}
        for i, llm in enumerate(llms.values()):
            start_decodes(llm, batch, args.context, args.steps * (args.rounds + 1) + 2, args.seed + i)
        for _ in range(args.rounds):
            for name, llm in llms.items():
                steps[name] += timed_steps(llm, args.steps)
        for llm in llms.values():
            drain(llm)
        for name in llms:
            step = statistics.median(steps[name])
            result["models"][name][f"batch {batch}"] = {"step_ms": 1000 * step, "tok_s": batch / step}
    return result


def print_table(moe_type: str, result: dict, args: argparse.Namespace) -> None:
    print(
        f"\n{moe_type} vs {PAIRS[moe_type]} (context {args.context}, "
        f"medians of {args.rounds} x {args.steps} steps)"
    )
    cols = "".join(f" | batch {b} tok/s (ms/step)" for b in args.batches)
    print(f"| model | params | active | decode step{cols} |")
    print("|---|---|---|---" + "|---" * len(args.batches) + "|")
    for name, r in result["models"].items():
        cells = "".join(
            f" | {r[f'batch {b}']['tok_s']:.1f} ({r[f'batch {b}']['step_ms']:.2f})" for b in args.batches
        )
        step = "native" if r["native_step"] else "PyTorch layers"
        print(f"| {name} | {r['params'] / 1e6:.1f}M | {r['active_params'] / 1e6:.1f}M | {step}{cells} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny models, few steps: a sanity run")
    p.add_argument("--pairs", default=",".join(PAIRS), help=f"MoE types to run, of {', '.join(PAIRS)}")
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    p.add_argument("--context", type=int, default=128, help="prompt tokens of every decoding row")
    p.add_argument("--steps", type=int, default=16, help="decode steps per round")
    p.add_argument("--rounds", type=int, default=5, help="rounds alternating the two models")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", type=Path, default=None, help="where the checkpoints go (default: a temp dir)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    sizes = {k: v[1 if args.quick else 0] for k, v in SIZES.items()}
    if args.quick:
        args.context, args.steps, args.rounds = min(args.context, 16), min(args.steps, 4), min(args.rounds, 2)
    host = {
        **cpu_info(),
        "torch_threads": torch.get_num_threads(),
        "loadavg": os.getloadavg(),
        "commit": git_commit(),
    }
    print(f"CPU: {host['model']} ({host['cpus']} CPUs, {host['torch_threads']} torch threads)")
    print(f"flags {' '.join(host['flags'])}; load average {host['loadavg'][0]:.2f}; commit {host['commit']}")
    print(f"sizes: {sizes}")
    results = {}
    with tempfile.TemporaryDirectory(prefix="pipeserve-moe-bench-") as tmp:
        root = args.dir or Path(tmp)
        for moe_type in args.pairs.split(","):
            if moe_type not in PAIRS:
                p.error(f"unknown pair {moe_type!r}; choose from {', '.join(PAIRS)}")
            t0 = time.monotonic()
            results[moe_type] = measure_pair(moe_type, root, sizes, args)
            print_table(moe_type, results[moe_type], args)
            print(f"({time.monotonic() - t0:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps({"host": host, "sizes": sizes, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
