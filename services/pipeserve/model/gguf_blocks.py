"""A GGUF file's quantized blocks, kept beside the float checkpoint it converts to (`--quantization gguf`).

`convert_gguf` writes `quantized.safetensors` next to `model.safetensors`: for every tensor the
file stores as Q4_0, Q4_1 or Q8_0 (llama.cpp's 32-wide blocks), the block contents under its HF
name, q/k rows already in HF order. Serving with `--quantization gguf` reads the projections from
it instead of the float32 tensors, so the weights computed with are the file's own blocks:

* Q4_1 (`d`, `m`, 16 bytes of nibbles): w = d * q + m, q in 0..15. Q4_0 (`d`, nibbles): w = d * (q - 8),
  stored here as Q4_1 with m = -8 d (exact in float16). Either becomes an `Int4Linear` with group 32
  and the same q, d, m: no requantization (only d and m round to bfloat16, the kernel's type).
* Q8_0 (`d`, 32 int8): w = d * q. An embedding gathers its rows from these blocks exactly
  (`Q8Embedding`); a projection (a tied lm_head) is requantized per output channel for
  `Int8Linear`, the only int8 CPU kernel torch has (per-block scales it has not).

Layout of `quantized.safetensors`, per HF tensor NAME (N rows, K inputs, K % 32 == 0):
  NAME.qs  uint8 [N, K/32, 16]  Q4: element j of a block is qs[j] & 15, element 16 + j is qs[j] >> 4
  NAME.q8  int8  [N, K]         Q8_0
  NAME.d   float16 [N, K/32]    the block scale
  NAME.m   float16 [N, K/32]    Q4 only: the block minimum
The header's metadata says `format: gguf-blocks` and the block size.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from torch import nn

from pipeserve.errors import ModelLoadError
from pipeserve.model.config import ModelConfig
from pipeserve.model.memory import return_freed_memory
from pipeserve.model.stage_model import StageModel, StageSpec

BLOCKS_FILE = "quantized.safetensors"
BLOCK = 32
FORMAT = "gguf-blocks"


def _split_blocks(raw: np.ndarray, block_bytes: int) -> np.ndarray:
    """GGUF rows of bytes [N, K/32 * block_bytes] -> [N, K/32, block_bytes]."""
    n = raw.shape[0]
    return np.ascontiguousarray(raw).reshape(n, -1, block_bytes)


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes per block -> float16 [N, K/32]."""
    return np.ascontiguousarray(b).view(np.float16).reshape(b.shape[:-1])


def read_blocks(tensor) -> dict[str, torch.Tensor] | None:
    """One GGUF tensor's blocks as the suffix -> tensor entries of the layout above; None when its
    type is not blocked here (F32, F16, K-quants: those stay in the float checkpoint only)."""
    from gguf import GGMLQuantizationType as T

    kind = T(tensor.tensor_type)
    if kind not in (T.Q4_0, T.Q4_1, T.Q8_0):
        return None
    raw = np.asarray(tensor.data)
    if kind is T.Q4_1:
        b = _split_blocks(raw, 20)
        d, m, qs = _f16(b[..., 0:2]), _f16(b[..., 2:4]), b[..., 4:20]
        return {"qs": torch.from_numpy(qs.copy()), "d": torch.from_numpy(d), "m": torch.from_numpy(m)}
    if kind is T.Q4_0:
        b = _split_blocks(raw, 18)
        d, qs = _f16(b[..., 0:2]), b[..., 2:18]
        m = (d.astype(np.float32) * -8.0).astype(np.float16)  # exact: a power of two
        return {"qs": torch.from_numpy(qs.copy()), "d": torch.from_numpy(d), "m": torch.from_numpy(m)}
    b = _split_blocks(raw, 34)
    d, q8 = _f16(b[..., 0:2]), np.ascontiguousarray(b[..., 2:34]).view(np.int8)
    return {"q8": torch.from_numpy(q8.reshape(raw.shape[0], -1).copy()), "d": torch.from_numpy(d)}


def permute_blocks(blocks: dict[str, torch.Tensor], permute: Callable[[torch.Tensor], torch.Tensor]):
    """Apply a row permutation (llama.cpp's q/k one undone) to every entry: blocks lie within rows."""
    return {k: permute(v) for k, v in blocks.items()}


class GgufBlocks:
    """The blocks of one converted checkpoint; tensors are read on demand (one projection at a time)."""

    def __init__(self, model_dir: str | Path) -> None:
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

    def __enter__(self) -> GgufBlocks:
        # One handle for the whole install: each open parses the header of every tensor again
        # (~1.5 ms per projection on a 135M file, a fifth of its load).
        self._file = safe_open(str(self.path), framework="pt")
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.__exit__(None, None, None)
        self._file = None

    def _get(self, keys: list[str]) -> list[torch.Tensor]:
        if getattr(self, "_file", None) is None:
            raise RuntimeError("GgufBlocks is read inside `with GgufBlocks(...) as blocks:`")
        # copies: a tensor left on the file's mmap keeps the whole mapping resident
        return [self._file.get_tensor(k).clone() for k in keys]

    def kind(self, name: str) -> str:
        return "q4" if f"{name}.qs" in self.keys else "q8"

    def int4(self, names: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The Q4 blocks of `names` stacked by rows (a fused projection): q uint8 [N, K] in 0..15,
        d and m float32 [N, K/32]."""
        qs, ds, ms = [], [], []
        for name in names:
            if self.kind(name) != "q4":
                raise ModelLoadError(f"{name}: a fused projection mixes Q4 and Q8_0 blocks")
            q, d, m = self._get([f"{name}.qs", f"{name}.d", f"{name}.m"])
            qs.append(torch.cat([q & 15, q >> 4], dim=-1).reshape(q.shape[0], -1))
            ds.append(d.float())
            ms.append(m.float())
        return torch.cat(qs), torch.cat(ds), torch.cat(ms)

    def q8(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """int8 [N, K] and float32 scales [N, K/32]."""
        q, d = self._get([f"{name}.q8", f"{name}.d"])
        return q, d.float()

    def dequantized(self, names: list[str]) -> torch.Tensor:
        """The float32 weight of `names` stacked by rows, as the file defines it."""
        out = []
        for name in names:
            if self.kind(name) == "q4":
                q, d, m = self.int4([name])
                g = q.float().reshape(q.shape[0], -1, BLOCK)
                out.append((g * d[..., None] + m[..., None]).reshape(q.shape))
            else:
                q8, d = self.q8(name)
                out.append((q8.float().reshape(q8.shape[0], -1, BLOCK) * d[..., None]).reshape(q8.shape))
        return torch.cat(out)


class Q8Embedding(nn.Module):
    """An embedding over Q8_0 blocks: the rows asked for are dequantized exactly (d * q) on gather."""

    qweight: torch.Tensor
    scales: torch.Tensor

    def __init__(self, q: torch.Tensor, d: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("qweight", q)  # int8 [V, K]
        self.register_buffer("scales", d)  # float32 [V, K/32]
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        q = self.qweight[ids].float()
        rows = q.reshape(*q.shape[:-1], -1, BLOCK) * self.scales[ids][..., None]
        return rows.reshape(q.shape).to(self.dtype)


# StageModel module path (per local layer) -> the checkpoint projections it fuses, in row order.
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


def _quantized_linear(
    blocks: GgufBlocks, names: list[str], dtype: torch.dtype, device: torch.device, q8=None
) -> nn.Module:
    """The served form of `names`' blocks; `q8`: the (q, d) of a Q8_0 tensor already read (a tied
    head shares the embedding's)."""
    from pipeserve.model.quant import Int4Linear, Int8Linear, Q8Linear, q8_native, quantize_int8

    if all(blocks.kind(n) == "q4" for n in names):
        return Int4Linear(None, None, BLOCK, quantized=blocks.int4(names), out_dtype=dtype)
    if len(names) != 1:
        raise ModelLoadError(f"{names}: a fused projection of Q8_0 blocks is not served")
    q8, d = q8 if q8 is not None else blocks.q8(names[0])
    if q8_native(device):  # the blocks themselves, exact
        return Q8Linear(q8, d, None, dtype)
    # Elsewhere per-block scales -> Int8Linear's per-channel ones, requantized from the exact values
    # a slice of rows at a time (a vocabulary matrix in float32 would be ~4x the file's bytes at once).
    q, s = torch.empty_like(q8), torch.empty(q8.shape[0])
    for lo in range(0, q8.shape[0], 4096):
        rows = slice(lo, lo + 4096)
        w = q8[rows].float().reshape(-1, q8.shape[1] // BLOCK, BLOCK) * d[rows][..., None]
        q[rows], s[rows] = quantize_int8(w.reshape(-1, q8.shape[1]))
    return Int8Linear(None, None, out_dtype=dtype, quantized=(q, s))


def install(
    model: StageModel, blocks: GgufBlocks, cfg: ModelConfig, stage: StageSpec, device: torch.device
) -> set[str]:
    """Swap every module of `model` (a StageModel on the CPU, still on the meta device) whose
    checkpoint tensors have blocks for its quantized form, one projection at a time (the float
    weight is never read). Returns the checkpoint names served from blocks: the loader reads the rest.

    A projection with a bias, or fused from tensors only some of which have blocks, stays float.
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
    embed_blocks = None
    if stage.is_first and embed in blocks.names and blocks.kind(embed) == "q8":
        embed_blocks = blocks.q8(embed)
        model.embed_tokens = Q8Embedding(*embed_blocks, cfg.dtype)  # type: ignore[assignment]
        served.add(embed)
    head = embed if cfg.tie_word_embeddings else "lm_head.weight"
    if stage.is_last and head in blocks.names:
        shared = embed_blocks if head == embed else None
        model.lm_head = _quantized_linear(blocks, [head], cfg.dtype, device, shared)  # type: ignore[assignment]
        served.add(head)
    return served


def _module(root: nn.Module, path: str) -> nn.Module:
    for part in path.split("."):
        root = getattr(root, part)
    return root
