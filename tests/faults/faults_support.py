"""The multi-host fault suite's fixture and marks: `pytestmark = FAULTS` in each module marks it
`faults` (and `slow`) and skips it, with the reason, where namespaces cannot be built (not root, no
`ip netns`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster import Cluster
from netns import unavailable_reason

_WHY = unavailable_reason()
# slow too: each test starts a group (10-60 s), so `make test-fast` leaves them out
_SKIP = pytest.mark.skipif(_WHY is not None, reason=f"multi-host fault suite: {_WHY}")
FAULTS = [pytest.mark.faults, pytest.mark.slow, _SKIP]


@pytest.fixture(name="cluster")
def cluster_fixture(llama_dir: Path, tmp_path: Path) -> Iterator[Cluster]:
    """A ready 2-stage group, its router and Redis, each on its own host; torn down afterwards, and
    the teardown asserts nothing (namespace, link, process) is left."""
    c = Cluster(llama_dir, tmp_path / "logs")
    try:
        c.wait_ready()
        yield c
    finally:
        c.close()
