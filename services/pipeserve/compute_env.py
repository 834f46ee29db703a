"""What a pipeserve process sets in its environment before torch loads: OpenMP's wait policy.

torch's intra-op threads and the native kernels' (kernels/pipeserve_kernels/native) are libgomp's,
which makes a thread that reaches a barrier first spin for it by default. That is right on a machine
with a core per thread and nothing else to run; pipeserve shares its cores with the router, the
engine thread, the ring and gRPC, so a compute thread is often preempted inside an op, and its
partner then spins on the core it needs: each of a prefill's ~400 ops waited out a time slice.
Measured beside one busy core on 2 vCPUs (benchmarks/RESULTS.md, issue 27): TTFT of a 100-token
prompt 4.5 s spinning, 0.32 s with PASSIVE waiters, which sleep and give their core back.

libgomp reads the variable once, when torch loads it, so `prepare()` runs first thing in the CLI
(before any subcommand imports torch); child processes (`pipeserve up`'s stages) inherit it. A
value the user exported wins.
"""

from __future__ import annotations

import os

OPENMP_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}


def prepare(env: dict[str, str] | os._Environ[str] | None = None) -> None:
    """Set OPENMP_DEFAULTS in `env` (default os.environ) where the user has not set them."""
    env = os.environ if env is None else env
    for name, value in OPENMP_DEFAULTS.items():
        env.setdefault(name, value)
