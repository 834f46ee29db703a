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

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from pipeserve.model.gguf_types import Q6K_SCALE_BYTES, Q6K_VALUE_BYTES, QK_K, q8_block_scales, q8_values

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


Q8_BLOCK = 32  # GGUF's Q8_0 block


def quantize_q8(w: torch.Tensor, rows: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (int8 [N, K], float32 scales [N, K/32]): Q8_0, symmetric per block of 32."""
    n, k = w.shape
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    d = torch.empty(n, k // Q8_BLOCK, dtype=torch.float32, device=w.device)
    for lo in range(0, n, rows):
        part = w[lo : lo + rows].float().reshape(-1, k // Q8_BLOCK, Q8_BLOCK)
        d[lo : lo + rows] = part.abs().amax(dim=2) / 127.0
        scale = d[lo : lo + rows].clamp(min=1e-12)[..., None]
        q[lo : lo + rows] = torch.round(part / scale).clamp(-127, 127).reshape(-1, k).to(torch.int8)
    return q, d


class Q8Linear(nn.Module):
    """w = q * d (+ m) over blocks along the input dim, served by dense.c's q8_matmul: GGUF's Q8_0
    (d per 32), and the int8 form of Q5_0, Q5_1, Q5_K (d and a min m per 32) that gguf_blocks.py
    serves those types in, exactly; and Q6_K at the file's own size (w = d sc (q - 32) per 16): q
    its 6-bit packing (uint8 [N, K/256 * 192], gguf_types.q6k_values), d its float per 256 and int8
    sub-scales (uint8 [N, K/256 * 20], gguf_types.pack_q6k_scales).

    Q8_0 is built only on a CPU with the native kernels (`q8_native`); per-block scales keep a GGUF
    file's Q8_0 tensors exact (Int8Linear's per-channel scales requantize them) and quantize a float
    weight ~4x finer. The GGUF forms also serve elsewhere (`fallback`): on CUDA (or under
    PIPESERVE_KERNELS=triton) triton_quant.q8_blocks_linear; under PIPESERVE_KERNELS=torch the exact
    weight dequantized per call into torch's product, said once in the log. A tied GGUF head shares
    the embedding's blocks (one copy of the vocabulary matrix).
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    bias: torch.Tensor | None

    def __init__(
        self,
        q: torch.Tensor,
        d: torch.Tensor,
        bias: torch.Tensor | None,
        out_dtype: torch.dtype,
        mins: torch.Tensor | None = None,
        fallback: bool = False,
    ) -> None:
        super().__init__()
        q6k = q.dtype == torch.uint8  # Q6_K's packing, with its scales packed as uint8 too
        n, k = q.shape[0], q.shape[1] // Q6K_VALUE_BYTES * QK_K if q6k else q.shape[1]
        want = (n, k // QK_K * Q6K_SCALE_BYTES) if q6k else (n, k // Q8_BLOCK)
        if q.shape[1] % (Q6K_VALUE_BYTES if q6k else Q8_BLOCK) or tuple(d.shape) != want:
            raise ValueError(
                f"Q8Linear: q {tuple(q.shape)} {q.dtype} and d {tuple(d.shape)} are neither int8 blocks "
                "with float scales per 32 nor Q6_K's packing with its scales per 256"
            )
        if mins is not None and tuple(mins.shape) != (n, k // Q8_BLOCK):
            raise ValueError(f"Q8Linear: mins {tuple(mins.shape)} are not one per block of 32")
        kernels = native_kernels()
        if kernels is None and not fallback:
            raise ValueError("Q8Linear needs the native CPU kernels")
        self._kernels = kernels
        self.register_buffer("qweight", q)
        self.register_buffer("scales", d if q6k else d.float())
        self.in_features = k
        self.register_buffer("mins", None if mins is None else mins.float())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.out_dtype = out_dtype

    @property
    def sub(self) -> int:
        """Elements per scale: 32, or 16 (Q6_K)."""
        return 16 if self.qweight.dtype == torch.uint8 else Q8_BLOCK

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    def dequantized(self) -> torch.Tensor:
        """The float32 weight the kernel computes with: q * d (+ m), as gguf dequantizes the file."""
        n, k = self.out_features, self.in_features
        w = q8_values(self.qweight).float().reshape(n, -1, self.sub) * q8_block_scales(self.scales)[..., None]
        if self.mins is not None:
            w = w.reshape(n, -1, Q8_BLOCK) + self.mins[..., None]
        return w.reshape(n, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if triton_path(x.device):
            from pipeserve_kernels.triton_quant import q8_blocks_linear

            # Q6_K's values and scales per 16 expanded per call (10 bits a weight, transient): the
            # Triton kernel's form
            q, d = q8_values(self.qweight), q8_block_scales(self.scales)
            y = q8_blocks_linear(x2.contiguous(), q, d, self.mins)
            y = y if self.bias is None else y + self.bias.to(y.dtype)
            return y.to(self.out_dtype).reshape(*shape[:-1], -1)
        if self._kernels is not None and x.device.type == "cpu":
            y = self._kernels.int8_linear(x2.float(), self.qweight, self.scales, self.bias, self.mins)
            return y.to(self.out_dtype).reshape(*shape[:-1], -1)
        _fallback_once()
        w = self.dequantized().to(x.dtype)
        y = torch.nn.functional.linear(x2, w, None if self.bias is None else self.bias.to(x.dtype))
        return y.to(self.out_dtype).reshape(*shape[:-1], -1)


@functools.cache
def _fallback_once() -> None:
    log.warning(
        "8-bit GGUF blocks (Q5_0/Q5_1/Q5_K/Q6_K form) without the native or Triton kernels "
        "(PIPESERVE_KERNELS=torch): each projection dequantizes its exact weight per call for torch"
    )


class ConcatLinear(nn.Module):
    """A fused projection whose checkpoint parts are served in different forms (a Q4_K_M file's q and
    k in Q4_K, its v in Q6_K): y = cat(part(x) for part in parts), the parts' rows stacked in order.
    decode.c's decode step reads it as W_CAT (model/native_decode.py)."""

    parts: nn.ModuleList
    native_parts: object  # decode.c's view of the parts (a ctypes array), set by native_decode

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = cast(int, parts[0].in_features)
        self.out_features = sum(cast(int, p.out_features) for p in parts)
        self.native_parts = None

    def dequantized(self) -> torch.Tensor:
        return torch.cat([cast(Int4Linear | Q8Linear, p).dequantized() for p in self.parts.children()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts.children()], dim=-1)


def q8_native(device: torch.device) -> bool:
    """Q8Linear serves 8-bit weights on `device` (a CPU with the native kernels)."""
    return device.type == "cpu" and native_kernels() is not None


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
            new: nn.Module
            if mode == "int4":
                new = Int4Linear(w, child.bias, group)
            elif q8_native(w.device) and w.shape[1] % Q8_BLOCK == 0:
                new = Q8Linear(*quantize_q8(w), child.bias, w.dtype)
            else:
                new = Int8Linear(w, child.bias)
            setattr(parent, name, new)
            del child, w
