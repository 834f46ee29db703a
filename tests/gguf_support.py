"""Helpers for the GGUF and real-model tests.

`converted_smollm2(base)` converts the packaged SmolLM2 GGUF once per test
session (keyed by pytest's session base temp dir, so test modules share it).
`write_llama_gguf(hf_dir, path)` writes an HF llama checkpoint as llama.cpp's
converter would (F32 tensors, llama.cpp names, q/k rows permuted, byte-level
BPE vocabulary in the metadata), so a round trip through `convert_gguf` can be
checked exactly against the original, without the 93 MB package. `quant` picks each tensor's
type: F16, BF16, gguf's own quantizers (Q4_0, Q4_1, Q8_0) or pipeserve's reference quantizer
(model/gguf_quant.py: Q5_0, Q5_1, Q4_K, Q5_K, Q6_K); `q4_k_m` is the mix of a Q4_K_M file.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import cache
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

from pipeserve.model import gguf_quant
from pipeserve.model.default import default_model, smollm2_gguf

Q = gguf.GGMLQuantizationType


@cache
def converted_smollm2(base: Path) -> Path:
    """SmolLM2's HF checkpoint, converted by pipeserve into a temp PIPESERVE_HOME of this session."""
    return default_model(base / "pipeserve-home")


def smollm2_file() -> Path:
    return smollm2_gguf()


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (HF rotate-half -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if hf in top:
        return top[hf]
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{_NAMES[rest]}"


def q4_k_m(hf: str) -> gguf.GGMLQuantizationType | None:
    """A Q4_K_M file's mix (llama.cpp's llama_tensor_get_type, simplified to every layer): attn_v and
    ffn_down in Q6_K, the output in Q6_K, every other matrix (the embedding too) in Q4_K; norms F32.
    Rows must be multiples of 256 (K-quants' super-block)."""
    if hf.endswith("norm.weight"):
        return None
    if hf == "lm_head.weight" or hf.endswith(("self_attn.v_proj.weight", "mlp.down_proj.weight")):
        return Q.Q6_K
    return Q.Q4_K


# Types pipeserve refuses (gguf_types.SERVED_TYPES lacks them): written as seeded bytes of their block
# size, for files that must be refused by name.
UNSERVED = (Q.Q2_K, Q.Q3_K, Q.IQ2_XS)


def gguf_tensor(a: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """float32 [N, K] -> the array `GGUFWriter.add_tensor(..., raw_dtype=qtype)` stores."""
    if qtype in UNSERVED:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        shape = (a.shape[0], a.shape[1] // block * size)
        return np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8)
    if qtype.name in gguf_quant.TYPES:
        return gguf_quant.quantize(a, qtype.name)
    if qtype == Q.F16:
        return a.astype(np.float16)
    return gguf.quants.quantize(a, qtype)  # F32, BF16, Q4_0, Q4_1, Q8_0 (as llama.cpp)


def write_llama_gguf(
    hf_dir: Path,
    path: Path,
    arch: str = "llama",
    tokenizer_model: str = "gpt2",
    pre: str = "gpt2",
    quant: Callable[[str], gguf.GGMLQuantizationType | None] | None = None,
) -> Path:
    """`quant(hf_name)`: the block type a tensor is written in (quantized by the `gguf` package as
    llama.cpp's quantizer does), None for F32."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    tok_cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_rope_dimension_count(cfg["head_dim"])
    vocab = tok["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    specials = {a["content"] for a in tok["added_tokens"] if a["special"]}
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in specials else 1 for t in tokens])
    w.add_token_merges([" ".join(m) for m in tok["model"]["merges"]])
    w.add_eos_token_id(vocab[tok_cfg["eos_token"]])
    w.add_pad_token_id(vocab[tok_cfg["pad_token"]])
    w.add_add_bos_token(False)
    w.add_chat_template(tok_cfg["chat_template"])
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for name, t in load_file(str(hf_dir / "model.safetensors")).items():
        a = t.to(torch.float32).numpy()
        if name.endswith("q_proj.weight"):
            a = llama_cpp_permute(a, heads)
        elif name.endswith("k_proj.weight"):
            a = llama_cpp_permute(a, kv_heads)
        qtype = quant(name) if quant else None
        if qtype is None:
            w.add_tensor(gguf_name(name), np.ascontiguousarray(a))
        else:
            data = gguf_tensor(np.ascontiguousarray(a), qtype)
            w.add_tensor(gguf_name(name), data, raw_dtype=None if qtype == Q.F16 else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
