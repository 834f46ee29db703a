"""Run the engine's greedy generation on a demo checkpoint; print the token ids as JSON.

    python tests/kernels/engine_run.py MODEL_DIR STAGES PROMPTS_JSON MAX_TOKENS [QUANTIZATION]

A separate process because the kernel backend (PIPESERVE_KERNELS, TRITON_INTERPRET) is chosen from the
environment when pipeserve_kernels and triton are first imported; the stage processes of STAGES > 1
inherit it. Engine settings force chunked prefill over a cached prefix and block-boundary contexts.
"""

from __future__ import annotations

import json
import sys

import pipeserve_kernels
from pipeserve import LLM, SamplingParams


def main() -> None:
    model, stages, prompts, max_tokens = (
        sys.argv[1],
        int(sys.argv[2]),
        json.loads(sys.argv[3]),
        int(sys.argv[4]),
    )
    settings = dict(max_model_len=128, num_kv_blocks=96, block_size=4, max_num_batched_tokens=12)
    if len(sys.argv) > 5:  # compared with HF on the dequantized weights: a float32 pool, not auto's float16
        settings.update(quantization=sys.argv[5], kv_cache_dtype="float32")
    with LLM(model, stages=stages, **settings) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    print(json.dumps({"backend": pipeserve_kernels.BACKEND, "ids": [o.outputs[0].token_ids for o in outs]}))


if __name__ == "__main__":
    main()
