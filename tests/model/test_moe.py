"""The routed-experts MLP (model/moe.py) against transformers 5's own MoE blocks on the same weights.

Both of transformers' expert implementations are the oracle: `eager` (a loop over the experts hit,
index_add_) and `grouped_mm` (its default: sort by expert, grouped products). Checkpoint layouts
and whole models are tested in test_arch_moe.py.
"""

from __future__ import annotations

import pytest
import torch

from pipeserve.errors import ModelLoadError
from pipeserve.model.moe import MoeSpec, SparseMoE

H, I_MOE, E, K_TOP = 64, 32, 4, 2


def _qwen3_moe_config(norm_topk_prob: bool):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        hidden_size=H,
        moe_intermediate_size=I_MOE,
        num_experts=E,
        num_experts_per_tok=K_TOP,
        norm_topk_prob=norm_topk_prob,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=128,
    )


def _mixtral_config():
    from transformers import MixtralConfig

    return MixtralConfig(
        hidden_size=H,
        intermediate_size=I_MOE,
        num_local_experts=E,
        num_experts_per_tok=K_TOP,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )


def _hf_block(family: str, norm_topk_prob: bool, impl: str) -> tuple[torch.nn.Module, bool, bool]:
    """A transformers MoE block with random weights, and (renormalize, float_weights) as pipeserve maps it."""
    if family == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        cfg, cls, renorm, float_weights = _mixtral_config(), MixtralSparseMoeBlock, True, True
    else:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        cfg, cls = _qwen3_moe_config(norm_topk_prob), Qwen3MoeSparseMoeBlock
        renorm, float_weights = norm_topk_prob, False
    cfg._experts_implementation = impl
    torch.manual_seed(0)
    block = cls(cfg).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.3)  # spread router logits: routing differs per token
    return block, renorm, float_weights


def _ours(block: torch.nn.Module, renorm: bool, float_weights: bool) -> SparseMoE:
    moe = SparseMoE(H, MoeSpec(E, K_TOP, I_MOE, renorm, float_weights))
    moe.gate.weight.data.copy_(block.gate.weight)
    moe.experts.gate_up_proj.data.copy_(block.experts.gate_up_proj)
    moe.experts.down_proj.data.copy_(block.experts.down_proj)
    return moe


CASES = [("mixtral", True), ("qwen3_moe", True), ("qwen3_moe", False)]


@pytest.mark.parametrize("impl", ["grouped_mm", "eager"])
@pytest.mark.parametrize(("family", "norm_topk_prob"), CASES)
def test_sparse_moe_matches_transformers(family: str, norm_topk_prob: bool, impl: str) -> None:
    block, renorm, float_weights = _hf_block(family, norm_topk_prob, impl)
    moe = _ours(block, renorm, float_weights)
    x = torch.randn(37, H, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, hf_weights, hf_ids = block.gate(x)
        weights, ids = moe.gate(x)
        expected = block(x[None])[0]
        got = moe(x)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights, rtol=0, atol=1e-7)
    assert len(set(ids.flatten().tolist())) == E  # every expert is exercised
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_single_token_and_unused_experts() -> None:
    """One token (a decode row) reaches only k of the E experts; the others are skipped."""
    block, renorm, float_weights = _hf_block("mixtral", True, "grouped_mm")
    moe = _ours(block, renorm, float_weights)
    x = torch.randn(1, H, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(moe(x), block(x[None])[0], rtol=1e-5, atol=1e-5)


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ModelLoadError, match=r"num_experts_per_tok 5 must be in 1\.\.the number of experts"):
        MoeSpec(E, E + 1, I_MOE, True, True)
