"""A reference quantizer for GGUF's Q5_0, Q5_1, Q4_K, Q5_K and Q6_K blocks (numpy, float32).

Why: `gguf` (gguf-py) quantizes Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 but only dequantizes the K-quants, and
a Q4_K_M file (Q4_K with Q6_K, sometimes Q5_K) is what most users bring. The tests and the demo
writer need such files without llama.cpp: this module follows ggml-quants.c's reference
algorithms (`quantize_row_q4_K_ref` etc.: make_qkx2_quants' weighted search of a scale and a min
per sub-block, make_qx_quants' symmetric search for Q6_K, the 6-bit super-block packing of the
sub-block scales) and writes the exact block byte layouts, which `gguf.quants.dequantize` reads
(tests/model/test_gguf_quant.py checks it bit-exactly against our own dequantization).

Not guaranteed byte-identical to llama.cpp's own output: sums here run in numpy's (pairwise)
order, ggml's sequentially, so a tie in a search can fall the other way (the benchmark's
cross-check against `llama-quantize` measures it). Every rounding step is float32 as in ggml,
`nearest_int` is round-half-to-even (np.rint), and fp16 conversions round to nearest as ggml's.

`quantize(w, type_name)` -> uint8 [N, K / block * type_size]: rows of blocks, as gguf stores them.
"""

from __future__ import annotations

import numpy as np

QK_K = 256
F32 = np.float32
GROUP_MAX_EPS = F32(1e-15)
# bytes per block and elements per block of each type written here
BLOCK_BYTES = {"Q5_0": 22, "Q5_1": 24, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
BLOCK_SIZE = {"Q5_0": 32, "Q5_1": 32, "Q4_K": QK_K, "Q5_K": QK_K, "Q6_K": QK_K}


def _nearest(v: np.ndarray) -> np.ndarray:
    """ggml's nearest_int: round half to even in float32."""
    return np.rint(v).astype(np.int32)


def _f16(v: np.ndarray) -> np.ndarray:
    return np.asarray(v, dtype=F32).astype(np.float16)


def make_qkx2_quants(
    x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row of x [B, n] (weights w): (scale [B], -min [B], L uint8 [B, n]) minimizing the
    weighted squared error of scale * L + min, min <= 0, L in 0..nmax (ggml's make_qkx2_quants,
    use_mad false). The candidate scales are (rmin + rdelta * i + nmax) / (max - min), i = 0..nstep,
    each refit by weighted least squares; `min` moves with the best fit so far, as in ggml."""
    x, w = x.astype(F32), w.astype(F32)
    lo = np.minimum(x.min(axis=1), F32(0))
    hi = x.max(axis=1)
    flat = hi == lo
    sum_w = w.sum(axis=1)
    sum_x = (w * x).sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = F32(nmax) / (hi - lo)
        scale = F32(1) / iscale
        L = np.clip(_nearest(iscale[:, None] * (x - lo[:, None])), 0, nmax)
        diff = scale[:, None] * L + lo[:, None] - x
        best = (w * diff * diff).sum(axis=1)
        for i in range(nstep + 1):
            iscale = (F32(rmin) + F32(rdelta) * F32(i) + F32(nmax)) / (hi - lo)
            aux = np.clip(_nearest(iscale[:, None] * (x - lo[:, None])), 0, nmax).astype(F32)
            sum_l = (w * aux).sum(axis=1)
            sum_l2 = (w * aux * aux).sum(axis=1)
            sum_xl = (w * aux * x).sum(axis=1)
            det = sum_w * sum_l2 - sum_l * sum_l
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
            positive = this_min > 0
            this_scale = np.where(positive, sum_xl / sum_l2, this_scale)
            this_min = np.where(positive, F32(0), this_min)
            diff = this_scale[:, None] * aux + this_min[:, None] - x
            mad = (w * diff * diff).sum(axis=1)
            better = (det > 0) & (mad < best) & ~flat
            L = np.where(better[:, None], aux, L)
            best = np.where(better, mad, best)
            scale = np.where(better, this_scale, scale)
            lo = np.where(better, this_min, lo)
    scale = np.where(flat, F32(0), scale).astype(F32)
    L = np.where(flat[:, None], 0, L).astype(np.uint8)
    return scale, (-lo).astype(F32), L


def make_qx_quants(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row of x [B, n]: (scale [B], L uint8 [B, n] in 0..2 nmax - 1) of a symmetric fit
    x ~ scale * (L - nmax), weights x^2 (ggml's make_qx_quants, rmse_type 1): the scale -nmax/max
    (max the value of largest magnitude) and 18 neighbours -(nmax + 0.1 i)/max, best refit kept."""
    x = x.astype(F32)
    at = np.abs(x).argmax(axis=1)  # the first of equal magnitudes, as ggml's strict `>`
    mx = x[np.arange(x.shape[0]), at]
    zero = np.abs(mx) < GROUP_MAX_EPS
    mx = np.where(zero, F32(1), mx)
    w = x * x

    def fit(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        lv = np.clip(_nearest(iscale[:, None] * x), -nmax, nmax - 1).astype(F32)
        return lv, (w * x * lv).sum(axis=1), (w * lv * lv).sum(axis=1)

    lv, sumlx, suml2 = fit(F32(-nmax) / mx)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(suml2 != 0, sumlx / suml2, F32(0)).astype(F32)
        best = scale * sumlx
        L = lv
        for i in (*range(-9, 0), *range(1, 10)):
            cand, slx, sl2 = fit(-(F32(nmax) + F32(0.1) * F32(i)) / mx)
            better = (sl2 > 0) & (slx * slx > best * sl2)
            L = np.where(better[:, None], cand, L)
            scale = np.where(better, slx / sl2, scale).astype(F32)
            best = np.where(better, scale * slx, best)
    L = np.where(zero[:, None], -nmax, L)
    return np.where(zero, F32(0), scale), (L + nmax).astype(np.uint8)


def _pack_scale_min_k4(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins per super-block [S, 8] -> ggml's 12 bytes: j < 4 in the low 6 bits
    of bytes j (scale) and j + 4 (min); j >= 4 split, low nibbles in byte j + 4, the high 2 bits in
    the top bits of bytes j - 4 (scale) and j (min)."""
    out = np.zeros((ls.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = ls[:, 0:4]
    out[:, 4:8] = lm[:, 0:4]
    out[:, 8:12] = (ls[:, 4:8] & 15) | ((lm[:, 4:8] & 15) << 4)
    out[:, 0:4] |= (ls[:, 4:8] >> 4) << 6
    out[:, 4:8] |= (lm[:, 4:8] >> 4) << 6
    return out


def _affine_k(x: np.ndarray, nmax: int, rmin: float, nstep: int):
    """Q4_K / Q5_K's common part: x [S, 256] -> (d f16 [S], dmin f16 [S], 12 scale bytes [S, 12],
    L [S, 256] in 0..nmax)."""
    s = x.shape[0]
    sub = x.reshape(s * 8, 32)
    av = np.sqrt((sub * sub).sum(axis=1) / F32(32)).astype(F32)
    weights = av[:, None] + np.abs(sub)
    scales, mins, L = make_qkx2_quants(sub, weights, nmax, rmin, 0.1, nstep)
    scales, mins, L = scales.reshape(s, 8), mins.reshape(s, 8), L.reshape(s, QK_K)
    max_scale = np.maximum(scales.max(axis=1), F32(0))
    max_min = np.maximum(mins.max(axis=1), F32(0))
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, F32(63) / max_scale, F32(0)).astype(F32)
        inv_min = np.where(max_min > 0, F32(63) / max_min, F32(0)).astype(F32)
    # ggml stores nearest_int into a uint8_t (wrapping), then caps at 63
    ls = np.minimum(_nearest(inv_scale[:, None] * scales) & 255, 63).astype(np.uint8)
    lm = np.minimum(_nearest(inv_min[:, None] * mins) & 255, 63).astype(np.uint8)
    d = _f16(max_scale / F32(63))
    dmin = _f16(max_min / F32(63))
    dd = d.astype(F32)[:, None] * ls.astype(F32)  # [S, 8]
    dm = dmin.astype(F32)[:, None] * lm.astype(F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        lq = np.clip(_nearest((sub.reshape(s, 8, 32) + dm[..., None]) / dd[..., None]), 0, nmax)
    keep = (dd == 0)[..., None]  # ggml skips a zero scale, keeping make_qkx2_quants' L
    L = np.where(keep, L.reshape(s, 8, 32), lq).reshape(s, QK_K).astype(np.uint8)
    return d, dmin, _pack_scale_min_k4(ls, lm), L


def _nibbles_k(L: np.ndarray) -> np.ndarray:
    """[S, 256] values 0..15 -> [S, 128]: per 64 elements, byte l = L[l] | L[l + 32] << 4."""
    g = L.reshape(L.shape[0], 4, 2, 32)
    return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(L.shape[0], 128).astype(np.uint8)


def _bytes(*parts: np.ndarray) -> np.ndarray:
    return np.concatenate([p.reshape(p.shape[0], -1).view(np.uint8) for p in parts], axis=1)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """[S, 256] -> block_q4_K bytes [S, 144]: d, dmin (f16), scales[12], qs[128]."""
    d, dmin, sc, L = _affine_k(x, 15, -1.0, 20)
    return _bytes(d[:, None], dmin[:, None], sc, _nibbles_k(L))


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """[S, 256] -> block_q5_K bytes [S, 176]: d, dmin, scales[12], qh[32], qs[128]; element
    64 n + j (+ 32) has its high bit at bit 2 n (2 n + 1) of qh[j]."""
    d, dmin, sc, L = _affine_k(x, 31, -0.5, 15)
    s = x.shape[0]
    g = L.reshape(s, 4, 2, 32)
    high = (g >> 4).astype(np.uint8)  # [S, 4, 2, 32]
    shifts = (2 * np.arange(4)[:, None] + np.arange(2)[None, :]).astype(np.uint8)  # [4, 2]
    qh = (high << shifts[None, :, :, None]).sum(axis=(1, 2), dtype=np.uint8)
    return _bytes(d[:, None], dmin[:, None], sc, qh, _nibbles_k(L & 15))


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """[S, 256] -> block_q6_K bytes [S, 210]: ql[128], qh[64], scales[16] int8, d f16."""
    s = x.shape[0]
    x = x.astype(F32)
    scales, L = make_qx_quants(x.reshape(s * 16, 16), 32)
    scales, L = scales.reshape(s, 16), L.reshape(s, 16, 16)
    at = np.abs(scales).argmax(axis=1)
    max_scale = scales[np.arange(s), at]
    zero = np.abs(max_scale) < GROUP_MAX_EPS
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = np.where(zero, F32(0), F32(-128) / max_scale).astype(F32)
        d = np.where(zero, np.float16(0), _f16(F32(1) / iscale))
    sc = np.minimum(_nearest(iscale[:, None] * scales), 127).astype(np.int8)
    sc = np.where(zero[:, None], np.int8(0), sc)
    dd = d.astype(F32)[:, None] * sc.astype(F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        lq = np.clip(_nearest(x.reshape(s, 16, 16) / dd[..., None]), -32, 31) + 32
    L = np.where((dd == 0)[..., None], L, lq).reshape(s, 2, 4, 32).astype(np.uint8)
    L = np.where(zero[:, None, None, None], 0, L).astype(np.uint8)  # ggml zeroes the whole block
    low = L & 15  # [S, half, quarter, 32]
    ql = np.concatenate(
        [low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=2
    ).reshape(s, 128)
    hi = L >> 4
    qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(s, 64)
    return _bytes(ql.astype(np.uint8), qh.astype(np.uint8), sc, d[:, None])


def _q5_high(q: np.ndarray) -> np.ndarray:
    """[B, 32] 5-bit values -> (qh as 4 little-endian bytes: bit j = high bit of element j)."""
    return np.packbits((q >> 4).astype(np.uint8), axis=1, bitorder="little")


def _q5_low(q: np.ndarray) -> np.ndarray:
    return ((q[:, :16] & 15) | ((q[:, 16:] & 15) << 4)).astype(np.uint8)


def quantize_q5_0(x: np.ndarray) -> np.ndarray:
    """[B, 32] -> block_q5_0 bytes [B, 22]: d f16, qh (4 bytes), qs[16]; w = d (q - 16)."""
    x = x.astype(F32)
    at = np.abs(x).argmax(axis=1)
    mx = x[np.arange(x.shape[0]), at]
    d = mx / F32(-16)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, F32(0), F32(1) / d).astype(F32)
    q = np.minimum(np.trunc(x * inv[:, None] + F32(16.5)), 31).astype(np.uint8)
    return _bytes(_f16(d)[:, None], _q5_high(q), _q5_low(q))


def quantize_q5_1(x: np.ndarray) -> np.ndarray:
    """[B, 32] -> block_q5_1 bytes [B, 24]: d, m f16, qh, qs[16]; w = d q + m."""
    x = x.astype(F32)
    lo, hi = x.min(axis=1), x.max(axis=1)
    d = (hi - lo) / F32(31)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, F32(0), F32(1) / d).astype(F32)
    q = np.minimum(np.trunc((x - lo[:, None]) * inv[:, None] + F32(0.5)), 31).astype(np.uint8)
    return _bytes(_f16(d)[:, None], _f16(lo)[:, None], _q5_high(q), _q5_low(q))


_QUANTIZERS = {
    "Q5_0": quantize_q5_0,
    "Q5_1": quantize_q5_1,
    "Q4_K": quantize_q4_k,
    "Q5_K": quantize_q5_k,
    "Q6_K": quantize_q6_k,
}
TYPES = tuple(_QUANTIZERS)


def quantize(w: np.ndarray, type_name: str) -> np.ndarray:
    """w float [N, K] (K a multiple of the type's block) -> uint8 [N, K / block * block bytes]."""
    if type_name not in _QUANTIZERS:
        raise ValueError(f"no reference quantizer for {type_name}; these: {', '.join(TYPES)}")
    n, k = w.shape
    block = BLOCK_SIZE[type_name]
    if k % block:
        raise ValueError(f"{type_name} needs rows of a multiple of {block} values, not {k}")
    blocks = _QUANTIZERS[type_name](np.ascontiguousarray(w, dtype=F32).reshape(-1, block))
    return np.ascontiguousarray(blocks).reshape(n, k // block * BLOCK_BYTES[type_name])
