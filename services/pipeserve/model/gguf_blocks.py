"""A GGUF file's quantized blocks, kept beside the float checkpoint it converts to (`--quantization gguf`).

`convert_gguf` writes `quantized.safetensors` next to `model.safetensors`: for every tensor the
file stores in a block type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), the block contents
under its HF name, q/k rows already in HF order, in the served form gguf_types.py gives each type.
Serving with `--quantization gguf` reads the projections from it instead of the float32 tensors,
so the weights computed with are the file's own blocks, not a requantization:

* form int4 (Q4_0, Q4_1, Q4_K): an `Int4Linear` with group 32 and the file's q, scale and min
  (only those two round to bfloat16, the kernel's type); an embedding in this form gathers its rows
  from the same nibbles (`Int4Embedding`, shared with a tied head).
* form q8 (Q8_0, Q5_0, Q5_1, Q5_K, Q6_K): a `Q8Linear` (int8 values, float32 scales per 32, or
  Q6_K's own 6-bit packing with its d per 256 and int8 sub-scales; float32 mins), exact, on the native
  CPU kernels; elsewhere Q8_0 is requantized per output channel
  for `Int8Linear` (torch's int8 kernel) and the others dequantize per call (quant_q8.Q8Linear). An
  embedding gathers its rows exactly (`Q8Embedding`).
* A fused projection whose parts differ in form (a Q4_K_M file's v in Q6_K beside q and k in Q4_K)
  is a `ConcatLinear` of the parts' forms.
* F32, F16 and BF16 tensors have no blocks: the float checkpoint serves them in the model's dtype.

Layout of `quantized.safetensors`, per HF tensor NAME (N rows, K inputs, K % 32 == 0):
  NAME.qs  uint8 [N, K/32, 16]  int4: element j of a block is qs[j] & 15, element 16 + j is qs[j] >> 4
  NAME.q8  int8  [N, K]         q8
  NAME.q6  uint8 [N, K/256 * 192]  Q6_K's ql and qh per super-block, as the file has them
  NAME.d   float16 or float32 [N, K/32] (Q6_K: float32 [N, K/256])  the block (super-block) scale
  NAME.m   float16 or float32 [N, K/32]  the block minimum (int4; q8 where the type has one)
  NAME.sc  int8  [N, K/16]       Q6_K's sub-block scales
The header's metadata says `format: gguf-blocks`, the block size, and (JSON) each tensor's GGUF
`types` and served `forms` (int4, q8 or dense), for every tensor of the file.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from pipeserve.errors import ModelLoadError
from pipeserve.model.config import ModelConfig
from pipeserve.model.gguf_types import pack_q6k_scales, q8_block_scales, q8_values
from pipeserve.model.memory import return_freed_memory
from pipeserve.model.stage_model import StageModel, StageSpec

BLOCKS_FILE = "quantized.safetensors"
BLOCK = 32
FORMAT = "gguf-blocks"


def permute_blocks(blocks: dict[str, torch.Tensor], permute: Callable[[torch.Tensor], torch.Tensor]):
    """Apply a row permutation (llama.cpp's q/k one undone) to every entry: blocks lie within rows."""
    return {k: permute(v) for k, v in blocks.items()}


class GgufBlocks:
    """The blocks of one converted checkpoint; tensors are read on demand (one projection at a time)."""

    def __init__(self, model_dir: str | Path) -> None:
        self._file: Any = None  # safe_open while inside `with`
        self.path = Path(model_dir) / BLOCKS_FILE
        if not self.path.is_file():
            raise ModelLoadError(
                f"--quantization gguf serves a checkpoint converted from a GGUF file (`pipeserve "
                f"convert-gguf`), which writes {BLOCKS_FILE}; {model_dir} has none"
            )
        with safe_open(str(self.path), framework="pt") as f:  # the header only: no tensor is read
            meta = f.metadata() or {}
            self.keys = set(f.keys())
        if meta.get("format") != FORMAT or int(meta.get("block", 0)) != BLOCK:
            raise ModelLoadError(f"{self.path} is not a {FORMAT} file with block size {BLOCK}")
        self.names = {k.rsplit(".", 1)[0] for k in self.keys}
        # GGUF type and served form per tensor (files converted before K-quants: Q4_0/Q4_1/Q8_0 only)
        self.types: dict[str, str] = json.loads(meta.get("types", "{}"))
        self.forms: dict[str, str] = json.loads(meta.get("forms", "{}"))

    def __enter__(self) -> GgufBlocks:
        # One handle for the whole install: each open parses the header of every tensor again
        # (~1.5 ms per projection on a 135M file, a fifth of its load).
        self._file = safe_open(str(self.path), framework="pt")
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.__exit__(None, None, None)
        self._file = None

    def _get(self, keys: list[str]) -> list[torch.Tensor]:
        if self._file is None:
            raise RuntimeError("GgufBlocks is read inside `with GgufBlocks(...) as blocks:`")
        # copies: a tensor left on the file's mmap keeps the whole mapping resident
        return [self._file.get_tensor(k).clone() for k in keys]

    def kind(self, name: str) -> str:
        return "q4" if f"{name}.qs" in self.keys else "q8"

    def type(self, name: str) -> str:
        """The tensor's GGUF type name (a file without the record: Q8_0 for its 8-bit blocks)."""
        return self.types.get(name, "Q4_x" if self.kind(name) == "q4" else "Q8_0")

    def int4(self, names: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The Q4 blocks of `names` stacked by rows (a fused projection): q uint8 [N, K] in 0..15,
        d and m float32 [N, K/32]."""
        qs, ds, ms = [], [], []
        for name in names:
            if self.kind(name) != "q4":
                raise ModelLoadError(f"{name} ({self.type(name)}) is not in the int4 form")
            q, d, m = self._get([f"{name}.qs", f"{name}.d", f"{name}.m"])
            qs.append(torch.cat([q & 15, q >> 4], dim=-1).reshape(q.shape[0], -1))
            ds.append(d.float())
            ms.append(m.float())
        return torch.cat(qs), torch.cat(ds), torch.cat(ms)

    def q8(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """int8 [N, K] (Q6_K: its 6-bit packing, uint8 [N, K/256 * 192]), scales (float32 [N, K/32];
        Q6_K: uint8 [N, K/256 * 20], d and its sub-scales, gguf_types.pack_q6k_scales) and mins
        float32 [N, K/32] or None: Q8Linear's arguments."""
        if f"{name}.q6" in self.keys:  # Q6_K: its packing and packed scales
            q, d, sc = self._get([f"{name}.q6", f"{name}.d", f"{name}.sc"])
            return q, pack_q6k_scales(d.float(), sc), None
        keys = [f"{name}.q8", f"{name}.d"] + ([f"{name}.m"] if f"{name}.m" in self.keys else [])
        q, d, *m = self._get(keys)
        return q, d.float(), m[0].float() if m else None

    def dequantized(self, names: list[str]) -> torch.Tensor:
        """The float32 weight of `names` stacked by rows, as the file defines it."""
        out = []
        for name in names:
            if self.kind(name) == "q4":
                q, d, m4 = self.int4([name])
                g = q.float().reshape(q.shape[0], -1, BLOCK)
                out.append((g * d[..., None] + m4[..., None]).reshape(q.shape))
            else:
                q, packed, m8 = self.q8(name)
                q8, d = q8_values(q), q8_block_scales(packed)
                w = q8.float().reshape(q8.shape[0], d.shape[1], -1) * d[..., None]
                if m8 is not None:
                    w = w.reshape(q8.shape[0], -1, BLOCK) + m8[..., None]
                out.append(w.reshape(q8.shape))
        return torch.cat(out)


class Q8Embedding(nn.Module):
    """An embedding over 8-bit blocks: the rows asked for are dequantized exactly (d * q (+ m)) on
    gather; scales per 32 (Q6_K: per 16, packed), mins per 32 or None."""

    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None

    def __init__(
        self, q: torch.Tensor, d: torch.Tensor, dtype: torch.dtype, mins: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        self.register_buffer("qweight", q)  # int8 [V, K], or Q6_K's packing uint8 [V, K/256 * 192]
        self.register_buffer("scales", d)  # float32 [V, K/32], or Q6_K's packed uint8 [V, K/256 * 20]
        self.register_buffer("mins", mins)  # float32 [V, K/32] or None
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        q = q8_values(self.qweight[ids]).float()
        d = q8_block_scales(self.scales[ids])  # Q6_K's packing and scales lie within their row
        rows = q.reshape(*q.shape[:-1], d.shape[-1], -1) * d[..., None]
        if self.mins is not None:
            rows = rows.reshape(*q.shape[:-1], -1, BLOCK) + self.mins[ids][..., None]
        return rows.reshape(q.shape).to(self.dtype)


class Int4Embedding(nn.Module):
    """An embedding over the int4 form, in Int4Linear's nibble layout (a tied head's own tensors):
    row = (q - 8) * s + z per group of 32, s and z bfloat16, as the head computes with."""

    qweight: torch.Tensor
    scales_and_zeros: torch.Tensor

    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("qweight", packed)  # uint8 [V, K/2] (quant.pack_nibbles)
        self.register_buffer("scales_and_zeros", scales_and_zeros)  # bfloat16 [2, V, K/32]
        self.dtype = dtype

    @classmethod
    def from_blocks(cls, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, dtype: torch.dtype):
        from pipeserve.model.quant import pack_nibbles

        return cls(pack_nibbles(q), torch.stack([d, m + 8.0 * d]).to(torch.bfloat16).contiguous(), dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        from pipeserve.model.quant import unpack_nibbles

        packed = self.qweight[ids]
        q = unpack_nibbles(packed.reshape(-1, packed.shape[-1])).float().reshape(*ids.shape, -1, BLOCK)
        s, z = self.scales_and_zeros[0][ids].float(), self.scales_and_zeros[1][ids].float()
        return ((q - 8.0) * s[..., None] + z[..., None]).reshape(*ids.shape, -1).to(self.dtype)


# StageModel module path (per local layer) -> the checkpoint projections it fuses, in row order.
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


def _q8_linear(
    blocks: GgufBlocks, name: str, q8: tuple, dtype: torch.dtype, device: torch.device
) -> nn.Module:
    """The served form of one tensor's (or stacked tensors') 8-bit blocks `q8` = (q, d, m)."""
    from pipeserve.model.quant import Int8Linear, quantize_int8
    from pipeserve.model.quant_q8 import Q8Linear, q8_native

    q, d, m = q8
    if q8_native(device):  # the blocks themselves, exact
        return Q8Linear(q, d, None, dtype, mins=m)
    if blocks.type(name) != "Q8_0":  # no per-channel requantization of these: exact, dequantized per call
        return Q8Linear(q, d, None, dtype, mins=m, fallback=True)
    # Elsewhere Q8_0's per-block scales -> Int8Linear's per-channel ones, requantized from the exact
    # values a slice of rows at a time (a vocabulary matrix in float32 would be ~4x the file's bytes).
    qs, s = torch.empty_like(q), torch.empty(q.shape[0])
    for lo in range(0, q.shape[0], 4096):
        rows = slice(lo, lo + 4096)
        w = q[rows].float().reshape(-1, q.shape[1] // BLOCK, BLOCK) * d[rows][..., None]
        qs[rows], s[rows] = quantize_int8(w.reshape(-1, q.shape[1]))
    return Int8Linear(None, None, out_dtype=dtype, quantized=(qs, s))


def _quantized_linear(
    blocks: GgufBlocks, names: list[str], dtype: torch.dtype, device: torch.device
) -> nn.Module:
    """The served form of `names`' blocks stacked by rows (a fused projection): one module where
    every part has the same form (8-bit ones also the same scale block and mins or none), else a
    ConcatLinear of each part's."""
    from pipeserve.model.quant import Int4Linear
    from pipeserve.model.quant_q8 import ConcatLinear

    kinds = {blocks.kind(n) for n in names}
    if kinds == {"q4"}:
        return Int4Linear(None, None, BLOCK, quantized=blocks.int4(names), out_dtype=dtype)
    if kinds == {"q8"}:
        parts = [blocks.q8(n) for n in names]
        shapes = {(d.shape[1], d.dtype, m is None) for _, d, m in parts}
        q8_0 = all(blocks.type(n) == "Q8_0" for n in names) or not any(
            blocks.type(n) == "Q8_0" for n in names
        )
        if len(shapes) == 1 and q8_0:
            q, d, m = (torch.cat(t) if t[0] is not None else None for t in zip(*parts, strict=True))
            return _q8_linear(blocks, names[0], (q, d, m), dtype, device)
    return ConcatLinear([_quantized_linear(blocks, [n], dtype, device) for n in names])


def _embedding(blocks: GgufBlocks, name: str, dtype: torch.dtype, head: nn.Module | None) -> nn.Module:
    """The embedding served from `name`'s blocks; `head`: a tied head's served module, whose tensors
    it shares where they are in a form it gathers from (one copy of the vocabulary matrix)."""
    from pipeserve.model.quant import NIBBLE_LAYOUT, Int4Linear
    from pipeserve.model.quant_q8 import Q8Linear

    if blocks.kind(name) == "q8":
        if isinstance(head, Q8Linear):
            return Q8Embedding(head.qweight, head.scales, dtype, head.mins)
        q, d, m = blocks.q8(name)
        return Q8Embedding(q, d, dtype, m)
    if isinstance(head, Int4Linear) and head.layout == NIBBLE_LAYOUT:
        return Int4Embedding(head.qweight, head.scales_and_zeros, dtype)
    return Int4Embedding.from_blocks(*blocks.int4([name]), dtype)


def install(
    model: StageModel, blocks: GgufBlocks, cfg: ModelConfig, stage: StageSpec, device: torch.device
) -> set[str]:
    """Swap every module of `model` (a StageModel on the CPU, still on the meta device) whose
    checkpoint tensors have blocks for its quantized form, one projection at a time (the float
    weight is never read). Returns the checkpoint names served from blocks: the loader reads the rest.

    A projection with a bias, or fused from tensors only some of which have blocks (F16 beside
    Q4_K), stays float.
    """
    served: set[str] = set()
    for local, i in enumerate(range(stage.layer_lo, stage.layer_hi)):
        layer = model.layers[local]
        for path, parts in _FUSED.items():
            names = [f"model.layers.{i}.{p}.weight" for p in parts]
            biased = getattr(_module(layer, path), "bias", None) is not None
            if biased or not all(n in blocks.names for n in names):
                continue
            parent, attr = path.rsplit(".", 1)
            setattr(_module(layer, parent), attr, _quantized_linear(blocks, names, cfg.dtype, device))
            served.update(names)
        return_freed_memory()  # each layer's temporaries, so the load's peak stays near its result
    embed = "model.embed_tokens.weight"
    head = embed if cfg.tie_word_embeddings else "lm_head.weight"
    lm_head = None
    if stage.is_last and head in blocks.names:
        lm_head = _quantized_linear(blocks, [head], cfg.dtype, device)
        model.lm_head = lm_head  # type: ignore[assignment]
        served.add(head)
    if stage.is_first and embed in blocks.names:
        tied = lm_head if head == embed else None
        model.embed_tokens = _embedding(blocks, embed, cfg.dtype, tied)  # type: ignore[assignment]
        served.add(embed)
    return served


def _module(root: nn.Module, path: str) -> nn.Module:
    for part in path.split("."):
        root = getattr(root, part)
    return root
