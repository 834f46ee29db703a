"""qwen3_moe (Qwen3-30B-A3B, Qwen3-235B-A22B): qwen3's attention (per-head q/k RMSNorm, free
head_dim) with routed experts as the MLP (model/moe.py, arch/routed.py): softmax over the experts,
the top `num_experts_per_tok`, renormalized only when `norm_topk_prob`, weights in the activations'
dtype. A layer in `mlp_only_layers`, or off the `decoder_sparse_step` beat, keeps the dense gated MLP
(`intermediate_size`); experts are `moe_intermediate_size` wide. No shared experts (Qwen2-MoE's).

GGUF: llama.cpp's `qwen3moe`: qwen3's tensors, the router `ffn_gate_inp`, the experts stacked per
block (`ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`: [E, rows, cols]) and their width as
`expert_feed_forward_length`; llama.cpp always renormalizes the top-k weights (norm_topk_prob). A
block with a dense MLP (`ffn_gate`, llama's names: mlp_only_layers, which llama.cpp's qwen3moe does
not have) is read as one."""

from __future__ import annotations

from torch import nn

from pipeserve.errors import ModelLoadError
from pipeserve.model.arch import qwen3
from pipeserve.model.arch.base import Arch, GgufSpec, Source
from pipeserve.model.arch.routed import routed_layer, routed_unsupported, routed_weights
from pipeserve.model.config import ModelConfig
from pipeserve.model.gguf_meta import GgufMeta
from pipeserve.model.moe import MoeSpec


def moe_spec(raw: dict) -> MoeSpec:
    """Qwen3MoeConfig's fields (its defaults where absent) and Qwen3MoeDecoderLayer's rule: layer i
    has experts unless i is in mlp_only_layers or (i + 1) % decoder_sparse_step != 0."""
    # v4 configs say num_experts; transformers 5 writes it as num_local_experts (its attribute_map).
    experts = int(raw.get("num_experts", raw.get("num_local_experts", 128)))
    step = int(raw.get("decoder_sparse_step", 1))
    if experts <= 0 or step <= 0:
        raise ModelLoadError(f"qwen3_moe needs num_experts, decoder_sparse_step > 0, not {experts}, {step}")
    only = {int(i) for i in raw.get("mlp_only_layers") or ()}
    layers = range(int(raw["num_hidden_layers"]))
    return MoeSpec(
        num_experts=experts,
        top_k=int(raw.get("num_experts_per_tok", 8)),
        intermediate_size=int(raw.get("moe_intermediate_size", 768)),
        renormalize=bool(raw.get("norm_topk_prob", False)),
        float_weights=False,  # Qwen3MoeTopKRouter casts them to the logits' dtype
        dense_layers=frozenset(i for i in layers if i in only or (i + 1) % step),
    )


def config(raw: dict) -> dict:
    moe_spec(raw)  # its ModelLoadError before anything starts
    return qwen3.config(raw)


def layer(cfg: ModelConfig, index: int) -> nn.Module:
    return routed_layer(cfg, index, moe_spec(cfg.raw))


def weights(cfg: ModelConfig, index: int) -> dict[str, Source]:
    names = ("gate_proj", "up_proj", "down_proj")
    return routed_weights(cfg, index, moe_spec(cfg.raw), ("mlp.gate.weight",), "mlp.experts", names)


GGUF_NAMES = {
    **qwen3.GGUF_NAMES,
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.{e}.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.{e}.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.{e}.down_proj.weight",
}


def gguf_config(meta: GgufMeta) -> dict:
    return {
        **qwen3.gguf_config(meta),
        "num_experts": int(meta.need("expert_count")),
        "num_experts_per_tok": int(meta.need("expert_used_count")),
        "moe_intermediate_size": int(meta.need("expert_feed_forward_length")),
        "norm_topk_prob": True,
        "mlp_only_layers": meta.blocks_with("ffn_gate.weight"),
        "decoder_sparse_step": 1,
    }


ARCH = Arch(
    "qwen3_moe",
    "Qwen3MoeForCausalLM",
    config,
    weights,
    layer,
    routed_unsupported,
    gguf=GgufSpec("qwen3moe", GGUF_NAMES, gguf_config),
)
