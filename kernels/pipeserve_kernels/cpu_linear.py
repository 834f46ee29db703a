"""Linear layers on the CPU through oneDNN, with each weight reordered once at load.

Why: torch's float32 `linear` on this class of CPU goes to MKL, which runs small-M products far
below the memory bandwidth (M = 1 reads weights at ~15 GB/s where a sum reads ~31; M = 16 runs at
~35 GFLOP/s). oneDNN with its weight already in its blocked layout reads ~2x faster at M = 1 and
runs M = 16 ~1.8x faster (benchmarks/RESULTS.md, "oneDNN packed linear"), and is no slower for
prefill-sized M. A decode step is mostly these products, so this is the single-stream lever.

The packed weight is an opaque `torch._mkldnn` tensor of the same shape and size; the dense one is
dropped, so memory does not grow. Packing is for float32 CPU weights only (bfloat16 needs AVX-512
in oneDNN's CPU path; float16 has no fast path): `pack_weight` returns any other weight unchanged,
and `linear` runs `F.linear` for it. Sums run in a different order than MKL's, so results differ
from `F.linear` within float32 rounding (tests/kernels/test_cpu_linear.py bounds it).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from pipeserve_kernels.native import F32_K_MULTIPLE, F32_ROWS

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from pipeserve_kernels.native import Native

# oneDNN builds (JIT-compiles) and caches one primitive per input shape, ~0.6 MB each, up to 1024 of
# them: a server whose steps have every row count from 1 to 2048 would keep ~600 MB of them, and
# glibc kept ~3.6 GB of freed activation buffers of those sizes (RESULTS.md). So the row counts
# oneDNN sees are a fixed set: up to EXACT_ROWS as they are (decode batches, no padding); larger
# inputs in pieces of CHUNK_ROWS rows, the last piece zero-padded to a multiple of ROW_QUANTUM
# (rows are independent; the padding rows are dropped): 46 shapes per weight shape, ~0.6 MB each.
# Measured at 108-113 GFLOP/s for 100-2048 rows, as fast as one call of the exact shape.
EXACT_ROWS = 32
ROW_QUANTUM = 16
CHUNK_ROWS = 256

# The M oneDNN tunes the packed layout for. 1 favours single-stream decode, larger values batched
# decode and prefill; measured on a decode step of the 169M benchmark model (RESULTS.md).
BATCH_HINT = 1


def _dense_cpu_float32(weight: torch.Tensor) -> bool:
    """A plain (not yet packed) 2-D float32 weight on the CPU: what either fast path starts from."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and not weight.is_mkldnn
    )


def can_pack(weight: torch.Tensor) -> bool:
    """A weight oneDNN can pack here: float32, 2-D, on the CPU, oneDNN present."""
    return _dense_cpu_float32(weight) and torch.backends.mkldnn.is_available()


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] -> the same values in oneDNN's layout, or weight itself if not packable."""
    if not can_pack(weight):
        return weight
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), BATCH_HINT)


def row_pieces(rows: int) -> list[tuple[int, int, int]]:
    """(start, rows, rows run) of each oneDNN call for an input of `rows` rows; rows run >= rows."""
    if rows <= EXACT_ROWS:
        return [(0, rows, rows)]
    pieces = []
    for start in range(0, rows, CHUNK_ROWS):
        n = min(CHUNK_ROWS, rows - start)
        run = n if n <= EXACT_ROWS else math.ceil(n / ROW_QUANTUM) * ROW_QUANTUM
        pieces.append((start, n, run))
    return pieces


def native_weight(weight: torch.Tensor) -> bool:
    """A weight the native kernels' float32 product reads (native.f32_linear): kept dense, not packed."""
    return _dense_cpu_float32(weight) and weight.is_contiguous() and weight.shape[1] % F32_K_MULTIPLE == 0


# The per-CPU guard of the native float32 product: the row counts it is timed at against oneDNN's
# packed product, on a weight of the size of the benchmark model's projections.
CALIBRATION_ROWS = (1, 2, 4, 8, 16, F32_ROWS)
CALIBRATION_SHAPE = (1024, 1024)


def rows_that_win(native_s: dict[int, float], onednn_s: dict[int, float]) -> int:
    """The largest row count up to which the native product was never slower (0: not even at 1 row)."""
    rows = 0
    for m in sorted(native_s):
        if native_s[m] > onednn_s[m]:
            break
        rows = m
    return rows


def _best_of(fn: Callable[[], object], reps: int = 7, calls: int = 5) -> float:
    """The fastest of `reps` timings of `calls` calls: a busy machine slows some, never speeds one up."""
    best = math.inf
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, time.perf_counter() - start)
    return best


def _measure(kernels: Native) -> tuple[dict[int, float], dict[int, float]]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(*CALIBRATION_SHAPE, generator=g)
    packed = pack_weight(w)
    native_s, onednn_s = {}, {}
    for m in CALIBRATION_ROWS:
        x = torch.randn(m, CALIBRATION_SHAPE[1], generator=g)
        native_s[m] = _best_of(functools.partial(kernels.f32_linear, x, w))
        onednn_s[m] = _best_of(functools.partial(linear, x, packed, None))
    return native_s, onednn_s


@functools.cache
def native_f32_rows(kernels: Native) -> int:
    """Up to how many rows the native float32 product serves on this CPU (0: never; then float32
    weights are packed for oneDNN and stages decode on the PyTorch layers). Measured against oneDNN
    once per built library (per source, flags and CPU), kept in a file beside it; a CPU on which the
    native kernels lose (the float32 step ran 2.1x slower than PyTorch's on an AVX2-only CPU before
    its loops took the CPU's vector width, issue 27) so never takes them."""
    path = kernels.path.with_suffix(".f32rows.json")
    try:
        return int(json.loads(path.read_text())["rows"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    native_s, onednn_s = _measure(kernels)
    rows = rows_that_win(native_s, onednn_s)
    record = {"rows": rows, "native_s": native_s, "onednn_s": onednn_s, "threads": torch.get_num_threads()}
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)  # whole or absent: stages starting together may both measure, one wins
    log.info("native float32 product: up to %d rows on this CPU (timed against oneDNN)", rows)
    return rows


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernels: Native | None = None
) -> torch.Tensor:
    """x [..., in] @ weight.T + bias -> [..., out]; weight dense or from pack_weight. With `kernels`
    (the native CPU kernels), a dense float32 weight's product of up to native_f32_rows rows runs there."""
    if not weight.is_mkldnn:
        if kernels is not None and x.dtype == torch.float32 and native_weight(weight):
            flat = x.reshape(-1, x.shape[-1])
            if flat.shape[0] <= native_f32_rows(kernels):
                return kernels.f32_linear(flat, weight, bias).view(*x.shape[:-1], weight.shape[0])
        return F.linear(x, weight, bias)
    flat = x.reshape(-1, x.shape[-1])
    outs = []
    for start, n, run in row_pieces(flat.shape[0]):
        part = flat[start : start + n]
        if run > n:
            padded = part.new_zeros(run, part.shape[1])
            padded[:n] = part
            part = padded
        out = torch.ops.mkldnn._linear_pointwise(part, weight, bias, "none", [], "")
        outs.append(out[:n] if run > n else out)
    y = outs[0] if len(outs) == 1 else torch.cat(outs)
    return y.view(*x.shape[:-1], y.shape[-1])
