"""Argument checks shared by the Triton kernels: clear ValueErrors before a launch.

A Triton kernel trusts its pointers and strides; a wrong shape reads or writes
out of bounds instead of failing. Each wrapper therefore states what it needs
(rank, sizes, dtype, device, which dims must be unit-stride) through these
helpers, and the message names the op, the argument and the expected shape.
"""

from __future__ import annotations

import os

import torch

# Element types the kernels compute in (they always accumulate in float32).
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU (TRITON_INTERPRET=1, read before triton was imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_tensor(
    op: str,
    name: str,
    t: torch.Tensor,
    shape: tuple[int | str, ...],
    sizes: dict[str, int] | None = None,
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES,
    unit_last: bool = True,
) -> dict[str, int]:
    """Check t against a symbolic shape, binding the named dims into `sizes`.

    shape items are ints (that exact size) or names (bound on first sight,
    compared afterwards), e.g. ("T", "H", "D"). Returns the updated bindings.
    unit_last: the last dim must be contiguous (stride 1), as every kernel
    loads rows with unit stride.
    """
    sizes = {} if sizes is None else sizes
    spelled = "[" + ", ".join(str(s) for s in shape) + "]"
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{op}: {name} must be a tensor {spelled}, got {type(t).__name__}")
    if t.dim() != len(shape):
        raise ValueError(f"{op}: {name} must be {spelled}, got shape {list(t.shape)}")
    for dim, (want, got) in enumerate(zip(shape, t.shape, strict=True)):
        if isinstance(want, int):
            if got != want:
                raise ValueError(f"{op}: {name} must be {spelled}, got shape {list(t.shape)} (dim {dim})")
        elif want in sizes and sizes[want] != got:
            raise ValueError(
                f"{op}: {name} must be {spelled} with {want}={sizes[want]}, got shape {list(t.shape)}"
            )
        else:
            sizes[want] = got
    if t.dtype not in dtypes:
        raise ValueError(f"{op}: {name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if unit_last and t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{op}: {name} must be contiguous in its last dim, got strides {t.stride()}")
    if not t.is_cuda and not interpreting():
        raise ValueError(
            f"{op}: {name} is on {t.device}; the Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 "
            "set before triton is imported (PIPESERVE_KERNELS=torch selects the CPU path)"
        )
    return sizes


def check_same_dtype(op: str, **tensors: torch.Tensor) -> None:
    dtypes = {name: t.dtype for name, t in tensors.items()}
    if len(set(dtypes.values())) > 1:
        raise ValueError(f"{op}: {', '.join(dtypes)} must share one dtype, got {dtypes}")


def check_divisible(op: str, heads: int, kv_heads: int) -> None:
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"{op}: query heads H={heads} must be a multiple of kv heads KVH={kv_heads}")


def check_attention_options(op: str, window: int | None, softcap: float | None) -> None:
    """window >= 1 and softcap > 0 where given (the kernels read 0 as "none")."""
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"{op}: window must be a positive int or None, got {window!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"{op}: softcap must be > 0 or None, got {softcap!r}")


INDEX_DTYPES = (torch.int32, torch.int64)
