"""The native CPU kernels (common.c, q4.c, dense.c, decode.c, prefill.c, vnni.c), compiled at first use.

Why native: a decode step of a small quantized model is op-call bound in PyTorch (~200 ATen calls
per layer, most of them views and casts; benchmarks/RESULTS.md, issue 22), while its weights are
read in a few milliseconds. decode.c runs a whole stage's decode step in one call and the 4-bit
projections of any step, reading quant.py's nibble layout directly.

The shared object is built once per (source, compiler flags, CPU) under $PIPESERVE_HOME/native
(PIPESERVE_HOME defaults to ~/.cache/pipeserve) with `-O3 -march=native -fopenmp`, written to a
temporary name and renamed, so concurrent stages never load a half-written file; ~2 s, once. No
compiler, or a failed build, means `load()` returns None and callers keep their PyTorch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
# One library from these (native.h is their shared header): the build's inputs and its cache key.
SOURCES = [HERE / name for name in ("common.c", "q4.c", "dense.c", "decode.c", "prefill.c", "vnni.c")]
HEADER = HERE / "native.h"
FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]
# What the library is compiled for: this CPU. The tests also build other x86 levels (an AVX2-only
# CPU, one without AVX2) to check the kernels each of them selects.
NATIVE_ARCH = "native"
BUILD_TIMEOUT_S = 120.0


def cache_dir() -> Path:
    return Path(os.environ.get("PIPESERVE_HOME") or Path.home() / ".cache" / "pipeserve") / "native"


def _cpu_id() -> str:
    """The CPU's model and flags: -march=native code is only valid on the CPU that built it."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def _flags(arch: str) -> list[str]:
    # -Wno-psabi: 64-byte vector types on a CPU without AVX-512 warn of an ABI no caller crosses
    # (every function taking one is static inline).
    return [f"-march={arch}", "-Wno-psabi", *FLAGS]


def library_path(compiler: str, arch: str = NATIVE_ARCH) -> Path:
    key = hashlib.sha256()
    for path in (*SOURCES, HEADER):
        key.update(path.read_bytes())
    for part in (" ".join([compiler, *_flags(arch)]).encode(), _cpu_id().encode()):
        key.update(part)
    return cache_dir() / f"q4-{key.hexdigest()[:16]}.so"


def build(compiler: str, arch: str = NATIVE_ARCH) -> Path:
    """Compile the sources for `arch` (gcc's -march; default this CPU) if not already cached and
    return the shared object's path; raises on failure."""
    target = library_path(compiler, arch)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *_flags(arch), *map(str, SOURCES), "-o", tmp, "-lm"],
            check=True,
            capture_output=True,
            timeout=BUILD_TIMEOUT_S,
        )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


# Up to `Native.int16_rows` rows (native.h's INT_ROWS: 4 with VNNI, else 12; it says why) the kernels
# unpack each weight chunk in registers and, on AVX2, quantize x to int16 per 32 elements for an
# integer dot. Above, on AVX2, prefill.c rounds x to int16 per 32 elements too, held as two int8
# planes for the CPU's int8 dot product (VNNI or maddubs) on weight tiles it repacks per call
# (`Native.int8_prefill`). Without AVX2: up to FUSED_ROWS rows float tiles of the weight; above,
# the weight dequantized to float32 and torch's GEMM (oneDNN/MKL).
FUSED_ROWS = 256


# decode.c's projection kinds (Q4.kind); W_CAT: parts of other kinds stacked by rows (`q` points at
# `g` Q4 structs).
W_Q4, W_F32, W_Q8, W_CAT = 0, 1, 2, 3
# A dense float32 weight goes through dense.c up to this many rows (decode steps, short chunks);
# above, torch's GEMM (MKL) is faster. Its K must be a multiple of F32_K_MULTIPLE (the kernel's unroll).
F32_ROWS = 32
F32_K_MULTIPLE = 16

# The pool dtypes decode.c reads and writes (its KV_F32, KV_F16, KV_BF16).
KV_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


class Q4(ctypes.Structure):
    """decode.c's Q4: one projection, a nibble-layout weight (kind W_Q4), a dense float32 one (W_F32:
    `q` points at it, s and z are NULL) or 8-bit blocks (W_Q8: int8 in `q`, float32 scales per `g`
    (16 or 32; 0 means 32) in `s`, float32 mins per 32 or NULL in `z`); bias may be NULL."""

    _fields_ = [
        ("q", ctypes.c_void_p),
        ("s", ctypes.c_void_p),
        ("z", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("n", ctypes.c_int),
        ("k", ctypes.c_int),
        ("g", ctypes.c_int),
        ("kind", ctypes.c_int),
    ]


class Layer(ctypes.Structure):
    """decode.c's Layer: a decoder layer's norm weights and projections."""

    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("qkv", Q4),
        ("o", Q4),
        ("gate_up", Q4),
        ("down", Q4),
    ]


class Dims(ctypes.Structure):
    """decode.c's Dims: the model's sizes and the KV pool's geometry."""

    _fields_ = [
        ("hidden", ctypes.c_int),
        ("heads", ctypes.c_int),
        ("kv_heads", ctypes.c_int),
        ("head_dim", ctypes.c_int),
        ("inter", ctypes.c_int),
        ("blocks", ctypes.c_int),
        ("block_size", ctypes.c_int),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("kv_dtype", ctypes.c_int),
    ]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class Native:
    """The loaded library: its functions with their C signatures (ctypes checks arity and types)."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        p, i = ctypes.c_void_p, ctypes.c_int
        self._q4_matmul = lib.q4_matmul
        self._q4_matmul.argtypes = [p, i, i, p, p, p, i, i, p, p]
        self._q4_matmul.restype = None
        self._q4_dequant = lib.q4_dequant
        self._q4_dequant.argtypes = [p, p, p, i, i, i, p]
        self._q4_dequant.restype = None
        self._f32_matmul = lib.f32_matmul
        self._f32_matmul.argtypes = [p, i, i, p, i, p, p]
        self._f32_matmul.restype = None
        self._q8_matmul = lib.q8_matmul
        self._q8_matmul.argtypes = [p, i, i, p, p, p, i, i, p, p]
        self._q8_matmul.restype = None
        self._decode_attention = lib.decode_attention
        self._decode_attention.argtypes = [p, ctypes.c_size_t, p, p, p, i, p, i, p, p]
        self._decode_attention.restype = None
        self._decode_step = lib.decode_step
        self._decode_step.argtypes = [p, p, i, i, p, p, p, p, p, i, p, p]
        self._decode_step.restype = None
        # prefill.c is built (AVX2): more than int16_rows rows multiply on int8 dot products.
        self.int8_prefill = bool(lib.int8_prefill())
        self.int16_rows = int(lib.int16_rows())
        self._set_threads = lib.set_threads
        self._set_threads.argtypes = [i]
        self._set_threads.restype = None
        self.path = path
        self._rooms = threading.local()

    def int4_linear(
        self,
        x: torch.Tensor,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        group: int,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x float32 [M, K] @ W^T (+ bias) -> float32 [M, N]; qweight uint8 [N, K/2] (nibbles),
        scales / zeros bfloat16 [N, K/G], contiguous: W = (q - 8) * s + z."""
        m, k = x.shape
        n = qweight.shape[0]
        x = x.contiguous()
        if m > FUSED_ROWS and not self.int8_prefill:
            w = self.int4_dequant(qweight, scales, zeros, group, out=self._weight_room(n * k))
            return torch.addmm(bias, x, w.t()) if bias is not None else x @ w.t()
        y = torch.empty(m, n, dtype=torch.float32)
        self._threads()
        self._q4_matmul(
            x.data_ptr(),
            m,
            k,
            qweight.data_ptr(),
            scales.data_ptr(),
            zeros.data_ptr(),
            n,
            group,
            _ptr(bias),
            y.data_ptr(),
        )
        return y

    def _threads(self) -> None:
        """The kernels' parallel regions take torch's thread count for the calling thread: libgomp's
        own default ignores torch.set_num_threads in threads started after it (the engine thread)."""
        self._set_threads(torch.get_num_threads())

    def decode_step(self, *args: object) -> None:
        """decode.c's decode_step (its C signature; model/native_decode.py builds the arguments)."""
        self._threads()
        self._decode_step(*args)

    def decode_attention(self, *args: object) -> None:
        """decode.c's decode_attention (its C signature; the tests call it)."""
        self._threads()
        self._decode_attention(*args)

    def f32_linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x float32 [M, K] @ weight^T (+ bias) -> float32 [M, N]; weight dense float32 [N, K],
        contiguous, K % F32_K_MULTIPLE == 0. Sums in another order than MKL's: equal within float32
        rounding (tests/kernels/test_native.py)."""
        m, k = x.shape
        n = weight.shape[0]
        x = x.contiguous()
        y = torch.empty(m, n, dtype=torch.float32)
        self._threads()
        self._f32_matmul(x.data_ptr(), m, k, weight.data_ptr(), n, _ptr(bias), y.data_ptr())
        return y

    def int8_linear(
        self,
        x: torch.Tensor,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None = None,
        mins: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x float32 [M, K] @ W^T (+ bias) -> float32 [M, N]; W = q * d (+ m) over blocks: qweight
        int8 [N, K] with scales float32 [N, K/32]; or Q6_K (sub 16, dense.c): qweight its 6-bit
        packing uint8 [N, K/256 * 192], scales per super-block a float32 d and 16 int8 sub-scales
        (uint8 [N, K/256 * 20], gguf_types.pack_q6k_scales); mins None or float32 [N, K/32];
        contiguous."""
        m, k = x.shape
        n = qweight.shape[0]
        sub = 16 if qweight.dtype == torch.uint8 else 32
        wq = (n, k // 256 * 192, torch.uint8) if sub == 16 else (n, k, torch.int8)
        ws = (n, k // 256 * 20, torch.uint8) if sub == 16 else (n, k // 32, torch.float32)
        got_q, got_s = (*qweight.shape, qweight.dtype), (*scales.shape, scales.dtype)
        if k % (256 if sub == 16 else 32) or got_q != wq or got_s != ws:
            raise ValueError(
                f"int8_linear: qweight {tuple(qweight.shape)} {qweight.dtype} and scales "
                f"{tuple(scales.shape)} {scales.dtype} are neither int8 blocks with float32 scales "
                f"per 32 nor Q6_K's packing with its scales, for K = {k}"
            )
        if mins is not None and mins.shape != (n, k // 32):
            raise ValueError(f"int8_linear: mins {tuple(mins.shape)} are not per 32 of [{n}, {k}]")
        x = x.contiguous()
        y = torch.empty(m, n, dtype=torch.float32)
        self._threads()
        self._q8_matmul(
            x.data_ptr(),
            m,
            k,
            qweight.data_ptr(),
            scales.data_ptr(),
            _ptr(mins),
            sub,
            n,
            _ptr(bias),
            y.data_ptr(),
        )
        return y

    def _weight_room(self, numel: int) -> torch.Tensor:
        """A float32 buffer reused by every large-M projection of the calling thread (a fresh one
        per call would page-fault megabytes each time); per thread, as stages may share a process."""
        room = getattr(self._rooms, "buffer", None)
        if room is None or room.numel() < numel:
            room = self._rooms.buffer = torch.empty(numel, dtype=torch.float32)
        return room[:numel]

    def int4_dequant(
        self,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        group: int,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The float32 weight [N, K] the kernels compute with (into `out`'s storage if given)."""
        n, k = qweight.shape[0], qweight.shape[1] * 2
        w = torch.empty(n, k, dtype=torch.float32) if out is None else out.view(n, k)
        self._threads()
        self._q4_dequant(qweight.data_ptr(), scales.data_ptr(), zeros.data_ptr(), n, k, group, w.data_ptr())
        return w


def find_compiler() -> str | None:
    """$CC, else cc or gcc on PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@functools.cache
def load() -> Native | None:
    """The native kernels, built if needed; None where they cannot be (no compiler, build error).

    Cached per process (the library is immutable once loaded); the OS shares its pages between
    processes. Callers that must not use it (PIPESERVE_KERNELS=torch) do not call this.
    """
    compiler = find_compiler()
    if compiler is None:
        log.info("no C compiler: the native CPU kernels are off")
        return None
    try:
        return Native(build(compiler))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = (
            exc.stderr.decode(errors="replace")[-2000:]
            if isinstance(exc, subprocess.CalledProcessError)
            else ""
        )
        log.warning("native CPU kernels not built (%s); the PyTorch path serves. %s", exc, detail)
        return None
