"""Weight-only quantized projections (EngineConfig.quantization), on the CPU and on CUDA.

- int8: per output channel, symmetric: w = q * s, q in [-127, 127]; torch's
  `aten._weight_int8pack_mm`.
- int4: group-wise asymmetric (group g along the input dim): w = q * s + m, q in [0, 15], stored
  as (q - 8) * s + z, so z = m + 8 * s, with s and z in bfloat16.

Int4Linear keeps one of two layouts (`layout`), chosen by the device it lives on:
- "nibbles" (uint8 [N, K/2], scales/zeros [2, N, K/g]), read by our own kernels: Triton on CUDA (or
  anywhere under PIPESERVE_KERNELS=triton), and on the CPU pipeserve_kernels.native (C, compiled
  at first use, which also runs a stage's whole decode step (model/native_decode.py). Activations
  stay float32.
- "int4pack", torch's `aten._weight_int4pack_mm_for_cpu`, on a CPU where the native kernels cannot
  be built (no C compiler) or under PIPESERVE_KERNELS=torch.
It converts between them exactly when moved (`.to()`), so a module built on one device serves on
another. Int8 runs torch's `aten._weight_int8pack_mm` on the CPU and Triton on CUDA.

torch's kernels are fast only on bfloat16 activations (benchmarks/quant_linear.py): the input is
cast to bf16 and the output back to the model dtype. A quantized layer equals the float layer
built from its dequantized weight within that rounding (tests/model/test_quant.py); either
layout's `dequantized()` is the weight its kernel computes with, the reference of the tests.
lm_head and the embedding stay float unless a GGUF file quantized them (gguf_blocks.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from pipeserve_kernels.native import Native

log = logging.getLogger(__name__)

NIBBLE_LAYOUT = "nibbles"
INT4PACK_LAYOUT = "int4pack"


def triton_path(device: torch.device) -> bool:
    """The Triton kernels serve tensors on `device`: CUDA, or any device under PIPESERVE_KERNELS=triton."""
    import pipeserve_kernels

    return device.type == "cuda" or pipeserve_kernels.BACKEND == "triton"


def native_kernels() -> Native | None:
    """pipeserve_kernels' native CPU kernels where the backend is auto and they build."""
    import pipeserve_kernels
    from pipeserve_kernels import native

    return native.load() if pipeserve_kernels.BACKEND == "auto" else None


def int4_layout(device: torch.device) -> str:
    """The nibble layout where a kernel of ours reads it (Triton; the native ones on the CPU), else
    int4pack."""
    if triton_path(device) or (device.type == "cpu" and native_kernels() is not None):
        return NIBBLE_LAYOUT
    return INT4PACK_LAYOUT


def quantize_int8(w: torch.Tensor, rows: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (int8 [N, K], scales [N]); `rows` at a time, so a vocabulary matrix's
    temporaries stay a few MB instead of several copies of the matrix."""
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    s = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
    for lo in range(0, w.shape[0], rows):
        part = w[lo : lo + rows].float()
        s[lo : lo + rows] = (part.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        q[lo : lo + rows] = torch.round(part / s[lo : lo + rows, None]).clamp(-127, 127)
    return q, s


def quantize_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] float -> (q uint8 [N, K] in 0..15, scales [N, K/g], mins [N, K/g])."""
    n, k = w.shape
    if k % group:
        raise ValueError(f"in_features {k} is not a multiple of the group size {group}")
    g = w.float().reshape(n, k // group, group)
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    s = ((hi - lo) / 15.0).clamp(min=1e-12)
    q = torch.round((g - lo[..., None]) / s[..., None]).clamp(0, 15).to(torch.uint8)
    return q.reshape(n, k), s, lo


def dequantize_int4(q: torch.Tensor, s: torch.Tensor, m: torch.Tensor, group: int) -> torch.Tensor:
    n, k = q.shape
    g = q.float().reshape(n, k // group, group)
    return (g * s[..., None] + m[..., None]).reshape(n, k)


def _source(
    kind: str,
    weight: torch.Tensor | None,
    quantized: tuple | None,
    out_dtype: torch.dtype | None,
    quantize: Callable[[torch.Tensor], tuple],
) -> tuple[tuple, torch.dtype]:
    """A quantized layer's (quantized tensors, output dtype): given already quantized (GGUF blocks,
    then `out_dtype` is required), or quantized here from `weight` (whose dtype is the default)."""
    if quantized is None:
        if weight is None:
            raise ValueError(f"{kind} needs a weight or its quantized form")
        quantized = quantize(weight)
    dtype = out_dtype if out_dtype is not None else (weight.dtype if weight is not None else None)
    if dtype is None:
        raise ValueError(f"{kind} built from blocks needs out_dtype")
    return quantized, dtype


class Int8Linear(nn.Module):
    qweight: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        out_dtype: torch.dtype | None = None,
        quantized: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """`quantized`: (q, per-channel scales) made elsewhere (GGUF Q8_0 blocks); then `weight` is
        None and `out_dtype` names the model's dtype."""
        super().__init__()
        (q, s), self.out_dtype = _source("Int8Linear", weight, quantized, out_dtype, quantize_int8)
        self.register_buffer("qweight", q)
        self.register_buffer("scales", s.to(torch.bfloat16))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def dequantized(self) -> torch.Tensor:
        return self.qweight.float() * self.scales.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if triton_path(x.device):
            from pipeserve_kernels.triton_quant import int8_linear

            y = int8_linear(x.reshape(-1, shape[-1]).contiguous(), self.qweight, self.scales)
        else:
            y = torch.ops.aten._weight_int8pack_mm(
                x.reshape(-1, shape[-1]).to(torch.bfloat16), self.qweight, self.scales
            )
        y = y.to(self.out_dtype).reshape(*shape[:-1], -1)
        return y if self.bias is None else y + self.bias


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """q uint8 [N, K] in 0..15 -> uint8 [N, K/2]: element 2j in the low nibble of byte j, 2j + 1 high."""
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 15, packed >> 4], dim=2).reshape(packed.shape[0], -1)


def _cpu_pack(q: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)


def _cpu_unpack(packed: torch.Tensor, n: int, k: int, group: int) -> torch.Tensor:
    """The q [N, K] inside torch's CPU int4pack (its layout depends on the CPU's vector width): the
    kernel itself reads it back exactly, with scale 1 and zero 8 ((q - 8) * 1 + 8 = q, exact in bf16)."""
    unit = torch.ones(k // group, n, 2, dtype=torch.bfloat16)
    unit[..., 1] = 8.0
    eye = torch.eye(k, dtype=torch.bfloat16)
    q = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, packed, group, unit)
    return q.t().round().to(torch.uint8)


class Int4Linear(nn.Module):
    """w = (q - 8) * s + z per group (z = m + 8 s), s and z in bfloat16.

    layout "int4pack" (CPU): qweight = torch's CPU int4pack, scales_and_zeros bf16 [K/g, N, 2].
    layout "triton" (CUDA, PIPESERVE_KERNELS=triton): qweight = uint8 [N, K/2] (pack_nibbles),
    scales_and_zeros bf16 [2, N, K/g] (scales, zeros), triton_quant.int4_linear's layout.
    """

    qweight: torch.Tensor
    scales_and_zeros: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        group: int,
        quantized: tuple | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> None:
        """`quantized`: (q, scales, mins) already in int4 form (GGUF blocks; then `weight` may be None
        and `out_dtype` names the model's dtype), else `weight` is quantized here. The layout is
        the one of q's device."""
        super().__init__()
        (q, s, m), self.out_dtype = _source(
            "Int4Linear", weight, quantized, out_dtype, lambda w: quantize_int4(w, group)
        )
        self.group = group
        self.in_features = q.shape[1]
        self.out_features = q.shape[0]
        zeros = m + 8.0 * s  # the kernel's zero: (q - 8) * s + z
        self.layout = int4_layout(q.device)
        if self.layout == NIBBLE_LAYOUT:
            packed = pack_nibbles(q)
            sz = torch.stack([s, zeros]).to(torch.bfloat16).contiguous()
        else:
            packed = _cpu_pack(q)
            sz = torch.stack([s, zeros], dim=2).transpose(0, 1).contiguous().to(torch.bfloat16)
        self.register_buffer("qweight", packed)
        self.register_buffer("scales_and_zeros", sz)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Int4Linear:
        """Moves like any module, then converts to the layout of the new device (exact)."""
        super()._apply(fn, recurse)
        want = int4_layout(self.qweight.device)
        if want == self.layout:
            return self
        device, n, k = self.qweight.device, self.out_features, self.in_features
        if want == NIBBLE_LAYOUT:  # int4pack -> nibbles: read back on the CPU, where its kernel runs
            q = _cpu_unpack(self.qweight.cpu(), n, k, self.group)
            self.qweight = pack_nibbles(q).to(device)
            self.scales_and_zeros = self.scales_and_zeros.permute(2, 1, 0).contiguous()
        else:
            self.qweight = _cpu_pack(unpack_nibbles(self.qweight.cpu())).to(device)
            self.scales_and_zeros = self.scales_and_zeros.permute(2, 1, 0).contiguous()
        self.layout = want
        return self

    def dequantized(self) -> torch.Tensor:
        """The float weight the kernel computes with (bf16 scale/zero included)."""
        n, k, g = self.out_features, self.in_features, self.group
        if self.layout == NIBBLE_LAYOUT:
            q = unpack_nibbles(self.qweight).float().reshape(n, k // g, g)
            s, z = self.scales_and_zeros.float()
            return ((q - 8.0) * s[..., None] + z[..., None]).reshape(n, k)
        eye = torch.eye(k, dtype=torch.bfloat16)
        w = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.qweight, g, self.scales_and_zeros)
        return w.float().t().contiguous().reshape(n, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.layout == NIBBLE_LAYOUT and triton_path(x.device):
            from pipeserve_kernels.triton_quant import int4_linear

            sz = self.scales_and_zeros
            y = int4_linear(x2.contiguous(), self.qweight, sz[0], sz[1], self.group)
        elif self.layout == NIBBLE_LAYOUT:  # the CPU with the native kernels
            sz = self.scales_and_zeros
            kernels = native_kernels()
            if kernels is None:  # the layout is chosen only where it loaded
                raise RuntimeError("Int4Linear in the nibble layout on a CPU without the native kernels")
            y = kernels.int4_linear(x2.float(), self.qweight, sz[0], sz[1], self.group, self.bias)
            return y.to(self.out_dtype).reshape(*shape[:-1], -1)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2.to(torch.bfloat16), self.qweight, self.group, self.scales_and_zeros
            )
        y = y.to(self.out_dtype).reshape(*shape[:-1], -1)
        return y if self.bias is None else y + self.bias
