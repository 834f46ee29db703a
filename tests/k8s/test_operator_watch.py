"""The operator watches instead of polling (issue 31, point 3), against kmock in loop time.

* A Service deleted, a NetworkPolicy or a PodDisruptionBudget edited by hand: put back from the watch
  event, within a second, with the resync far away (600 s) and the pipeline settled (Ready: no timer
  re-checks it).
* Steady state: over several resyncs the operator makes no request per pipeline (everything is read
  from kopf's watch-fed indexes, and an unchanged status is not written): 1 and 4 pipelines cost the
  same, at most one request per pipeline per resync; over 5 quiet minutes no request at all (the
  emulator's watch bookmarks keep kopf from re-opening quiet streams).
* A watch replaying objects as they were (a re-open, a new listing) wakes no pipeline.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
from typing import Any

import kmock
import pytest
from k8s_support import (
    CR,
    NETPOL,
    NS,
    PDB,
    SVC,
    SimulatedStatefulSetController,
    eventually,
    live,
    pipeline,
    running,
)
from test_operator import operator

from pipeserve_operator import handlers, indexes

pytestmark = [pytest.mark.asyncio, pytest.mark.looptime]


def _ready(k: kmock.KubernetesEmulator, name: str) -> bool:
    conditions = (k.objects[CR, NS, name].raw.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


@contextlib.asynccontextmanager
async def settled(k: kmock.KubernetesEmulator, names: list[str], resync_s: float, replicas: int = 2):
    """The operator (test_operator.operator: real handlers, --network-policies) over pipelines
    `names`, each Ready."""
    bodies = []
    for i, name in enumerate(names):
        body = pipeline(replicas=replicas, stages=1)
        body["metadata"].update(name=name, uid=f"uid-{i}")
        bodies.append(body)
    for body in bodies[1:]:
        k.objects[CR, NS, body["metadata"]["name"]] = body
    controller = SimulatedStatefulSetController(k, period_s=0.2)
    async with operator(k, bodies[0], resync_s=resync_s), running(controller.run()):
        # Wall time: a write storm (the status mutant) keeps the loop busy, and loop time would crawl.
        await eventually(lambda: all(_ready(k, n) for n in names), timeout=120, wall=True)
        await asyncio.sleep(1)  # the last writes' watch events go by
        yield


def _since(k: kmock.KubernetesEmulator, start: int) -> collections.Counter[str]:
    """The requests since `start`, by verb (a watch is a GET with ?watch: one long-lived stream)."""
    out: collections.Counter[str] = collections.Counter()
    for r in list(k._requests)[start:]:
        method = str(r.method.value).upper()
        if method == "GET":
            out["watch" if r.params.get("watch") else "get" if r.name else "list"] += 1
        else:
            out[method.lower()] += 1
    return out


async def _recreated(check: Any) -> float:
    loop = asyncio.get_running_loop()
    start = loop.time()
    await eventually(check, timeout=1.0, step=0.05)
    return loop.time() - start


async def test_a_deleted_service_comes_back_from_its_watch_event(kmock: kmock.KubernetesEmulator) -> None:
    async with settled(kmock, ["p"], resync_s=600):
        uid = live(kmock, SVC)["p-g1"]["metadata"]["uid"]
        kmock.objects[SVC, NS, "p-g1"].delete()  # the API server's watch sends DELETED
        await asyncio.sleep(0)
        assert "p-g1" not in live(kmock, SVC)
        assert await _recreated(lambda: "p-g1" in live(kmock, SVC)) < 1.0
        assert live(kmock, SVC)["p-g1"]["metadata"]["uid"] != uid  # created again, not a stale copy


async def test_hand_edits_of_a_network_policy_and_a_pdb_are_reverted(kmock: kmock.KubernetesEmulator) -> None:
    async with settled(kmock, ["p"], resync_s=600):
        rendered = live(kmock, NETPOL)["p-g0"]["spec"]
        kmock.objects[NETPOL, NS, "p-g0"].patch({"spec": {"ingress": [{}]}})  # allow everything
        await asyncio.sleep(0)
        assert live(kmock, NETPOL)["p-g0"]["spec"]["ingress"] == [{}]
        assert await _recreated(lambda: live(kmock, NETPOL)["p-g0"]["spec"] == rendered) < 1.0

        kmock.objects[PDB, NS, "p"].patch({"spec": {"maxUnavailable": 2}})
        await asyncio.sleep(0)
        assert await _recreated(lambda: live(kmock, PDB)["p"]["spec"]["maxUnavailable"] == 1) < 1.0
        assert _ready(kmock, "p")


async def _steady(
    k: kmock.KubernetesEmulator, pipelines: int, resyncs: int, resync_s: float
) -> dict[str, int]:
    """The requests over `resyncs` resyncs; it stops early past the goal (pipelines x resyncs): a
    write storm keeps the loop busy, and loop time would then crawl."""
    async with settled(k, [f"p{i}" for i in range(pipelines)], resync_s=resync_s):
        loop = asyncio.get_running_loop()
        start, end = len(k._requests), loop.time() + resyncs * resync_s + 1
        while loop.time() < end and sum(_since(k, start).values()) <= pipelines * resyncs:
            await asyncio.sleep(0.5)
        return dict(_since(k, start))


async def test_steady_state_requests_do_not_grow_with_pipelines(kmock: kmock.KubernetesEmulator) -> None:
    resyncs, resync_s = 3, 10.0
    one = await _steady(kmock, 1, resyncs, resync_s)
    assert sum(one.values()) <= resyncs, one
    async with kmock_server() as other:
        four = await _steady(other, 4, resyncs, resync_s)
    assert sum(four.values()) <= sum(one.values()), (one, four)  # not per pipeline: none at all
    assert sum(four.values()) <= 4 * resyncs, four


@contextlib.asynccontextmanager
async def kmock_server():
    """A second emulator in the same test (the fixture gives one): same class, its own port."""
    from kmock_support import ApiServer

    async with ApiServer() as k, kmock.Server(k):
        yield k


async def test_a_replayed_watch_wakes_no_pipeline(
    kmock: kmock.KubernetesEmulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A re-opened watch (or kopf's new listing after a 410 Gone) delivers every object again as ADDED:
    the objects are as they were, so no pipeline is woken (at 50 x 4 one replay of the pods woke all 50
    and a deleted Service waited behind them); a changed object still wakes its pipeline."""
    woken: list[tuple[str, str]] = []
    wake = indexes.Wakeups.wake
    monkeypatch.setattr(indexes.Wakeups, "wake", lambda self, key: (woken.append(key), wake(self, key)))
    async with settled(kmock, ["p0", "p1"], resync_s=600):
        woken.clear()
        replayed = 0
        for (res, _, _), obj in list(kmock.objects.items()):
            if not obj.deleted:
                await kmock._buses[res].put({"type": "ADDED", "object": copy.deepcopy(obj.raw)})
                replayed += 1
        await asyncio.sleep(1)
        assert replayed > 10 and woken == [], woken
        kmock.objects[NETPOL, NS, "p1-g0"].patch({"spec": {"ingress": [{}]}})  # a change still wakes
        await eventually(lambda: ("ml", "p1") in woken, timeout=1.0, step=0.05)


async def test_quiet_watch_streams_stay_open(kmock: kmock.KubernetesEmulator) -> None:
    """kopf re-opens a watch stream that said nothing for 70 s; the emulator's bookmarks (as the API
    server's, at least once a minute) keep the quiet ones (PodGroups, PDBs, a settled fleet) open: a
    settled operator makes no request at all for minutes, watches included."""
    async with settled(kmock, ["p"], resync_s=600):
        start = len(kmock._requests)
        await asyncio.sleep(300)
        assert dict(_since(kmock, start)) == {}


async def test_a_pipeline_woken_during_a_resync_goes_next(
    kmock: kmock.KubernetesEmulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resync reconciles every pipeline, one after another; one woken meanwhile (its Service deleted)
    goes next, not after the whole batch (at 50 pipelines the batch is seconds long)."""
    order: list[str] = []
    real = handlers.tick

    async def spy(memo: Any, body: dict, status: dict) -> Any:
        name = body["metadata"]["name"]
        order.append(name)
        if order == ["p0"]:  # the first of a resync's batch: p3 is woken while it runs
            memo.wakes.wake((NS, "p3"))
        return await real(memo, body, status)

    names = [f"p{i}" for i in range(5)]
    async with settled(kmock, names, resync_s=20, replicas=1):
        await asyncio.sleep(21)  # past the settling pipelines' last resync
        loop = asyncio.get_running_loop()
        monkeypatch.setattr(handlers, "tick", spy)
        end = loop.time() + 25
        while loop.time() < end and len(order) < 5:
            await asyncio.sleep(0.5)
    assert order[:5] == ["p0", "p3", "p1", "p2", "p4"], order  # p3 once, taken out of its turn
