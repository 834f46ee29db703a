"""The native CPU kernels (pipeserve_kernels/native/*.c) against PyTorch references.

Tolerances:
- q4_dequant: the weight (q - 8) * s + z of quant.py's nibble layout, within one float32 rounding.
- more than INT_ROWS rows, on AVX2 (prefill.c): x is rounded to int16 per 32-element block (held as
  two int8 planes), so |err| <= sum_k |w| * max|x block| / 65278 per output; without AVX2 float32
  products (weight tiles, or a GEMM above FUSED_ROWS), within 1e-5 of max |y|.
- up to INT_ROWS rows (native.h: 4 with VNNI, else 12): x is quantized to int16 per 32-element
  chunk (on AVX2), so |err| <= sum_k |w| * max|x chunk| / 65534 per output.
- The products and the decode attention run on this CPU's build and on builds for the other x86 levels it
  can execute (`LEVELS`: AVX-512 without VNNI, AVX2 alone, no AVX2 at all), so each of the
  integer paths (VNNI, AVX2's maddubs, float) is checked wherever the tests run.
- decode attention: reference.paged_attention_decode within 1e-5 (float32, another summation
  order), across split boundaries (128 positions), GQA, ragged lengths, scattered blocks and
  float32 / float16 / bfloat16 pools.
"""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch

from pipeserve_kernels import native, reference
from pipeserve_kernels.native import FUSED_ROWS, KV_DTYPES, Dims

KERNELS = native.load()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="no C compiler: the native kernels are not built")


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {
        f for line in text.splitlines() if line.startswith("flags") for f in line.split(":", 1)[1].split()
    }


# Other x86 levels (gcc -march) than this CPU's, each with the CPU flags it needs to run here: AVX-512
# without VNNI (prefill.c on 8 lanes beside 16-float vectors elsewhere), AVX2 alone, no AVX2.
LEVELS = {
    "skylake-avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx2", "fma", "f16c"},
    "haswell": {"avx2", "fma", "f16c", "bmi2"},
    "x86-64-v2": {"sse4_2", "popcnt"},
}


@pytest.fixture(scope="module", params=["native", *LEVELS])
def kernels(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> native.Native:
    """The kernels built for this CPU, or for another x86 level this CPU can run (its own cache dir)."""
    if request.param == "native":
        assert KERNELS is not None
        return KERNELS
    if platform.machine() not in ("x86_64", "AMD64") or not LEVELS[request.param] <= _cpu_flags():
        pytest.skip(f"this CPU cannot run code built for {request.param}")
    compiler = native.find_compiler()
    assert compiler is not None
    home = tmp_path_factory.mktemp(request.param)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PIPESERVE_HOME", str(home))
        return native.Native(native.build(compiler, request.param))


def _nibble_weight(n: int, k: int, group: int, seed: int) -> tuple[torch.Tensor, ...]:
    from pipeserve.model.quant import pack_nibbles

    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    s = (torch.rand(n, k // group, generator=g) * 0.1 + 0.01).bfloat16()
    z = (torch.randn(n, k // group, generator=g) * 0.1).bfloat16()
    w = ((q.float() - 8).reshape(n, k // group, group) * s.float()[..., None] + z.float()[..., None]).reshape(
        n, k
    )
    return pack_nibbles(q), s, z, w


@pytest.mark.parametrize("group", [32, 64, 128])
def test_dequant_is_the_nibble_weight(group: int) -> None:
    qn, s, z, w = _nibble_weight(40, 256, group, seed=1)
    torch.testing.assert_close(KERNELS.int4_dequant(qn, s, z, group), w, atol=1e-6, rtol=1e-6)


def _assert_close_to(
    y: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, w: torch.Tensor, lib: native.Native
) -> None:
    """y [M, N] of a product of x [M, K] and w [N, K] against its float64 `ref`: within the bound x's
    int16 rounding implies (prefill.c above INT_ROWS rows, q4.c / dense.c up to it), or without AVX2
    above INT_ROWS within 1e-5 of max |ref| (float products)."""
    rows, k = x.shape
    err = (y.double() - ref).abs()
    if rows > lib.int16_rows and not lib.int8_prefill:
        assert err.max().item() <= 1e-5 * ref.abs().max().item()
        return
    levels = 65278 if rows > lib.int16_rows else 65534  # 2 * the largest |xq|: half a step of rounding
    chunk_max = x.abs().reshape(rows, k // 32, 32).amax(dim=2).repeat_interleave(32, dim=1)
    bound = (chunk_max.double() / levels) @ w.abs().double().t() + 1e-5
    assert bool((err <= bound).all()), (err / bound).max().item()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 12, 13, 16, 19, 100, FUSED_ROWS + 1])
@pytest.mark.parametrize(("bias", "group"), [(False, 64), (True, 64), (True, 32)])
def test_int4_linear_matches_its_dequantized_weight(
    rows: int, bias: bool, group: int, kernels: native.Native
) -> None:
    n, k = 72, 192  # n not a multiple of the kernels' row tiles (4, 8, 16)
    qn, s, z, w = _nibble_weight(n, k, group, seed=rows)
    g = torch.Generator().manual_seed(100 + rows)
    x = torch.randn(rows, k, generator=g)
    x[0, :32] *= 50.0  # one block far larger than the rest: x's scales are per block, not per row
    b = torch.randn(n, generator=g) if bias else None
    y = kernels.int4_linear(x, qn, s, z, group, b)
    ref = x.double() @ w.double().t() + (b.double() if b is not None else 0.0)
    _assert_close_to(y, ref, x, w, kernels)


def _dims(
    heads: int, kv_heads: int, head_dim: int, blocks: int, block_size: int, kv_dtype: torch.dtype
) -> Dims:
    return Dims(0, heads, kv_heads, head_dim, 0, blocks, block_size, 0.0, head_dim**-0.5, KV_DTYPES[kv_dtype])


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lens", [[1], [127], [128], [129], [300, 5, 256, 129]])
def test_decode_attention_matches_the_reference(
    lens: list[int], kv_dtype: torch.dtype, kernels: native.Native
) -> None:
    heads, kv_heads, d, bs = 6, 2, 32, 16
    b = len(lens)
    width = max(-(-n // bs) for n in lens)
    blocks = b * width + 3
    g = torch.Generator().manual_seed(sum(lens))
    kc = torch.randn(blocks, bs, kv_heads, d, generator=g).to(kv_dtype)
    vc = torch.randn(blocks, bs, kv_heads, d, generator=g).to(kv_dtype)
    # every row's blocks scattered over the pool, tables padded with 0
    perm = torch.randperm(blocks - 1, generator=g)[: b * width] + 1
    tables = perm.view(b, width).clone()
    for r, n in enumerate(lens):
        tables[r, -(-n // bs) :] = 0
    ctx = torch.tensor(lens, dtype=torch.int64)
    # queries inside wider rows, as the decode step's qkv rows hold them
    row_width = heads * d + 2 * kv_heads * d
    proj = torch.randn(b, row_width, generator=g)
    q = proj[:, : heads * d].reshape(b, heads, d)
    out = torch.empty(b, heads * d)
    dims = _dims(heads, kv_heads, d, blocks, bs, kv_dtype)
    kernels.decode_attention(
        proj.data_ptr(), row_width, kc.data_ptr(), vc.data_ptr(), tables.data_ptr(), width,
        ctx.data_ptr(), b, native.ctypes.byref(dims), out.data_ptr(),
    )  # fmt: skip
    ref = reference.paged_attention_decode(q, kc, vc, tables, ctx, d**-0.5)  # upcasts a 16-bit pool
    torch.testing.assert_close(out.view(b, heads, d), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 12, 13, 70])
def test_int8_linear_is_its_q8_0_blocks(rows: int, kernels: native.Native) -> None:
    """q8_matmul over Q8_0 blocks (w = q * d per 32): int8 x (float tiles without AVX2) above
    INT_ROWS rows, int16 x below; the weights span all of [-127, 127] (the w + 128 and sign paths)."""
    n, k = 50, 160
    g = torch.Generator().manual_seed(rows)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    q[0, :2] = torch.tensor([-127, 127], dtype=torch.int8)
    d = torch.rand(n, k // 32, generator=g) * 0.01
    w = (q.float().reshape(n, -1, 32) * d[..., None]).reshape(n, k)
    x = torch.randn(rows, k, generator=g)
    b = torch.randn(n, generator=g)
    y = kernels.int8_linear(x, q, d, b)
    ref = x.double() @ w.double().t() + b.double()
    _assert_close_to(y, ref, x, w, kernels)


@pytest.mark.parametrize("rows", [1, 5, 13])
def test_int8_linear_is_its_q6_k_blocks(rows: int, kernels: native.Native) -> None:
    """q8_matmul over Q6_K as the file has it (its 6-bit packing, random bytes; per 256 a float32 d
    and 16 int8 sub-scales, negative ones included): w = d * sc[j] * q per 16, q what
    gguf_types.q6k_values reads (itself checked against gguf-py), on every level's path."""
    from pipeserve.model.gguf_types import pack_q6k_scales, q6k_values

    n, k = 37, 512
    g = torch.Generator().manual_seed(rows)
    q6 = torch.randint(0, 256, (n, k // 256 * 192), generator=g, dtype=torch.uint8)
    d = (torch.rand(n, k // 256, generator=g) * 1e-3).half().float()  # an fp16 value, as the file's
    sc = torch.randint(-128, 128, (n, k // 16), generator=g, dtype=torch.int8)
    per16 = (d[..., None] * sc.float().reshape(n, -1, 16)).reshape(n, -1)
    w = (q6k_values(q6).float().reshape(n, -1, 16) * per16[..., None]).reshape(n, k)
    x = torch.randn(rows, k, generator=g)
    y = kernels.int8_linear(x, q6, pack_q6k_scales(d, sc), None)
    _assert_close_to(y, x.double() @ w.double().t(), x, w, kernels)


@pytest.mark.parametrize("k", [192, 208])  # 208: a tail past the 64-wide unroll
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 16, 33])
def test_f32_linear_is_f_linear(rows: int, k: int, kernels: native.Native) -> None:
    """The dense float32 product (native.f32_linear) equals F.linear within float32 rounding of
    sums of K products (another order than MKL's)."""
    n = 70
    g = torch.Generator().manual_seed(rows)
    w, x, b = torch.randn(n, k, generator=g), torch.randn(rows, k, generator=g), torch.randn(n, generator=g)
    y = kernels.f32_linear(x, w, b)
    ref = x.double() @ w.double().t() + b.double()
    bound = 1e-6 * (x.abs().double() @ w.abs().double().t() + b.abs().double())  # ~8 ulp of |x||w|
    assert bool(((y.double() - ref).abs() <= bound).all())


def test_dense_float_weights_are_kept_for_the_native_product() -> None:
    """pack_linear_weight keeps a float32 weight dense where the native kernels read it (K % 16 == 0)
    and packs any other for oneDNN; linear() gives F.linear's values on both."""
    import pipeserve_kernels as K

    g = torch.Generator().manual_seed(0)
    for k, dense in ((128, True), (100, False)):
        w, x = torch.randn(40, k, generator=g), torch.randn(3, k, generator=g)
        kept = K.pack_linear_weight(w)
        assert (not kept.is_mkldnn) == dense
        torch.testing.assert_close(
            K.linear(x, kept, None), torch.nn.functional.linear(x, w), rtol=1e-5, atol=1e-5
        )
