"""Every Triton kernel compiles for an NVIDIA GPU (sm_80 and sm_90), here without one.

The other kernel tests run the kernels in Triton's interpreter, which executes them as Python and
so accepts code the compiler refuses (a non-constexpr global once passed every interpreter test and
would have failed its first launch on a GPU). tests/kernels/triton_compile.py puts each kernel,
in every flag variant and in bfloat16 and float32, through the real pipeline down to a cubin.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("triton_compile.py")


@pytest.mark.slow
@pytest.mark.parametrize("arch", [80, 90])
def test_every_triton_kernel_compiles_for_the_gpu(arch: int) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--arch", str(arch)],
        env=env,
        capture_output=True,
        text=True,
        timeout=480,
    )
    lines = run.stdout.splitlines()
    failed = [line for line in lines if line.startswith("FAIL")]
    assert run.returncode == 0 and not failed, run.stdout[-4000:] + run.stderr[-2000:]
    # 17 variants per dtype (each kernel, each of its flags on and off), two dtypes: none skipped.
    assert sum(line.startswith("ok ") for line in lines) == 34, run.stdout
