"""What a pipeserve process sets in its environment before torch loads: how long OpenMP threads spin.

torch's intra-op threads and the native kernels' (kernels/pipeserve_kernels/native) are libgomp's.
A thread that reaches a barrier or ends a parallel region spins for the next one, 300,000 rounds by
default (about a millisecond), then sleeps. On a machine with a core per thread and nothing else to
run that is right; pipeserve shares its cores with the router, the engine thread, the ring and gRPC:
- spinning that long, an idle worker holds a core between decode steps, when the router must stream
  the last token and the engine plan the next: one stream on 2 vCPUs made 50-59 tok/s;
- sleeping at once (OMP_WAIT_POLICY=PASSIVE) pays a futex wake-up per parallel region, 150 of them
  in a decode step: 12 ms per step instead of 6 on an idle machine;
- spinning 1000 rounds (a few microseconds, longer than the gaps between a step's regions) then
  sleeping keeps the step's own speed and gives the core back between steps: 86-90 tok/s; C=16
  160-200 tok/s against 123-179 spinning long; and beside a busy core a 128-token prefill took
  0.32 s against 0.58 s (and 4.5 s of TTFT behind a compiler job) spinning long.
Measured on 2 vCPUs of an AMD EPYC (AVX-512 VNNI), benchmarks/RESULTS.md issue 27.

libgomp reads the variables once, when torch loads it, so `prepare()` runs first thing in the CLI
(before any subcommand imports torch); child processes (`pipeserve up`'s stages) inherit them. A
wait policy or spin count the user exported wins.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

SPIN_COUNT = "1000"


def prepare(env: MutableMapping[str, str] | None = None) -> None:
    """Set GOMP_SPINCOUNT in `env` (default os.environ) unless the user chose a wait policy or count."""
    env = os.environ if env is None else env
    if "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env:
        env["GOMP_SPINCOUNT"] = SPIN_COUNT
