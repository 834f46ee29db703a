"""A stage's decode step in one native call (pipeserve_kernels.native, decode.c::decode_step).

Why: a decode step of a small model is op-call bound in PyTorch (~200 ATen calls per layer for a
4-bit one, ~0.5 ms of dispatch and Python per layer against ~0.1 ms of weight reads;
benchmarks/RESULTS.md, issue 22). decode.c runs every layer of the stage for the step's rows in one
call: norms, the projections, rotary, the KV store, paged attention, SiLU and the residuals, in
float32.

It serves a step only when every row decodes one token (no prefill chunk), there are at most
MAX_ROWS rows, and the pool is float32, float16 or bfloat16. Every other step runs the PyTorch
layers on the same weights and the same pool: the two paths interleave freely. Equal to the
PyTorch path within float32 rounding (tests/model/test_native_decode.py).

Built for stages whose every decoder projection is one the native kernels read: an Int4Linear in
the nibble layout (`--quantization int4|gguf` on a CPU where they build), a Q8Linear (`int8`), or a
dense float32 Linear (the float32 path on such a CPU, where the weights are kept dense instead of
packed for oneDNN), with float32 activations.
"""

from __future__ import annotations

import ctypes

import torch

from pipeserve.model.layers import AttentionBatch, DecoderLayer, Linear
from pipeserve.model.quant import NIBBLE_LAYOUT, Int4Linear, native_kernels
from pipeserve.model.quant_q8 import ConcatLinear, Q8Linear
from pipeserve_kernels.cpu_linear import native_f32_rows, native_weight
from pipeserve_kernels.native import KV_DTYPES, Q4, W_CAT, W_F32, W_Q4, W_Q8, Dims, Layer

# The most decode rows one native step takes: below this its products beat torch's batched ones
# (benchmarks/RESULTS.md, issue 22); a float32 stage takes at most what its CPU's calibration
# allows (cpu_linear.native_f32_rows).
MAX_ROWS = 32


def _q4(lin: torch.nn.Module) -> Q4:
    """decode.c's view of one projection (_servable checked it is one of the three kinds)."""
    b = getattr(lin, "bias", None)
    bias = b.data_ptr() if isinstance(b, torch.Tensor) else None
    if isinstance(lin, Int4Linear):
        sz = lin.scales_and_zeros  # [2, N, K/g]: contiguous, so sz[0] and sz[1] are too
        args = (lin.qweight.data_ptr(), sz[0].data_ptr(), sz[1].data_ptr(), bias)
        return Q4(*args, lin.out_features, lin.in_features, lin.group, W_Q4)
    if isinstance(lin, Linear):
        n, k = lin.weight.shape
        return Q4(lin.weight.data_ptr(), None, None, bias, n, k, 0, W_F32)
    if isinstance(lin, Q8Linear):
        n, k = lin.out_features, lin.in_features  # Q6_K's qweight is its packing, not [N, K]
        mins = None if lin.mins is None else lin.mins.data_ptr()  # GGUF's Q5_1/Q5_K form; sub: Q6_K's 16
        return Q4(lin.qweight.data_ptr(), lin.scales.data_ptr(), mins, bias, n, k, lin.sub, W_Q8)
    if isinstance(lin, ConcatLinear):  # the parts' array lives as long as the module
        parts = (Q4 * len(lin.parts))(*map(_q4, lin.parts))
        lin.native_parts = parts
        return Q4(
            ctypes.addressof(parts), None, None, None, lin.out_features, lin.in_features, len(parts), W_CAT
        )
    raise TypeError(f"{type(lin).__name__} is not a projection the native kernels read")


def _projection_kind(p: torch.nn.Module) -> int | None:
    """W_Q4 for a CPU Int4Linear in the nibble layout, W_F32 for a dense float32 Linear (not packed
    for oneDNN), W_Q8 for a Q8Linear, else None."""
    if isinstance(p, Int4Linear) and p.layout == NIBBLE_LAYOUT and p.qweight.device.type == "cpu":
        return W_Q4
    if isinstance(p, Linear) and native_weight(p.weight):
        return W_F32
    if isinstance(p, Q8Linear) and p.qweight.device.type == "cpu":
        return W_Q8
    if isinstance(p, ConcatLinear) and all(_projection_kind(q) in (W_Q4, W_Q8) for q in p.parts):
        return W_CAT
    return None


def _projections(layer: DecoderLayer) -> tuple[torch.nn.Module, ...]:
    """A layer's projections in decode.c's Layer order."""
    return (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)


def _servable(layer: DecoderLayer) -> bool:
    """Every projection of one kind the native kernels read; float32 norms."""
    kinds = {_projection_kind(p) for p in _projections(layer)}
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    return None not in kinds and all(n.weight.dtype == torch.float32 for n in norms)


class NativeDecoder:
    """Holds the ctypes view of a stage's layers; the tensors it points at belong to the model, which
    must not move or reload them while this object lives (the loader builds it last)."""

    def __init__(self, layers: list[DecoderLayer], rms_norm_eps: float) -> None:
        kernels = native_kernels()
        if kernels is None or not layers or not all(_servable(layer) for layer in layers):
            raise ValueError("the native decode step needs the native kernels and projections it reads")
        if layers[0].self_attn.head_dim % 16:
            raise ValueError("decode.c's attention reads heads in vectors of 16 floats")
        self._kernels = kernels
        attn, mlp = layers[0].self_attn, layers[0].mlp
        # float32 projections: only as many rows as the native product wins on this CPU (calibrated)
        dense = any(_projection_kind(p) == W_F32 for layer in layers for p in _projections(layer))
        self.max_rows = min(MAX_ROWS, native_f32_rows(kernels)) if dense else MAX_ROWS
        self.num_layers = len(layers)
        self.hidden = attn.o_proj.out_features
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.inter = mlp.down_proj.in_features
        self.eps, self.scale = rms_norm_eps, attn.scale
        self._layers = (Layer * len(layers))(
            *(
                Layer(
                    layer.input_layernorm.weight.data_ptr(),
                    layer.post_attention_layernorm.weight.data_ptr(),
                    *map(_q4, _projections(layer)),  # decode.c's Layer order: qkv, o, gate_up, down
                )
                for layer in layers
            )
        )
        # The model's tensors stay referenced here too: freeing one would leave a dangling pointer.
        self._keep = [t for layer in layers for t in layer.state_dict(keep_vars=True).values()]

    @classmethod
    def for_model(cls, layers: list[DecoderLayer], rms_norm_eps: float) -> NativeDecoder | None:
        """The decoder where the stage can use it, else None (the PyTorch layers serve every step)."""
        try:
            return cls(layers, rms_norm_eps)
        except ValueError:
            return None

    def accepts(self, batch: AttentionBatch, rows: int, kv_cache: torch.Tensor) -> bool:
        return (
            batch.num_decode == rows  # every row decodes: no prefill chunk in the step
            and 0 < rows <= self.max_rows
            and kv_cache.dtype in KV_DTYPES
            and kv_cache.is_contiguous()
            and kv_cache.shape[0] == self.num_layers
        )

    def forward(self, x: torch.Tensor, batch: AttentionBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """x [B, hidden] -> hidden [B, hidden] after every layer; writes each row's new K/V into
        kv_cache [layers, 2, N, BS, KVH, D]. Call only where accepts() holds."""
        rows = x.shape[0]
        out = x.to(torch.float32, copy=True).contiguous()  # updated in place by the kernel
        if len(batch.decodes) == 1:
            tables, lens = batch.decodes[0].block_tables, batch.decodes[0].context_lens
        else:
            groups = sorted(batch.decodes, key=lambda g: g.row)  # rows in order, as x's
            width = max(g.block_tables.shape[1] for g in groups)
            pad = torch.nn.functional.pad
            tables = torch.cat([pad(g.block_tables, (0, width - g.block_tables.shape[1])) for g in groups])
            lens = torch.cat([g.context_lens for g in groups])
        tables = tables.to(torch.int64).contiguous()
        lens = lens.to(torch.int64).contiguous()
        slots = batch.slot_mapping.to(torch.int64).contiguous()
        cos = batch.cos.to(torch.float32).contiguous()
        sin = batch.sin.to(torch.float32).contiguous()
        dims = Dims(
            self.hidden, self.heads, self.kv_heads, self.head_dim, self.inter,
            kv_cache.shape[2], kv_cache.shape[3], self.eps, self.scale, KV_DTYPES[kv_cache.dtype],
        )  # fmt: skip
        self._kernels.decode_step(
            ctypes.byref(dims), self._layers, self.num_layers, rows, out.data_ptr(), cos.data_ptr(),
            sin.data_ptr(), slots.data_ptr(), tables.data_ptr(), tables.shape[1], lens.data_ptr(),
            kv_cache.data_ptr(),
        )  # fmt: skip
        return out.to(x.dtype)
