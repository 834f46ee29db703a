"""StageModel: the slice of a decoder-only LM that one pipeline stage holds.

Stage 0 owns the embedding, every stage a contiguous range of decoder layers
[layer_lo, layer_hi), the last stage the final norm and lm_head. With one stage
it is the whole model. Its decoder layers are its architecture's (model/arch/: layer i of the
model is `arch.layer(cfg, i)`). forward() maps token ids (first stage) or hidden states
(others) of the step's T rows to hidden states [T, hidden].
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch
from torch import nn

from pipeserve.model.arch import get_arch
from pipeserve.model.config import ModelConfig
from pipeserve.model.layers import AttentionBatch, Linear, RMSNorm, make_norm
from pipeserve.model.native_decode import NativeDecoder
from pipeserve.model.quant import native_kernels
from pipeserve.model.rope import RotaryTable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageSpec:
    rank: int
    world_size: int
    layer_lo: int
    layer_hi: int

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.world_size - 1

    @property
    def num_layers(self) -> int:
        return self.layer_hi - self.layer_lo


class StageModel(nn.Module):
    def __init__(self, cfg: ModelConfig, stage: StageSpec, max_len: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.stage = stage
        # An explicit (uninitialized) weight: the loader fills it, and a meta-device
        # normal_() init would import torch._dynamo (~70 MiB resident in every stage).
        self.embed_tokens = (
            nn.Embedding(
                cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
            )
            if stage.is_first
            else None
        )
        arch = get_arch(cfg.model_type)
        self.layers = nn.ModuleList(arch.layer(cfg, i) for i in range(stage.layer_lo, stage.layer_hi))
        self.rotary = RotaryTable(cfg, max_len)
        # gemma3's sliding layers rotate with their own base (AttentionSpec.local_rope), unscaled.
        self.local_rotary = (
            RotaryTable(replace(cfg, rope_theta=cfg.local_rope_theta, rope_scaling=None), max_len)
            if cfg.local_rope_theta is not None
            else None
        )
        if stage.is_last:
            self.norm: RMSNorm | None = make_norm(cfg, cfg.hidden_size)
            self.lm_head: Linear | None = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        else:
            self.norm = None
            self.lm_head = None
        # Decode-only steps in one native call where the stage's layers allow (use_native_decode).
        self.native: NativeDecoder | None = None

    def pack_weights(self) -> None:
        """Projections into the kernels' layout (layers.Linear.pack_weight); once, after loading.

        A tied lm_head shares the embedding's tensor; packing it would keep a second copy of the
        vocabulary matrix, so it stays dense.
        """
        # One tensor under two names when the checkpoint ties them and this stage holds both.
        tied = self.cfg.tie_word_embeddings and self.embed_tokens is not None
        for module in self.modules():
            if isinstance(module, Linear) and not (tied and module is self.lm_head):
                module.pack_weight()

    def use_native_decode(self) -> bool:
        """Serve small decode-only steps with native_decode.NativeDecoder where this stage's layers
        allow it (every projection one the native kernels read, a layer decode.c implements: the arch
        says, arch.unsupported); once, after loading. Returns whether. A gap is said once in the log."""
        gaps = get_arch(self.cfg.model_type).unsupported(self.cfg)
        device = next(self.parameters()).device
        if "triton" in gaps and device.type == "cuda":
            log.info("stage %d: %s: PyTorch on CUDA (no Triton kernel)", self.stage.rank, gaps["triton"])
        if "sdpa" in gaps and device.type == "cpu":
            log.info(
                "stage %d: %s: the reference attention (explicit scores: SDPA has no soft-capping)",
                self.stage.rank,
                gaps["sdpa"],
            )
        if "native" in gaps:
            if native_kernels() is not None and device.type == "cpu":
                log.info(
                    "stage %d: decode steps run the PyTorch layers: the native decode step lacks %s (%s)",
                    self.stage.rank,
                    gaps["native"],
                    self.cfg.model_type,
                )
            return False
        self.native = NativeDecoder.for_model(list(self.layers), self.cfg.rms_norm_eps)  # type: ignore[arg-type]
        return self.native is not None

    def weight_bytes(self) -> int:
        """Bytes of every weight the stage holds, packed projections and quantized ones (buffers)
        included; the rotary table is not a weight."""
        packed = [m.weight for m in self.modules() if isinstance(m, Linear) and m.weight.is_mkldnn]
        tables = ("rotary.", "local_rotary.")
        quantized = [b for name, b in self.named_buffers() if not name.startswith(tables)]
        # A tied lm_head is a second Parameter over the embedding's storage: count storages once.
        dense = {p.data_ptr(): p.numel() * p.element_size() for p in self.parameters()}
        return sum(dense.values()) + sum(t.numel() * t.element_size() for t in packed + quantized)

    def forward(
        self,
        inputs: torch.Tensor,
        batch: AttentionBatch,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """inputs: ids [T] on the first stage, else hidden [T, hidden].

        kv_cache: [layers_local, 2, N, BS, KVH, D].
        """
        if self.embed_tokens is not None:
            x = self.embed_tokens(inputs)
            if self.cfg.embed_scale is not None:  # gemma: the scale rounded to the dtype, as transformers
                x = x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype)
        else:
            x = inputs
        if self.local_rotary is not None:
            local_cos, local_sin = self.local_rotary.gather(batch.positions)
            batch = replace(batch, local_cos=local_cos, local_sin=local_sin)
        if self.native is not None and self.native.accepts(batch, x.shape[0], kv_cache):
            return self.native.forward(x, batch, kv_cache)
        for i, layer in enumerate(self.layers):
            x = layer(x, batch, kv_cache[i, 0], kv_cache[i, 1])
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, hidden] (the rows to sample) -> float32 logits [R, vocab]."""
        if self.norm is None or self.lm_head is None:
            raise RuntimeError("compute_logits called on a stage without lm_head")
        logits = self.lm_head(self.norm(hidden))
        cap = self.cfg.final_logit_softcap
        if cap is not None:  # transformers' order, in the model dtype
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
