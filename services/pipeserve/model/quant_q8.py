"""8-bit block forms (EngineConfig.quantization int8 on the CPU, and GGUF's 8-bit and Q6_K blocks):
`Q8Linear`, w = q * d (+ m) over blocks of 32 (Q6_K: its own 6-bit packing, scales per 16), served
by the native kernels' q8_matmul on the CPU and Triton's q8_blocks_linear on CUDA; and
`ConcatLinear`, a fused projection whose checkpoint parts come in different forms (a Q4_K_M file's
q and k in Q4_K, its v in Q6_K). The 4-bit forms and the int8 per-channel form are model/quant.py's;
`quantize_model`, which picks among all of them for --quantization int8/int4, is here, above both.
"""

from __future__ import annotations

import functools
import logging
from typing import cast

import torch
from torch import nn

from pipeserve.model.gguf_types import Q6K_SCALE_BYTES, Q6K_VALUE_BYTES, QK_K, q8_block_scales, q8_values
from pipeserve.model.quant import Int4Linear, Int8Linear, native_kernels, triton_path

log = logging.getLogger(__name__)

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
