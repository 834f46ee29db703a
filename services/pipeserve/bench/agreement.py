"""Greedy agreement of a quantized model with its float reference (issue 22: >= 98 % of tokens).

`agreement(model_dir, quantization, prompts, max_tokens)`:
1. the float model (`quantization="none"`) decodes each prompt greedily for `max_tokens` tokens;
2. the quantized model scores each prompt + that continuation with `prompt_logprobs=1`
   (teacher forcing: every position sees the reference's own prefix);
3. a token agrees when it is the quantized model's argmax there (rank 1).

Teacher forcing counts every position once, however early the two first differ; the free-running
figure (`exact_prefix`: tokens the quantized model's own greedy decode shares with the reference
before the first difference) is reported beside it.
"""

from __future__ import annotations

import dataclasses
import gc

from pipeserve.entrypoints.llm import LLM
from pipeserve.sampling_params import SamplingParams

# Text, code and chat prompts for the default model (benchmarks/quant_agreement.py, the slow test).
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


@dataclasses.dataclass
class Agreement:
    quantization: str
    tokens: int  # generated positions scored
    agreed: int  # of those, the quantized argmax equals the reference token
    exact_prefix: int  # free-running: shared tokens before the first difference, summed over prompts
    identical: int  # prompts whose whole free-running continuation is identical

    @property
    def rate(self) -> float:
        return self.agreed / self.tokens if self.tokens else 0.0


def agreement(
    model_dir: str, quantization: str, prompts: list[str], max_tokens: int, **engine_args
) -> Agreement:
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ref = LLM(model_dir, quantization="none", **engine_args)
    ref_out = ref.generate(prompts, greedy)
    del ref
    gc.collect()
    quant = LLM(model_dir, quantization=quantization, **engine_args)
    full = [o.prompt_token_ids + o.outputs[0].token_ids for o in ref_out]
    scored = quant.generate(full, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))
    own = quant.generate(prompts, greedy)
    tokens = agreed = prefix = identical = 0
    for r, s, o in zip(ref_out, scored, own, strict=True):
        n_prompt = len(r.prompt_token_ids)
        assert s.prompt_logprobs is not None
        for entry in s.prompt_logprobs[n_prompt:]:
            assert entry is not None
            tokens += 1
            agreed += entry[1] == 1
        want, got = r.outputs[0].token_ids, o.outputs[0].token_ids
        same = next((i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b), len(want))
        prefix += same
        identical += same == len(want)
    return Agreement(quantization, tokens, agreed, prefix, identical)
