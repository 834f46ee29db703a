"""Paged attention in Triton (the GPU path): decode and varlen prefill, reading the KV pool in place.

Shapes as in pipeserve_kernels: k_cache/v_cache [N, BS, KVH, D], a row's keys
are slots 0..ctx-1 of its block table, slot p at (table[p // BS], p % BS).
Both kernels walk the keys in tiles of TILE token positions, gathering each
position's block id from the table (so any block size works and no gathered
copy of the blocks is made), with an online softmax in float32.

GQA: query head h reads kv head h // G (G = H / KVH), as transformers'
repeat_kv. Decode runs one program per (sequence, kv head) holding that kv
head's G query heads, so each K/V tile is loaded once for the group; prefill
runs one program per (query tile, span, query head).

window / softcap as in reference.py (key p visible to query i iff i - window < p <= i; scores
capped to softcap * tanh(s / softcap) before the mask): passed as 0 for none, with constexpr flags so
a layer without them compiles the plain kernel. A window also moves the start of the key walk to the
first key the program's queries can see, so a local layer reads O(window) keys per query.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pipeserve_kernels.triton_checks import (
    INDEX_DTYPES,
    check_attention_options,
    check_divisible,
    check_same_dtype,
    check_tensor,
    interpreting,
)

# Finite "minus infinity": a fully masked tile then yields exp(-1e30 - m) = 0, never NaN.
NEG = tl.constexpr(-1.0e30)  # a constexpr: a jit function reads no other global


@triton.jit
def _softcap(s, cap):
    """cap * tanh(s / cap); tanh as (1 - e) / (1 + e), e = exp(-2|x|), which never overflows
    (the interpreter has no libdevice.tanh)."""
    x = s / cap
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return cap * tl.where(x < 0, -t, t)


@triton.jit
def _kv_tile(cache, pos, valid, kvh, ds, dmask, BS: tl.constexpr):
    """K and V of one row at key positions pos [T], kv head kvh: two [T, D_P] tiles in the cache's
    dtype, 0 where not valid or past D. cache: (k pool, v pool, the row's block table, the pool's
    3 strides); slot p is at (table[p // BS], p % BS)."""
    kc_ptr, vc_ptr, table_ptr, c_stride_n, c_stride_b, c_stride_h = cache
    bid = tl.load(table_ptr + pos // BS, mask=valid, other=0).to(tl.int64)
    offs = (bid * c_stride_n + (pos % BS) * c_stride_b + kvh * c_stride_h)[:, None] + ds[None, :]
    kvmask = valid[:, None] & dmask[None, :]
    return tl.load(kc_ptr + offs, mask=kvmask, other=0.0), tl.load(vc_ptr + offs, mask=kvmask, other=0.0)


@triton.jit
def _online_start(q):
    """Before any key, for queries q [R, D_P]: running max [R], running sum [R], weighted values."""
    rows = tl.zeros([q.shape[0]], tl.float32)
    return rows + NEG, rows, tl.zeros(q.shape, tl.float32)


@triton.jit
def _online(m_i, l_i, s, seen, softcap, HAS_SOFTCAP: tl.constexpr):
    """One tile of the online softmax over scores s [R, T] (capped, then masked to seen): the new
    running max [R] and sum [R], the tile's weights [R, T] and alpha [R], the factor rescaling the
    weighted values so far (the caller adds the tile's: a dot or a broadcast product)."""
    if HAS_SOFTCAP:
        s = _softcap(s, softcap)
    s = tl.where(seen, s, NEG)
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    return m_new, l_i * alpha + tl.sum(p, axis=1), p, alpha


@triton.jit
def _decode_kernel(
    q_ptr,
    kc_ptr,
    vc_ptr,
    bt_ptr,
    lens_ptr,
    out_ptr,
    scale,
    window,
    softcap,
    q_stride_b,
    q_stride_h,
    o_stride_b,
    o_stride_h,
    bt_stride,
    c_stride_n,
    c_stride_b,
    c_stride_h,
    G: tl.constexpr,
    G_P: tl.constexpr,
    D: tl.constexpr,
    D_P: tl.constexpr,
    BS: tl.constexpr,
    TILE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    ctx = tl.load(lens_ptr + b)
    gs = tl.arange(0, G_P)
    ds = tl.arange(0, D_P)
    heads = kvh * G + gs
    qmask = (gs < G)[:, None] & (ds < D)[None, :]
    q = tl.load(q_ptr + b * q_stride_b + heads[:, None] * q_stride_h + ds[None, :], mask=qmask, other=0.0)
    first = 0
    if HAS_WINDOW:  # the query is at ctx - 1: keys ctx - window..ctx - 1
        first = tl.maximum(ctx - window, 0)
    cache = (kc_ptr, vc_ptr, bt_ptr + b * bt_stride, c_stride_n, c_stride_b, c_stride_h)
    out = _decode_attend(q.to(tl.float32) * scale, ctx, first, kvh, cache, softcap, D, BS, TILE, HAS_SOFTCAP)
    optr = out_ptr + b * o_stride_b + heads[:, None] * o_stride_h + ds[None, :]
    tl.store(optr, out.to(out_ptr.dtype.element_ty), mask=qmask)


@triton.jit
def _decode_attend(q, ctx, first, kvh, cache, softcap, D, BS, TILE: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """q [G_P, D_P] (scaled, float32) over keys first..ctx-1 of one row -> [G_P, D_P] float32.
    cache: (k pool, v pool, the row's block table, the pool's 3 strides)."""
    ds = tl.arange(0, q.shape[1])
    m_i, l_i, acc = _online_start(q)
    for start in range(first, ctx, TILE):
        toks = start + tl.arange(0, TILE)
        valid = toks < ctx
        k, v = _kv_tile(cache, toks, valid, kvh, ds, ds < D, BS)
        # [G_P, TILE]: G is small (1..8), a broadcast product beats padding a dot to 16 rows.
        s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
        m_i, l_i, p, alpha = _online(m_i, l_i, s, valid[None, :], softcap, HAS_SOFTCAP)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
    return acc / l_i[:, None]


def _check_cache(op: str, k_cache: torch.Tensor, v_cache: torch.Tensor, sizes: dict[str, int]) -> None:
    check_tensor(op, "k_cache", k_cache, ("N", "BS", "KVH", "D"), sizes)
    check_tensor(op, "v_cache", v_cache, ("N", "BS", "KVH", "D"), sizes)
    if k_cache.stride() != v_cache.stride():
        raise ValueError(
            f"{op}: k_cache and v_cache must share strides: {k_cache.stride()}, {v_cache.stride()}"
        )
    check_divisible(op, sizes["H"], sizes["KVH"])


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    workspace: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One query token per row: q [B, H, D] -> [B, H, D] (contract of reference.paged_attention_decode).

    workspace is accepted for the interface and unused: the kernel reads the
    pool in place. context_lens[b] >= 1 (the row's own token is stored).
    """
    op = "paged_attention_decode"
    sizes = check_tensor(op, "q", q, ("B", "H", "D"))
    _check_cache(op, k_cache, v_cache, sizes)
    check_tensor(op, "block_tables", block_tables, ("B", "max_blocks"), sizes, INDEX_DTYPES, unit_last=True)
    check_tensor(op, "context_lens", context_lens, ("B",), sizes, INDEX_DTYPES, unit_last=False)
    check_same_dtype(op, q=q, k_cache=k_cache, v_cache=v_cache)
    check_attention_options(op, window, softcap)
    b, heads, d = q.shape
    kvh = k_cache.shape[2]
    g = heads // kvh
    out = torch.empty((b, heads, d), dtype=q.dtype, device=q.device)
    if b:
        d_p = triton.next_power_of_2(d)
        _decode_kernel[(b, kvh)](
            q,
            k_cache,
            v_cache,
            block_tables,
            context_lens,
            out,
            scale,
            window or 0,
            softcap or 0.0,
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            block_tables.stride(0),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            G=g,
            G_P=triton.next_power_of_2(g),
            D=d,
            D_P=d_p,
            BS=k_cache.shape[1],
            TILE=32 if d_p >= 128 else 64,
            HAS_WINDOW=window is not None,
            HAS_SOFTCAP=softcap is not None,
        )
    return out


@triton.jit
def _prefill_kernel(
    q_ptr,
    kc_ptr,
    vc_ptr,
    bt_ptr,
    cu_ptr,
    start_ptr,
    out_ptr,
    scale,
    window,
    softcap,
    q_stride_t,
    q_stride_h,
    o_stride_t,
    o_stride_h,
    bt_stride,
    c_stride_n,
    c_stride_b,
    c_stride_h,
    G: tl.constexpr,
    D: tl.constexpr,
    D_P: tl.constexpr,
    BS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    DOT_F32: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    tile = tl.program_id(0)
    span = tl.program_id(1)
    h = tl.program_id(2)
    row0 = tl.load(cu_ptr + span)
    length = tl.load(cu_ptr + span + 1) - row0
    if tile * BM < length:
        start = tl.load(start_ptr + span)
        rows = tile * BM + tl.arange(0, BM)
        ds = tl.arange(0, D_P)
        qmask = (rows < length)[:, None] & (ds < D)[None, :]
        q = tl.load(q_ptr + (row0 + rows)[:, None] * q_stride_t + h * q_stride_h + ds[None, :], mask=qmask)
        if DOT_F32:
            q = q.to(tl.float32)
        first = 0
        if HAS_WINDOW:  # the tile's first query (start + tile * BM) sees keys from here on
            first = tl.maximum(start + tile * BM - window + 1, 0)
        kv_end = start + tl.minimum(length, (tile + 1) * BM)
        cache = (kc_ptr, vc_ptr, bt_ptr + span * bt_stride, c_stride_n, c_stride_b, c_stride_h)
        # qpos [BM]: absolute positions; causal: key p visible to query at qpos iff p <= qpos
        out = _prefill_attend(
            q, start + rows, first, kv_end, h // G, cache, scale, window, softcap, D, BS, BN,
            DOT_F32, HAS_WINDOW, HAS_SOFTCAP,
        )  # fmt: skip
        optr = out_ptr + (row0 + rows)[:, None] * o_stride_t + h * o_stride_h + ds[None, :]
        tl.store(optr, out.to(out_ptr.dtype.element_ty), mask=qmask)


@triton.jit
def _prefill_attend(
    q, qpos, first, kv_end, kvh, cache, scale, window, softcap, D, BS, BN: tl.constexpr,
    DOT_F32: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):  # fmt: skip
    """q [BM, D_P] at positions qpos over keys first..kv_end-1 of one span -> [BM, D_P] float32.
    cache: (k pool, v pool, the span's block table, the pool's 3 strides)."""
    ds = tl.arange(0, q.shape[1])
    m_i, l_i, acc = _online_start(q)
    for k0 in range(first, kv_end, BN):
        kpos = k0 + tl.arange(0, BN)
        kvalid = kpos < kv_end
        k, v = _kv_tile(cache, kpos, kvalid, kvh, ds, ds < D, BS)
        if DOT_F32:
            k, v = k.to(tl.float32), v.to(tl.float32)
        # ieee: float32 inputs must not be rounded to tf32 (HF-exact greedy); ignored for 16-bit.
        s = tl.dot(q, tl.trans(k), input_precision="ieee").to(tl.float32) * scale
        seen = (kpos[None, :] <= qpos[:, None]) & kvalid[None, :]
        if HAS_WINDOW:
            seen = seen & (kpos[None, :] > qpos[:, None] - window)
        m_i, l_i, p, alpha = _online(m_i, l_i, s, seen, softcap, HAS_SOFTCAP)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee").to(tl.float32)
    return acc / l_i[:, None]


def _check_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens: torch.Tensor,
    start_pos: torch.Tensor,
) -> None:
    op = "paged_attention_prefill"
    sizes = check_tensor(op, "q", q, ("T", "H", "D"))
    _check_cache(op, k_cache, v_cache, sizes)
    check_tensor(op, "block_tables", block_tables, ("S", "max_blocks"), sizes, INDEX_DTYPES)
    check_tensor(op, "cu_seqlens", cu_seqlens, (sizes["S"] + 1,), sizes, INDEX_DTYPES, unit_last=False)
    check_tensor(op, "start_pos", start_pos, ("S",), sizes, INDEX_DTYPES, unit_last=False)
    check_same_dtype(op, q=q, k_cache=k_cache, v_cache=v_cache)


def paged_attention_prefill_varlen(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens: torch.Tensor,
    start_pos: torch.Tensor,
    max_len: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Prefill chunks of S sequences in one launch. q [T, H, D] -> [T, H, D].

    Span s is rows cu_seqlens[s]..cu_seqlens[s+1]-1 of q, at positions
    start_pos[s].. of its sequence, attending causally to slots
    0..start_pos[s]+len-1 of block_tables[s] (its own keys already stored).
    max_len >= every span's length (sizes the grid without a device sync).
    """
    _check_prefill(q, k_cache, v_cache, block_tables, cu_seqlens, start_pos)
    check_attention_options("paged_attention_prefill", window, softcap)
    t, heads, d = q.shape
    out = torch.empty((t, heads, d), dtype=q.dtype, device=q.device)
    spans = block_tables.shape[0]
    if t and spans and max_len > 0:
        bm = 16 if max_len <= 16 else 32
        _prefill_kernel[(triton.cdiv(max_len, bm), spans, heads)](
            q,
            k_cache,
            v_cache,
            block_tables,
            cu_seqlens,
            start_pos,
            out,
            scale,
            window or 0,
            softcap or 0.0,
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            block_tables.stride(0),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            G=heads // k_cache.shape[2],
            D=d,
            D_P=max(16, triton.next_power_of_2(d)),  # tl.dot needs >= 16 on the GPU
            BS=k_cache.shape[1],
            BM=bm,
            BN=32,
            # The interpreter's 16-bit tl.dot is wrong (triton 3.9): dot in float32 there.
            DOT_F32=q.dtype == torch.float32 or interpreting(),
            HAS_WINDOW=window is not None,
            HAS_SOFTCAP=softcap is not None,
        )
    return out


def paged_attention_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    start_pos: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One span (contract of reference.paged_attention_prefill): q [L, H, D] at start_pos, table [nb]."""
    check_tensor("paged_attention_prefill", "block_table", block_table, ("nb",), dtypes=INDEX_DTYPES)
    length = q.shape[0] if isinstance(q, torch.Tensor) and q.dim() == 3 else 0
    dev = block_table.device
    return paged_attention_prefill_varlen(
        q,
        k_cache,
        v_cache,
        block_table[None],
        torch.tensor([0, length], dtype=torch.int32, device=dev),
        torch.tensor([start_pos], dtype=torch.int32, device=dev),
        length,
        scale,
        window,
        softcap,
    )
