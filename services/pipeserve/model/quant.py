"""Weight-only quantized projections for the CPU (EngineConfig.quantization).

- int8: per output channel, symmetric: w = q * s, q in [-127, 127]; torch's
  `aten._weight_int8pack_mm`.
- int4: group-wise asymmetric (group g along the input dim): w = q * s + m, q in [0, 15];
  torch's `aten._weight_int4pack_mm_for_cpu`, whose scale/zero pair dequantizes as
  (q - 8) * s + z, so z = m + 8 * s.

Both kernels are fast only on bfloat16 activations (benchmarks/quant_linear.py): the input is
cast to bf16 and the output back to the model dtype. A quantized layer equals the float layer
built from its dequantized weight within bf16 activation rounding (tests/model/test_quant.py).
lm_head and the embedding stay float (the vocabulary matrix decides the argmax).
"""

from __future__ import annotations

import torch
from torch import nn


def quantize_int8(w: torch.Tensor, rows: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (int8 [N, K], scales [N]); `rows` at a time, so a vocabulary matrix's
    temporaries stay a few MB instead of several copies of the matrix."""
    q = torch.empty(w.shape, dtype=torch.int8)
    s = torch.empty(w.shape[0], dtype=torch.float32)
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
        if quantized is None:
            if weight is None:
                raise ValueError("Int8Linear needs a weight or its quantized form")
            quantized = quantize_int8(weight)
        q, s = quantized
        dtype = out_dtype if out_dtype is not None else (weight.dtype if weight is not None else None)
        if dtype is None:
            raise ValueError("Int8Linear built from blocks needs out_dtype")
        self.out_dtype = dtype
        self.register_buffer("qweight", q)
        self.register_buffer("scales", s.to(torch.bfloat16))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def dequantized(self) -> torch.Tensor:
        return self.qweight.float() * self.scales.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.aten._weight_int8pack_mm(
            x.reshape(-1, shape[-1]).to(torch.bfloat16), self.qweight, self.scales
        )
        y = y.to(self.out_dtype).reshape(*shape[:-1], -1)
        return y if self.bias is None else y + self.bias


class Int4Linear(nn.Module):
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
        and `out_dtype` names the model's dtype), else `weight` is quantized here."""
        super().__init__()
        if quantized is None:
            if weight is None:
                raise ValueError("Int4Linear needs a weight or its quantized form")
            quantized = quantize_int4(weight, group)
        q, s, m = quantized
        self.group = group
        dtype = out_dtype if out_dtype is not None else (weight.dtype if weight is not None else None)
        if dtype is None:
            raise ValueError("Int4Linear built from blocks needs out_dtype")
        self.out_dtype = dtype
        self.in_features = q.shape[1]
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        zeros = m + 8.0 * s  # the kernel's zero: (q - 8) * s + z
        sz = torch.stack([s, zeros], dim=2).transpose(0, 1).contiguous().to(torch.bfloat16)
        self.register_buffer("qweight", packed)
        self.register_buffer("scales_and_zeros", sz)  # [K/g, N, 2]
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def dequantized(self) -> torch.Tensor:
        """The float weight the kernel computes with (bf16 scale/zero included)."""
        n = self.scales_and_zeros.shape[1]
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        w = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.qweight, self.group, self.scales_and_zeros)
        return w.float().t().contiguous().reshape(n, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.reshape(-1, shape[-1]).to(torch.bfloat16), self.qweight, self.group, self.scales_and_zeros
        )
        y = y.to(self.out_dtype).reshape(*shape[:-1], -1)
        return y if self.bias is None else y + self.bias


def quantize_model(model: nn.Module, mode: str, group: int) -> None:
    """Swap every projection of the decoder layers (not lm_head) for its quantized form, in place."""
    from pipeserve.model.layers import Linear

    if mode in ("none", "gguf"):  # gguf: the loader installs the file's blocks (gguf_blocks.install)
        return
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, Linear) or name == "lm_head":
                continue
            w = child.weight.data
            if mode == "int4" and w.shape[1] % group:
                continue  # int4 needs whole groups along the input dim: this projection stays float
            new: nn.Module = Int8Linear(w, child.bias) if mode == "int8" else Int4Linear(w, child.bias, group)
            setattr(parent, name, new)
            del child, w
