"""The multi-host fault suite's fixture and marks: `pytestmark = FAULTS` in each module marks it
`faults` (and `slow`) and skips it, with the reason, where namespaces cannot be built (not root, no
`ip netns`).

Every process's log is kept per test; when a test fails (its start-up included), the tail of each
is printed under the failure (tests/conftest.py adds a fixture's `failure_report()` to the report).
Each test's row of the fault table (checker.Row) goes to <basetemp>/faults-table.jsonl: table.py
prints them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from checker import Table
from cluster import Cluster
from netns import unavailable_reason

_WHY = unavailable_reason()
# slow too: a group starts (10-40 s), a fault test takes 10-40 s, so `make test-fast` leaves them out
_SKIP = pytest.mark.skipif(_WHY is not None, reason=f"multi-host fault suite: {_WHY}")
FAULTS = [pytest.mark.faults, pytest.mark.slow, _SKIP]
_CLUSTER: Cluster | None = None


@pytest.fixture(scope="session", name="_faults_cluster")
def session_cluster(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A 2-stage group, its router and Redis, each on its own host, for the whole suite (a start
    takes 10-40 s, then stage 0's grammar workers warm beside the ready group); torn down at the end, and
    the teardown asserts nothing (namespace, link, process) is left."""
    global _CLUSTER
    if _CLUSTER is None:  # each module imports this fixture: one definition each, one cluster
        _CLUSTER = Cluster(llama_dir, tmp_path_factory.mktemp("faults") / "logs")
    try:
        yield _CLUSTER
    finally:
        if _CLUSTER is not None:
            c, _CLUSTER = _CLUSTER, None
            c.close()


@pytest.fixture(name="cluster")
def cluster_fixture(_faults_cluster: Cluster) -> Cluster:
    """The suite's cluster, every fault of the test before healed, ready (restarted if needed)."""
    try:
        _faults_cluster.reset()
    except Exception as e:  # noqa: BLE001 - any failure to start: with every process's log
        raise AssertionError(f"start-up failed: {e}\n{_faults_cluster.failure_report()}") from None
    return _faults_cluster


@pytest.fixture(name="table")
def table_fixture(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Table:
    """Where a test records its fault's row (see the module doc)."""
    return Table(tmp_path_factory.getbasetemp() / "faults-table.jsonl", request.node.name)
