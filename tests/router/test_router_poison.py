"""Poison requests through the router, against two live single-stage groups.

* A request that fails on a stage (the `fail_token` fault hook) is a 500 for that
  request only: not retried, and both groups stay in routing (only UNAVAILABLE
  takes a group out).
* A request that kills its group (the `crash_token` hook) is never carried to a
  second group (DESIGN §2.5): the client gets an error, exactly one group dies.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from pipeserve.config import EngineConfig
from pipeserve.rpc.metadata import ADMITTED_KEY
from pipeserve.supervisor.group import GroupSlot
from router_support import RouterHarness
from serving_support import generate, greedy_request, live_slots, metric, stub, wait_until

pytestmark = pytest.mark.slow
FAIL, CRASH = 777, 778


@pytest.fixture
def slots(llama_dir: Path, tmp_path: Path) -> Iterator[dict[str, GroupSlot]]:
    config = EngineConfig(model=str(llama_dir), num_threads=1, num_kv_blocks=128, log_dir=str(tmp_path))
    saved = os.environ.get("PIPESERVE_FAULTS")
    os.environ["PIPESERVE_FAULTS"] = json.dumps({"fail_token": FAIL, "crash_token": CRASH})
    try:
        with live_slots(config) as slots:
            yield slots
    finally:
        if saved is None:
            os.environ.pop("PIPESERVE_FAULTS", None)
        else:
            os.environ["PIPESERVE_FAULTS"] = saved


@pytest.fixture
def router(llama_dir: Path, slots: dict[str, GroupSlot]) -> Iterator[RouterHarness]:
    targets = {name: s.grpc_target for name, s in slots.items()}
    with RouterHarness(llama_dir, targets, health_interval_s=3600) as h:  # polls only when a test asks
        yield h


def _complete(router: RouterHarness, prompt: list[int]) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    return httpx.post(router.url + "/v1/completions", json=body, timeout=60)


def _retries(router: RouterHarness) -> float:
    return metric(httpx.get(router.url + "/metrics").text, "pipeserve:router_retries_total") or 0.0


def test_a_failing_request_is_its_own_failure(router: RouterHarness, slots: dict[str, GroupSlot]) -> None:
    for _ in range(2):  # round robin: once on each group
        r = _complete(router, [5, FAIL, 9])
        assert r.status_code == 500, r.text
        assert "request failed" in r.json()["error"]["message"]
    assert len(router.call(router.replicas.ready_groups)) == 2
    assert _retries(router) == 0
    assert all(r.status_code == 200 for r in (_complete(router, [5, 6, 9]) for _ in range(2)))
    assert not any(s.group_exited() for s in slots.values())


def test_a_request_that_kills_its_group_is_not_carried_to_another(
    router: RouterHarness, slots: dict[str, GroupSlot]
) -> None:
    r = _complete(router, [5, CRASH, 9])
    assert r.status_code in (500, 503), r.text
    wait_until(lambda: any(s.group_exited() for s in slots.values()), 30, "the poisoned group to exit")
    dead = [n for n, s in slots.items() if s.group_exited()]
    assert len(dead) == 1, f"the poison reached {dead}"
    assert _retries(router) == 0
    alive = next(n for n in slots if n not in dead)
    router.poll()
    assert [g.name for g in router.call(router.replicas.ready_groups)] == [alive]
    assert _complete(router, [5, 6, 9]).status_code == 200


def test_a_call_whose_group_died_says_so_in_its_status(slots: dict[str, GroupSlot]) -> None:
    """The admitted marker rides on the failed call's status too (stage/server.py): a router that
    reads the status without the initial metadata still does not carry the poison elsewhere."""
    slot = next(iter(slots.values()))
    with pytest.raises(grpc.RpcError) as e:
        generate(stub(slot.grpc_target), greedy_request("poison-status", [5, CRASH, 9], 4, ignore_eos=True))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
    assert ADMITTED_KEY in dict(e.value.trailing_metadata() or ()), e.value.trailing_metadata()
