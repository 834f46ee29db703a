"""compute_env: pipeserve's processes load OpenMP with a short spin unless the user chose.

Observed in libgomp itself (OMP_DISPLAY_ENV prints the values it took when torch loaded it): unset,
libgomp spins 300000 times; PASSIVE is 0; ACTIVE spins without end.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from pipeserve import compute_env


def test_prepare_sets_only_what_the_user_left_unset() -> None:
    env: dict[str, str] = {}
    compute_env.prepare(env)
    assert env == {"GOMP_SPINCOUNT": compute_env.SPIN_COUNT}
    for mine in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "5"}):
        before = dict(mine)
        compute_env.prepare(mine)
        assert mine == before


def _spin_count(tmp_path: Path, policy: str | None) -> int:
    """libgomp's spin count in a `pipeserve demo-model` process (it imports torch to write weights)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    env["OMP_DISPLAY_ENV"] = "verbose"
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy
    out = subprocess.run(
        [sys.executable, "-m", "pipeserve.cli", "demo-model", str(tmp_path / "m"), "--layers", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    found = re.search(r"GOMP_SPINCOUNT = '(\d+)'", out.stderr)
    if found is None:
        pytest.skip("this torch's OpenMP runtime is not libgomp (no GOMP_SPINCOUNT in its display)")
    return int(found.group(1))


def test_the_cli_loads_openmp_with_a_short_spin(tmp_path: Path) -> None:
    assert _spin_count(tmp_path, None) == int(compute_env.SPIN_COUNT)


@pytest.mark.parametrize(
    ("policy", "spins"), [("ACTIVE", lambda n: n > 300000), ("PASSIVE", lambda n: n == 0)]
)
def test_a_users_policy_wins(tmp_path: Path, policy: str, spins: Callable[[int], bool]) -> None:
    assert spins(_spin_count(tmp_path, policy))
