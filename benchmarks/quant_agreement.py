"""Greedy agreement of the quantized default model with its float32 model (issue 22, point 1).

    python benchmarks/quant_agreement.py [--modes gguf int8 int4] [--max-tokens 64]

For each mode: the float32 checkpoint converted from SmolLM2-135M-Instruct's Q4_1 GGUF decodes 16
prompts greedily; the quantized model scores those continuations teacher-forced
(pipeserve.bench.agreement) and decodes them itself. Prints one markdown row per mode.
"""

from __future__ import annotations

import argparse
import time

from pipeserve.bench.agreement import agreement
from pipeserve.model.default import default_model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, there was",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "The three primary colors are",
    "import numpy as np\n\ndef",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "The mitochondria is",
    "In 1969, the first humans",
    "SELECT name, age FROM users WHERE",
    "<|im_start|>user\nExplain recursion in one sentence.<|im_end|>\n<|im_start|>assistant\n",
    "The quick brown fox",
    "A list of fruits: apple, banana,",
    "Water boils at",
    "<|im_start|>user\nTranslate 'good morning' into Spanish.<|im_end|>\n<|im_start|>assistant\n",
    "The best way to learn programming is",
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modes", nargs="+", default=["gguf", "int8", "int4"])
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    model = str(default_model())
    print("| mode | positions | teacher-forced agreement | free-running shared prefix | identical outputs |")
    print("|---|---|---|---|---|")
    for mode in args.modes:
        start = time.monotonic()
        a = agreement(model, mode, PROMPTS, args.max_tokens)
        took = time.monotonic() - start
        print(
            f"| {mode} | {a.tokens} | {a.agreed}/{a.tokens} = {100 * a.rate:.1f} % | "
            f"{a.exact_prefix}/{a.tokens} | {a.identical}/{len(PROMPTS)} |  <!-- {took:.0f} s -->",
            flush=True,
        )


if __name__ == "__main__":
    main()
