"""Backend choice for the kernel interface: Triton on CUDA, the CPU (PyTorch) functions otherwise.

PIPESERVE_KERNELS (read once, when pipeserve_kernels is imported):
  auto    (default) Triton for CUDA tensors when triton imports and a CUDA
          device exists; the CPU function for everything else. Without CUDA,
          triton is never imported (it costs start-up time and memory).
          float32 CPU projections run on weights packed for oneDNN at load
          (cpu_linear.py).
  torch   the CPU functions everywhere (on CUDA they run as PyTorch ops);
          projections are plain F.linear on dense weights (no packing).
  triton  the Triton kernels everywhere; on a machine without CUDA that needs
          TRITON_INTERPRET=1 in the environment (the interpreter tests, the
          engine check in tests/kernels/).

`select` returns the chosen function itself where the choice does not depend
on the device, so the CPU path pays no dispatch cost per call.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable
from typing import Any, TypeVar

BACKENDS = ("auto", "torch", "triton")
ENV = "PIPESERVE_KERNELS"

# Kernel name -> the module under pipeserve_kernels that holds its Triton version.
TRITON_MODULES = {
    "rms_norm": "triton_ops",
    "rms_norm_residual": "triton_ops",
    "apply_rotary": "triton_ops",
    "silu_and_mul": "triton_ops",
    "store_kv": "triton_ops",
    "paged_attention_decode": "triton_attention",
    "paged_attention_prefill": "triton_attention",
}

F = TypeVar("F", bound=Callable[..., Any])


def backend_from_env(environ: dict[str, str] | os._Environ[str] = os.environ) -> str:
    """The configured backend; ValueError naming the variable for anything but BACKENDS."""
    mode = environ.get(ENV, "auto").strip().lower() or "auto"
    if mode not in BACKENDS:
        raise ValueError(f"{ENV} must be one of {BACKENDS}, got {environ.get(ENV)!r}")
    return mode


def cuda_triton_available() -> bool:
    """A CUDA device is present and triton imports (checked only in auto mode)."""
    import torch

    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_kernel(name: str) -> Callable[..., Any]:
    """The Triton implementation of `name` (imports triton)."""
    fn: Callable[..., Any] = getattr(
        importlib.import_module(f"pipeserve_kernels.{TRITON_MODULES[name]}"), name
    )
    return fn


def select(name: str, cpu: F, mode: str, gpu_present: bool) -> F:
    """The function the interface exports as `name` under backend `mode`.

    gpu_present: cuda_triton_available(), evaluated once by the caller.
    In auto mode with a GPU the result dispatches on the first argument's
    device (every op's first argument is a tensor on the op's device).
    """
    if mode == "torch" or (mode == "auto" and not gpu_present):
        return cpu
    gpu = triton_kernel(name)
    if mode == "triton":
        return gpu  # type: ignore[return-value]  # same contract as `cpu` (tests/kernels check it)

    @functools.wraps(cpu)
    def on_device(*args: Any, **kwargs: Any) -> Any:
        return (gpu if args[0].is_cuda else cpu)(*args, **kwargs)

    return on_device  # type: ignore[return-value]
