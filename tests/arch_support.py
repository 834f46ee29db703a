"""Tiny checkpoints of any registered architecture, created by transformers itself.

`write_hf_checkpoint(DIR, "qwen3", **config)`: transformers' config class for the model_type
(AutoConfig.for_model) -> AutoModelForCausalLM.from_config -> save_pretrained, beside the demo
tokenizer (pipeserve.model.demo.write_tokenizer: the same 1024-token byte-level BPE the demo models
use). Weights are redrawn from a seeded generator at the demo model's scales (projections
1/sqrt(fan_in), norms around 1, lm_head 4/sqrt(hidden)): transformers' own init (std 0.02) leaves
logits within 1e-3 of each other, where greedy comparisons would hinge on float rounding.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from pipeserve.model.demo import write_tokenizer

# hidden 64, 4 layers (S=1..3 splits them), GQA 4:2; head_dim 32 apart from hidden/heads.
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
# Gemma (EXTRA): head_dim 16 (its default is 256), a 12-token window (across a block boundary, shorter
# than most prompts), a query_pre_attn_scalar apart from head_dim, soft-caps small enough to bend these
# logits, tied embeddings; gemma3 with a global layer every 3rd and linear rope scaling on it.
GEMMA = {
    "head_dim": 16,
    "sliding_window": 12,
    "query_pre_attn_scalar": 24,
    "final_logit_softcapping": 3.0,
    "tie_word_embeddings": True,
}
# Per model_type: what its config needs beyond TINY (qwen3's own head_dim; phi3 without a window).
EXTRA: dict[str, dict] = {
    "qwen3": {"head_dim": 32},
    "phi3": {"sliding_window": None},
    # 4 experts, top-2, experts 32 wide; layer 2 keeps the dense MLP (mlp_only_layers).
    "qwen3_moe": {
        "head_dim": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "mlp_only_layers": [2],
    },
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32},
    "gemma": {"head_dim": 16, "tie_word_embeddings": True},
    "gemma2": {**GEMMA, "attn_logit_softcapping": 4.0},
    "gemma3_text": {
        **GEMMA,
        "sliding_window_pattern": 3,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
    },
}


def _redraw(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.1 * noise)
            elif "embed_tokens" in name:
                p.copy_(0.25 * noise)
            elif name.startswith("lm_head"):
                p.copy_(noise * 4 / math.sqrt(p.shape[1]))
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]))


def write_hf_checkpoint(out: Path, model_type: str, seed: int = 0, **config) -> Path:
    """A checkpoint directory transformers and pipeserve both load; `config` overrides TINY."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    vocab, eos_ids, _ = write_tokenizer(out, 1024, bos=False, max_len=512)
    fields = {**TINY, **EXTRA.get(model_type, {}), **config}
    hf_config = AutoConfig.for_model(
        model_type, vocab_size=vocab, eos_token_id=eos_ids[0], bos_token_id=None, pad_token_id=eos_ids[0],
        **fields,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    _redraw(model, seed)
    model.save_pretrained(out)
    gen = {"eos_token_id": eos_ids, "pad_token_id": eos_ids[0], "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return out
