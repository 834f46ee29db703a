"""mixtral (Mixtral 8x7B, 8x22B): mistral's attention (no biases; a sliding window caps the context)
with routed experts as every layer's MLP (model/moe.py, arch/routed.py): softmax over the experts
in float32, the top `num_experts_per_tok`, always renormalized, weights kept in float32.
`intermediate_size` is each expert's width. v4 checkpoints name the MLP `block_sparse_moe` with
experts `w1` (gate), `w3` (up), `w2` (down); transformers 5's fused layout names it `mlp`.

GGUF: llama.cpp writes Mixtral as its `llama` architecture with `expert_count` set: llama's tensors
(q/k rows permuted), the router `ffn_gate_inp` and the experts stacked per block ([E, rows, cols]:
`ffn_gate_exps` from w1, `ffn_up_exps` from w3, `ffn_down_exps` from w2), converted back into the
per-expert v4 names. llama.cpp keeps no window for it."""

from __future__ import annotations

from torch import nn

from pipeserve.errors import ModelLoadError
from pipeserve.model.arch import mistral
from pipeserve.model.arch.base import Arch, GgufSpec, Source
from pipeserve.model.arch.llama import GGUF_BLOCK_NAMES
from pipeserve.model.arch.routed import routed_layer, routed_unsupported, routed_weights
from pipeserve.model.config import ModelConfig
from pipeserve.model.gguf_meta import GgufMeta
from pipeserve.model.moe import MoeSpec


def moe_spec(raw: dict) -> MoeSpec:
    """MixtralConfig's fields, its defaults where absent; every layer has experts."""
    experts = int(raw.get("num_local_experts", 8))
    if experts <= 0:
        raise ModelLoadError(f"mixtral needs num_local_experts > 0, not {experts}")
    return MoeSpec(
        num_experts=experts,
        top_k=int(raw.get("num_experts_per_tok", 2)),
        intermediate_size=int(raw["intermediate_size"]),
        renormalize=True,
        float_weights=True,  # MixtralTopKRouter leaves them in float32
    )


def config(raw: dict) -> dict:
    moe_spec(raw)  # its ModelLoadError before anything starts
    return mistral.config(raw)


def layer(cfg: ModelConfig, index: int) -> nn.Module:
    return routed_layer(cfg, index, moe_spec(cfg.raw))


def weights(cfg: ModelConfig, index: int) -> dict[str, Source]:
    routers = ("mlp.gate.weight", "block_sparse_moe.gate.weight")
    names = ("w1", "w3", "w2")  # gate, up, down
    return routed_weights(cfg, index, moe_spec(cfg.raw), routers, "block_sparse_moe.experts", names)


GGUF_NAMES = {
    **{k: v for k, v in GGUF_BLOCK_NAMES.items() if not k.startswith(("ffn_gate", "ffn_up", "ffn_down"))},
    "ffn_gate_inp.weight": "block_sparse_moe.gate.weight",
    "ffn_gate_exps.weight": "block_sparse_moe.experts.{e}.w1.weight",
    "ffn_up_exps.weight": "block_sparse_moe.experts.{e}.w3.weight",
    "ffn_down_exps.weight": "block_sparse_moe.experts.{e}.w2.weight",
}


def gguf_config(meta: GgufMeta) -> dict:
    return {
        "num_local_experts": int(meta.need("expert_count")),
        "num_experts_per_tok": int(meta.need("expert_used_count")),
        "sliding_window": None,
    }


def _has_experts(meta: GgufMeta) -> bool:
    return bool(meta.get("expert_count"))


ARCH = Arch(
    "mixtral",
    "MixtralForCausalLM",
    config,
    weights,
    layer,
    routed_unsupported,
    gguf=GgufSpec("llama", GGUF_NAMES, gguf_config, permuted_qk=True, claims=_has_experts),
)
