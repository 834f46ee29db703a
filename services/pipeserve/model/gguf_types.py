"""Each GGUF tensor type pipeserve serves, and the form its blocks are served in (`--quantization gguf`).

`read_blocks(tensor)` turns one GGUF tensor's block bytes into the entries gguf_blocks.py stores
(`NAME.suffix`, rows in GGUF's order), exactly: every value the served form computes with is the
one `gguf.quants.dequantize` gives (tests/model/test_gguf_types.py, bit for bit):

* form "int4" (Int4Linear / Int4Embedding, groups of 32; the kernels' bfloat16 scale and zero are
  the only rounding, as for Q4_0 and Q4_1 since issue 24):
    Q4_0, Q4_1: w = d q + m per 32 (Q4_0: m = -8 d); d, m float16.
    Q4_K: a super-block of 256 = 8 sub-blocks of 32 with 6-bit scales sc and mins mn:
          w = (d sc) q - (dmin mn), the same affine per 32; d, m float32 (d sc and dmin mn are
          exact float32 products of an fp16 and a 6-bit integer).
    keys: qs uint8 [N, K/32, 16] (element j of a block in the low nibble of byte j, 16 + j high),
          d, m [N, K/32].
* form "q8" (Q8Linear / Q8Embedding: int8 values, a scale per 32 or per 16, optional min per 32):
    Q8_0: w = d q (d float16, kept as the file has it).
    Q5_0: w = d (q - 16); Q5_1: w = d q + m; q the 5-bit value (the high bit from qh).
    Q5_K: w = (d sc) q - (dmin mn) per 32, q 5-bit; Q6_K: w = (d sc) (q - 32) per 16, q 6-bit.
    Q6_K is served at its own size (6.6 bits a weight, not 10 as int8 values and a float32 per
    16): the file's 6-bit packing (q6k_values), d per 256 and the int8 sub-scales packed beside it
    (pack_q6k_scales); the kernel forms d sc per 16, an exact float32 product.
    keys: q8 int8 [N, K] (Q6_K: q6 uint8 [N, K/256 * 192], the file's ql and qh), d [N, K/32]
          (Q6_K: float32 [N, K/256]), m float32 [N, K/32] where there is a min, sc int8 [N, K/16]
          (Q6_K).
* form "dense" (F32, F16, BF16): no blocks; the float checkpoint holds them exactly and the stage
  serves them in the model's dtype.
Any other type (Q2_K, Q3_K, the IQ types, ...) is refused by `check_types` with the list above.
"""

from __future__ import annotations

import numpy as np
import torch

from pipeserve.errors import ModelLoadError

INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
Q8_TYPES = ("Q8_0", "Q5_0", "Q5_1", "Q5_K", "Q6_K")
DENSE_TYPES = ("F32", "F16", "BF16")
SERVED_TYPES = (*DENSE_TYPES, *INT4_TYPES, *Q8_TYPES)
QK_K = 256
Q6K_SCALE_BYTES = 20  # per super-block in the packed scales: float32 d, then the 16 int8 sub-scales
Q6K_VALUE_BYTES = 192  # per super-block of Q6_K's values: the file's ql[128] and qh[64]


def pack_q6k_scales(d: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
    """Q6_K's d float32 [N, K/256] and sub-scales int8 [N, K/16] -> the packed scales uint8
    [N, K/256 * 20] (per super-block: d's 4 bytes, then its 16 sub-scales), as the file keeps them:
    0.625 bits a weight where a float32 per 16 was 2; dense.c's q8_matmul reads them (sub 16)."""
    n = d.shape[0]
    if tuple(sc.shape) != (n, d.shape[1] * 16):
        raise ValueError(f"Q6_K scales: d {tuple(d.shape)} and sub-scales {tuple(sc.shape)} differ")
    dd = d.to(torch.float32).contiguous().view(torch.uint8).reshape(n, -1, 4)
    ss = sc.to(torch.int8).contiguous().view(torch.uint8).reshape(n, -1, 16)
    return torch.cat([dd, ss], dim=2).reshape(n, -1).contiguous()


def q6k_values(q6: torch.Tensor) -> torch.Tensor:
    """Q6_K's 6-bit packing uint8 [..., K/256 * 192] (per super-block ggml's ql[128], qh[64]) -> its
    values q - 32, int8 [..., K]: element 128 h + 32 j + l of a super-block is the nibble (j >= 2:
    high) of ql[64 h + 32 (j & 1) + l] with bits 2 j.. of qh[32 h + l] above it."""
    b = q6.reshape(*q6.shape[:-1], -1, Q6K_VALUE_BYTES)
    ql = b[..., :128].reshape(*b.shape[:-1], 2, 2, 32)  # [..., h, j & 1, l]
    qh = b[..., 128:].reshape(*b.shape[:-1], 2, 1, 32)  # [..., h, 1, l]
    low = torch.cat([ql & 15, ql >> 4], dim=-2)  # [..., h, j, l]
    shift = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=q6.device)[:, None]
    high = (qh >> shift) & 3
    q = (low | (high << 4)).to(torch.int8) - 32
    return q.reshape(*q6.shape[:-1], -1)


def q8_values(q: torch.Tensor) -> torch.Tensor:
    """A Q8Linear's values int8 [..., K]: its qweight, or what Q6_K's packing (uint8) holds."""
    return q6k_values(q) if q.dtype == torch.uint8 else q


def q8_block_scales(scales: torch.Tensor) -> torch.Tensor:
    """A Q8Linear's scales [..., K/32] float32, or packed Q6_K ones (uint8, pack_q6k_scales) ->
    the float32 scale of each block of 16 or 32 [..., K/sub]: d * sc, an exact float32 product
    (d an fp16 value, sc an int8), the value the kernel multiplies."""
    if scales.dtype != torch.uint8:
        return scales
    b = scales.reshape(*scales.shape[:-1], -1, Q6K_SCALE_BYTES)
    d = b[..., :4].contiguous().view(torch.float32)  # [..., K/256, 1]
    sc = b[..., 4:].contiguous().view(torch.int8).float()  # [..., K/256, 16]
    return (d * sc).reshape(*scales.shape[:-1], -1)


def type_name(tensor) -> str:
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType(tensor.tensor_type).name


def form(name: str) -> str:
    """The served form of GGUF type `name`: int4, q8 or dense."""
    if name in INT4_TYPES:
        return "int4"
    if name in Q8_TYPES:
        return "q8"
    if name in DENSE_TYPES:
        return "dense"
    raise ModelLoadError(f"GGUF type {name} is not served; supported: {', '.join(SERVED_TYPES)}")


def check_types(tensors) -> None:
    """Refuse a file with any tensor of a type outside SERVED_TYPES, naming each such type once."""
    bad: dict[str, str] = {}
    for t in tensors:
        name = type_name(t)
        if name not in SERVED_TYPES:
            bad.setdefault(name, t.name)
    if bad:
        found = ", ".join(f"{k} (e.g. {v})" for k, v in bad.items())
        raise ModelLoadError(
            f"GGUF tensor types not served: {found}; supported: {', '.join(SERVED_TYPES)} "
            "(requantize the file with llama.cpp's llama-quantize, e.g. to Q4_K_M)"
        )


def _blocks(raw: np.ndarray, block_bytes: int) -> np.ndarray:
    """GGUF rows of bytes [N, K/B * block_bytes] -> [N, K/B, block_bytes]."""
    return np.ascontiguousarray(raw).reshape(raw.shape[0], -1, block_bytes)


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes per block -> float16 [N, K/B]."""
    return np.ascontiguousarray(b).view(np.float16).reshape(b.shape[:-1])


def _f32(b: np.ndarray) -> np.ndarray:
    return _f16(b).astype(np.float32)


def _rows(a: np.ndarray) -> np.ndarray:
    """[N, S, j, ...] -> [N, S * j * ...] (per-block tensors flattened along the row)."""
    return np.ascontiguousarray(a).reshape(a.shape[0], -1)


def _nibble_blocks(v: np.ndarray) -> np.ndarray:
    """values 0..15 [N, K] -> the int4 form's qs [N, K/32, 16]."""
    g = v.reshape(v.shape[0], -1, 32).astype(np.uint8)
    return np.ascontiguousarray(g[..., :16] | (g[..., 16:] << 4))


def scale_min_k4(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 scale bytes [..., 12] -> 6-bit scales and mins [..., 8] (ggml's
    get_scale_min_k4): j < 4 in the low 6 bits of bytes j and j + 4; j >= 4 from the nibbles of
    byte j + 4 with the top 2 bits of bytes j - 4 (scale) and j (min) as bits 4-5."""
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([lo & 63, (hi & 15) | ((lo >> 6) << 4)], axis=-1)
    mn = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=-1)
    return sc, mn


def _affine_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K super-blocks [N, S, bytes] -> (scale, min) float32 [N, S * 8], one per 32."""
    d, dmin = _f32(b[..., 0:2]), _f32(b[..., 2:4])
    sc, mn = scale_min_k4(b[..., 4:16])
    return _rows(d[..., None] * sc.astype(np.float32)), _rows(-(dmin[..., None] * mn.astype(np.float32)))


def _q4_k(raw: np.ndarray) -> dict[str, np.ndarray]:
    b = _blocks(raw, 144)
    s, m = _affine_k(b)
    qs = b[..., 16:144].reshape(b.shape[0], b.shape[1], 4, 1, 32)
    v = np.concatenate([qs & 15, qs >> 4], axis=3)  # [N, S, chunk of 64, low/high half, 32]
    return {"qs": _nibble_blocks(_rows(v)), "d": s, "m": m}


def _q5_k(raw: np.ndarray) -> dict[str, np.ndarray]:
    b = _blocks(raw, 176)
    s, m = _affine_k(b)
    qh = b[..., 16:48][:, :, None, None, :]  # [N, S, 1, 1, 32]
    qs = b[..., 48:176].reshape(b.shape[0], b.shape[1], 4, 1, 32)
    low = np.concatenate([qs & 15, qs >> 4], axis=3)  # [N, S, 4, 2, 32]
    shift = (2 * np.arange(4)[:, None] + np.arange(2)[None, :]).astype(np.uint8)[None, None, :, :, None]
    high = (qh >> shift) & 1
    q = low | (high << 4)
    return {"q8": _rows(q).astype(np.int8), "d": s, "m": m}


def _q6_k(raw: np.ndarray) -> dict[str, np.ndarray]:
    """Served at the file's own size: its 6-bit packing (ql, qh: q6k_values reads them), d per 256
    and the int8 sub-scales (pack_q6k_scales puts them together)."""
    b = _blocks(raw, 210)
    return {
        "q6": _rows(b[..., 0:192]),
        "d": _f32(b[..., 208:210]),
        "sc": _rows(b[..., 192:208].view(np.int8)),
    }


def _q5_values(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1 blocks: qh [N, B, 4] (bit j: element j's high bit), qs [N, B, 16] -> q [N, B * 32]."""
    low = np.concatenate([qs & 15, qs >> 4], axis=-1)
    high = np.unpackbits(qh, axis=-1, bitorder="little")
    return _rows(low | (high << 4))


def _q5_0(raw: np.ndarray) -> dict[str, np.ndarray]:
    b = _blocks(raw, 22)
    q = _q5_values(b[..., 2:6], b[..., 6:22]).astype(np.int16) - 16
    return {"q8": q.astype(np.int8), "d": _f32(b[..., 0:2])}


def _q5_1(raw: np.ndarray) -> dict[str, np.ndarray]:
    b = _blocks(raw, 24)
    q = _q5_values(b[..., 4:8], b[..., 8:24])
    return {"q8": q.astype(np.int8), "d": _f32(b[..., 0:2]), "m": _f32(b[..., 2:4])}


def _q4_1(raw: np.ndarray) -> dict[str, np.ndarray]:
    b = _blocks(raw, 20)
    return {"qs": np.ascontiguousarray(b[..., 4:20]), "d": _f16(b[..., 0:2]), "m": _f16(b[..., 2:4])}


def _q4_0(raw: np.ndarray) -> dict[str, np.ndarray]:
    b = _blocks(raw, 18)
    d = _f16(b[..., 0:2])
    m = (d.astype(np.float32) * -8.0).astype(np.float16)  # exact: a power of two
    return {"qs": np.ascontiguousarray(b[..., 2:18]), "d": d, "m": m}


def _q8_0(raw: np.ndarray) -> dict[str, np.ndarray]:
    b = _blocks(raw, 34)
    return {"q8": _rows(b[..., 2:34]).view(np.int8), "d": _f16(b[..., 0:2])}


_READERS = {
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q4_K": _q4_k,
    "Q8_0": _q8_0,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}


def read_blocks(tensor) -> dict[str, torch.Tensor] | None:
    """One GGUF tensor's blocks as the suffix -> tensor entries of the module docstring; None for
    a dense type (F32, F16, BF16: the float checkpoint serves those)."""
    name = type_name(tensor)
    if form(name) == "dense":
        return None
    out = _READERS[name](np.asarray(tensor.data))
    return {k: torch.from_numpy(np.ascontiguousarray(v).copy()) for k, v in out.items()}
