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
import math
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


# llama.cpp's architecture for each HF model_type (convert_hf_to_gguf.py's registrations: Mistral and
# Mixtral are its LlamaModel, so "llama"; Gemma 3's text model is "gemma3").
LLAMA_CPP_ARCH = {
    "llama": "llama",
    "mistral": "llama",
    "mixtral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3moe",
    "phi3": "phi3",
    "gemma": "gemma",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
}
PERMUTED = {"llama", "mistral", "mixtral"}  # LlamaModel.undo_permute: its q/k rows (and biases)
GEMMA = {"gemma", "gemma2", "gemma3_text"}  # their norm weights are written as 1 + w
LOCAL_LAYERS = {"gemma2", "gemma3_text"}  # soft-caps, a window and local layers in the metadata


def gguf_name(hf: str, model_type: str = "llama", blocks: int = 64) -> str:
    if hf == "rope_freqs.weight":
        return hf
    """gguf-py's own name for HF tensor `hf` (its TensorNameMap for the file's architecture: the
    names llama.cpp's converter writes), independent of pipeserve's GgufSpec. A dense MLP in a
    qwen3moe file (mlp_only_layers: not in llama.cpp's qwen3moe) takes llama's names."""
    for arch in (LLAMA_CPP_ARCH[model_type], "llama"):
        names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], blocks)
        found = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        if found is not None:
            return found
    raise KeyError(f"gguf-py has no name for {hf} in {model_type}")


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


def _metadata(w: gguf.GGUFWriter, cfg: dict, model_type: str) -> None:
    """The keys llama.cpp's converter writes for `model_type` (TextModel.set_gguf_parameters and the
    arch's own class: LlamaModel, Qwen2MoeModel, Phi3MiniModel, Gemma2Model, Gemma3Model)."""
    rope = cfg.get("rope_parameters") or {}
    full = rope.get("full_attention", rope)  # gemma3: per layer kind; the global layers' here
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg.get("num_key_value_heads", heads))
    w.add_rope_freq_base(cfg.get("rope_theta", full.get("rope_theta", 10000.0)))
    if full.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    if "rope_theta" in rope.get("sliding_attention", {}):
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    experts = cfg.get("num_local_experts", cfg.get("num_experts"))
    if experts is not None:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    if model_type == "phi3":  # Phi3MiniModel writes its own set, without key_length
        rotary = (
            int(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) * hidden) // heads
        )
        w.add_rope_scaling_orig_ctx_len(cfg["original_max_position_embeddings"])
        w.add_rope_dimension_count(rotary)
        w.add_sliding_window(cfg.get("sliding_window") or 0)
        return
    if cfg.get("head_dim") is not None:
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    if LLAMA_CPP_ARCH[model_type] == "llama":
        w.add_vocab_size(cfg["vocab_size"])
        w.add_rope_dimension_count(cfg.get("head_dim") or hidden // heads)
    if model_type == "qwen3_moe":
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if model_type in LOCAL_LAYERS:
        if cfg.get("attn_logit_softcapping") is not None:
            w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        if cfg.get("final_logit_softcapping") is not None:
            w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        w.add_sliding_window(cfg["sliding_window"])
        # llama.cpp's default local layers: all but every 2nd (gemma2) / 6th (gemma3); another layout
        # as the bool per layer its loader reads (what its Gemma3n converter writes)
        n = 2 if model_type == "gemma2" else 6
        local = [kind == "sliding_attention" for kind in cfg["layer_types"]]
        if local != [i % n < n - 1 for i in range(len(local))]:
            w.add_sliding_window_pattern(local)


def _gpt2_vocab(w: gguf.GGUFWriter, hf_dir: Path, tokenizer_model: str, pre: str) -> None:
    """A byte-level BPE tokenizer.json as llama.cpp's _set_vocab_gpt2 writes it."""
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    tok_cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
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


def gguf_tensors(hf_dir: Path, cfg: dict) -> list[tuple[str, np.ndarray]]:
    """(HF name, float32 array as llama.cpp writes it) for every tensor: q/k rows permuted for llama's
    rope (LlamaModel.permute), gemma's norms as 1 + w, experts stacked into [E, rows, cols] (per-expert
    tensors of transformers 4, or transformers 5's fused gate_up split into gate and up), gemma's
    lm_head left out (tied)."""
    model_type = cfg["model_type"]
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    out: list[tuple[str, np.ndarray]] = []
    experts: dict[str, list[tuple[int, np.ndarray]]] = {}
    for name, t in load_file(str(hf_dir / "model.safetensors")).items():
        a = t.to(torch.float32).numpy()
        if model_type in PERMUTED and name.endswith(("q_proj.weight", "q_proj.bias")):
            a = llama_cpp_permute(a, heads)
        elif model_type in PERMUTED and name.endswith(("k_proj.weight", "k_proj.bias")):
            a = llama_cpp_permute(a, kv_heads)
        if model_type in GEMMA and name.endswith("norm.weight"):
            a = a + 1
        if model_type in GEMMA and name == "lm_head.weight":
            continue
        if name.endswith("experts.gate_up_proj"):  # [E, 2I, H]: gate rows, then up rows
            half = a.shape[1] // 2
            out.append((name.replace("gate_up_proj", "gate_proj.weight"), a[:, :half]))
            out.append((name.replace("gate_up_proj", "up_proj.weight"), a[:, half:]))
        elif name.endswith("experts.down_proj"):
            out.append((name + ".weight", a))
        elif ".experts." in name:  # model.layers.L.<mlp>.experts.E.<w>.weight
            head, _, rest = name.partition(".experts.")
            e, _, leaf = rest.partition(".")
            experts.setdefault(f"{head}.experts.{leaf}", []).append((int(e), a))
        else:
            out.append((name, a))
    for name, parts in experts.items():
        out.append((name, np.stack([a for _, a in sorted(parts, key=lambda p: p[0])])))
    return out


def _rope_freqs(cfg: dict) -> list[tuple[str, np.ndarray]]:
    """llama3 rope scaling as LlamaModel.generate_extra_tensors writes it: each frequency's divisor."""
    rope = cfg.get("rope_parameters") or {}
    if rope.get("rope_type") != "llama3":
        return []
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return [("rope_freqs.weight", np.array(out, dtype=np.float32))]


def write_gguf(
    hf_dir: Path,
    path: Path,
    arch: str | None = None,
    tokenizer_model: str = "gpt2",
    pre: str = "gpt2",
    quant: Callable[[str], gguf.GGMLQuantizationType | None] | None = None,
) -> Path:
    """The GGUF file llama.cpp's converter writes from HF checkpoint `hf_dir` (any model_type of
    LLAMA_CPP_ARCH; `arch` overrides `general.architecture`, for files that must be refused).
    `quant(hf_name)`: the block type a 2-D tensor is written in (quantized by the `gguf` package as
    llama.cpp's quantizer does, or by pipeserve's reference quantizer), None for F32."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    model_type = cfg["model_type"]
    w = gguf.GGUFWriter(path, arch or LLAMA_CPP_ARCH[model_type])
    _metadata(w, cfg, model_type)
    _gpt2_vocab(w, hf_dir, tokenizer_model, pre)
    blocks = cfg["num_hidden_layers"]
    for name, a in [*gguf_tensors(hf_dir, cfg), *_rope_freqs(cfg)]:
        a = np.ascontiguousarray(a)
        qtype = quant(name) if quant and a.ndim == 2 else None
        if qtype is None:
            w.add_tensor(gguf_name(name, model_type, blocks), a)
        else:
            data = gguf_tensor(a, qtype)
            w.add_tensor(
                gguf_name(name, model_type, blocks), data, raw_dtype=None if qtype == Q.F16 else qtype
            )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


write_llama_gguf = write_gguf  # the name the llama-only tests use
