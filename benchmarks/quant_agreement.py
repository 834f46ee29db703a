"""Greedy agreement of the quantized default model with its float32 model (issue 22, point 1).

    python benchmarks/quant_agreement.py [--modes gguf int8 int4] [--max-tokens 64]

For each mode: the float32 checkpoint converted from SmolLM2-135M-Instruct's Q4_1 GGUF decodes 16
prompts greedily; the quantized model scores those continuations teacher-forced
(pipeserve.bench.agreement) and decodes them itself. Prints one markdown row per mode.
"""

from __future__ import annotations

import argparse
import time

from pipeserve.bench.agreement import PROMPTS, agreement
from pipeserve.model.default import default_model


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
