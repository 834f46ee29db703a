"""Paged attention's sliding window and logit soft-capping, on every backend.

The reference (reference.py) is checked against transformers itself: Gemma 2's eager attention
(scale, softcap, mask, float32 softmax) under the mask masking_utils builds for a sliding window
(key p visible to query i iff i - window < p <= i). The CPU ops (cpu.py) and the Triton kernels
(interpreter, TRITON_INTERPRET=1 set before triton is imported) are then checked against the
reference: decode groups of mixed lengths, one-row pool views, prefill chunks that start the
sequence or follow a cached prefix, varlen spans; windows shorter than, equal to and longer than
the context, across block boundaries. Tolerances as tests/kernels/test_triton_kernels.py.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any triton import: kernels run on the CPU

from typing import Any

import pytest
import torch
from torch import nn
from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

import pipeserve_kernels.reference as ref
from pipeserve_kernels import cpu
from pipeserve_kernels import triton_attention as tatt

BS = 4
KVH, D = 2, 16
WINDOWS = [None, 1, 3, BS + 1, 64]  # 64: longer than every context here (no key hidden)


def randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    tol = 1e-5 if got.dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def pool(blocks: int = 24, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    # Scaled up so a softcap of 2 bends the scores (|q.k| * scale reaches several units).
    return 3 * randn(blocks, BS, KVH, D, seed=1, dtype=dtype), randn(blocks, BS, KVH, D, seed=2, dtype=dtype)


def hf_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    qpos: torch.Tensor,
    window: int | None,
    softcap: float | None,
    scale: float,
) -> torch.Tensor:
    """transformers' Gemma 2 eager attention of queries q [L, H, D] at positions qpos [L] over keys
    and values [ctx, KVH, D] at positions 0..ctx-1, with masking_utils' (sliding) causal mask."""
    ctx, heads = keys.shape[0], q.shape[1]
    # Any: the mask functions are typed for ints and evaluate index tensors alike (their index-based form).
    fn: Any = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    allowed: torch.Tensor = fn(0, 0, qpos[:, None], torch.arange(ctx)[None, :])  # [L, ctx], index-based form
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    module = nn.Module().eval()  # what the function reads of Gemma2Attention
    setattr(module, "num_key_value_groups", heads // keys.shape[1])  # noqa: B010 (nn.Module's typed setattr)
    out, _ = eager_attention_forward(
        module,
        q.transpose(0, 1)[None],
        keys.transpose(0, 1)[None],
        values.transpose(0, 1)[None],
        additive[None, None],
        scaling=scale,
        softcap=softcap,
    )
    return out[0]  # [L, H, D]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_reference_is_transformers_gemma2_attention(window: int | None, softcap: float | None) -> None:
    k_cache, v_cache = pool()
    table = torch.tensor([5, 17, 2, 9, 11, 0, 21])
    ctx, heads = 6 * BS + 2, 8
    keys, values = k_cache[table].reshape(-1, KVH, D)[:ctx], v_cache[table].reshape(-1, KVH, D)[:ctx]
    for start, length in [(0, ctx), (BS + 1, ctx - BS - 1), (ctx - 1, 1)]:  # whole, a later chunk, a decode
        q = randn(length, heads, D, seed=start)
        qpos = torch.arange(start, start + length)
        want = hf_attention(q, keys, values, qpos, window, softcap, 0.3)
        got = ref.paged_attention_prefill(q, k_cache, v_cache, table, start, 0.3, window, softcap)
        close(got, want)
    # Decode: each row is the last token of its context.
    lens = torch.tensor([1, BS, BS + 1, ctx])
    q = randn(len(lens), heads, D, seed=9)
    got = ref.paged_attention_decode(
        q, k_cache, v_cache, table.repeat(4, 1), lens, 0.3, None, window, softcap
    )
    for row, n in enumerate(lens.tolist()):
        want = hf_attention(
            q[row : row + 1], keys[:n], values[:n], torch.tensor([n - 1]), window, softcap, 0.3
        )
        close(got[row : row + 1], want)


def test_window_changes_the_output() -> None:
    """The options are not silently ignored: a window or a softcap gives another result."""
    k_cache, v_cache = pool()
    table, lens, q = torch.tensor([[3, 4, 5]]), torch.tensor([3 * BS]), randn(1, 8, D)
    plain = ref.paged_attention_decode(q, k_cache, v_cache, table, lens, 0.3)
    assert not torch.allclose(
        plain, ref.paged_attention_decode(q, k_cache, v_cache, table, lens, 0.3, None, 5)
    )
    assert not torch.allclose(
        plain, ref.paged_attention_decode(q, k_cache, v_cache, table, lens, 0.3, None, None, 2.0)
    )


DECODE_CASES = [
    ([9, 9, 9], False),  # one length: no mask, keys from ctx - window on
    ([13, 5, 1, 8], False),  # mixed lengths: the window mask per row
    ([2 * BS + 3], True),  # one row over consecutive blocks: a view of the pool
]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("lens,consecutive", DECODE_CASES)
def test_decode_backends_equal_reference(
    window: int | None, softcap: float | None, lens: list[int], consecutive: bool
) -> None:
    k_cache, v_cache = pool()
    width = -(-max(lens) // BS) + 1
    ids = torch.arange(4, 4 + width) if consecutive else torch.randperm(24)[: len(lens) * width]
    table = ids.view(len(lens), width)
    q, ctx = randn(len(lens), 8, D, seed=6), torch.tensor(lens)
    want = ref.paged_attention_decode(q, k_cache, v_cache, table, ctx, 0.3, None, window, softcap)
    ws = k_cache.new_empty(2, table.numel(), BS, KVH, D)
    close(cpu.paged_attention_decode(q, k_cache, v_cache, table, ctx, 0.3, ws, window, softcap), want)
    close(tatt.paged_attention_decode(q, k_cache, v_cache, table, ctx, 0.3, None, window, softcap), want)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_backends_equal_reference(
    window: int | None, softcap: float | None, dtype: torch.dtype
) -> None:
    k_cache, v_cache = pool(dtype=dtype)
    table = torch.tensor([6, 2, 14, 9, 0, 3, 8, 1, 13, 20, 22])
    for start, length in [(0, 1), (0, 3 * BS + 1), (BS - 1, BS), (BS + 1, 5 * BS + 3), (7 * BS, 2)]:
        q = randn(length, 8, D, seed=start + length, dtype=dtype)
        want = ref.paged_attention_prefill(q, k_cache, v_cache, table, start, 0.3, window, softcap)
        close(cpu.paged_attention_prefill(q, k_cache, v_cache, table, start, 0.3, window, softcap), want)
        close(tatt.paged_attention_prefill(q, k_cache, v_cache, table, start, 0.3, window, softcap), want)


@pytest.mark.parametrize("window", [3, BS + 1])
def test_prefill_varlen_window_softcap(window: int) -> None:
    k_cache, v_cache = pool()
    spans = [
        (0, 5, [4, 7]),
        (BS, BS + 1, [1, 2, 3]),
        (BS + 3, 40, [5, 6, 8, 9, 10, 11, 12, 13, 14, 15, 0, 16]),
    ]
    q = randn(sum(n for _, n, _ in spans), 8, D, seed=7)
    width = max(len(t) for *_, t in spans)
    tables = torch.tensor([t + [0] * (width - len(t)) for *_, t in spans])
    cu = torch.tensor([0, 5, 5 + BS + 1, len(q)], dtype=torch.int32)
    starts = torch.tensor([s for s, _, _ in spans])
    got = tatt.paged_attention_prefill_varlen(q, k_cache, v_cache, tables, cu, starts, 40, 0.3, window, 2.0)
    for i, (start, _, table) in enumerate(spans):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        want = ref.paged_attention_prefill(
            q[rows], k_cache, v_cache, torch.tensor(table), start, 0.3, window, 2.0
        )
        close(got[rows], want)


def test_decode_reads_no_key_before_the_window() -> None:
    """NaN in every slot before the window: the fast paths never read it (O(window) keys per query)."""
    k_cache, v_cache = pool(8)
    ctx, window = 6 * BS - 1, BS + 2
    for cache in (k_cache, v_cache):
        cache.view(-1, KVH, D)[BS : BS + ctx - window] = float("nan")
    table, q = torch.tensor([[1, 2, 3, 4, 5, 6]]), randn(1, 8, D)
    for lens in ([ctx], [ctx, ctx]):
        tables, n = table.repeat(len(lens), 1), torch.tensor(lens)
        assert torch.isfinite(
            cpu.paged_attention_decode(
                q.repeat(len(lens), 1, 1), k_cache, v_cache, tables, n, 0.3, None, window
            )
        ).all()
        assert torch.isfinite(
            tatt.paged_attention_decode(
                q.repeat(len(lens), 1, 1), k_cache, v_cache, tables, n, 0.3, None, window
            )
        ).all()


def test_bad_options_raise_clear_errors() -> None:
    k_cache, v_cache = pool()
    q, tables, lens = randn(1, 8, D), torch.tensor([[1]]), torch.tensor([1])
    with pytest.raises(ValueError, match="window must be a positive int"):
        tatt.paged_attention_decode(q, k_cache, v_cache, tables, lens, 0.3, None, 0)
    with pytest.raises(ValueError, match="softcap must be > 0"):
        tatt.paged_attention_prefill(q, k_cache, v_cache, tables[0], 0, 0.3, None, -1.0)
