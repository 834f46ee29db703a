"""The operator (kopf, real handlers) against kmock's KubernetesEmulator, in loop time (looptime).

A CR ⇒ per-group StatefulSets (Parallel, OnDelete, replicas = stages) and headless Services with
owner references; scale 1 → 3 → 1 through spec.replicas (what the scale subresource writes); one
pod's container restart ⇒ every pod of the group deleted exactly once, the template's generation
bumped, status.restarts and a GroupRestart Event; a StatefulSet controller that recreates pods from
a stale template neither causes a second restart nor gets a mixed group counted ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

import kmock
import kopf
import kubernetes_validate
import pytest
from k8s_support import (
    CR,
    NETPOL,
    NS,
    PODS,
    STS,
    SVC,
    UID,
    SimulatedStatefulSetController,
    declare_resources,
    deletions,
    eventually,
    live,
    pipeline,
    running,
)

from pipeserve_operator.kube import Kube, api_client
from pipeserve_operator.main import make_memo
from pipeserve_operator.resources import GROUP_LABEL, PIPELINE_LABEL

pytestmark = [pytest.mark.asyncio, pytest.mark.looptime]
GEN = "pipeserve.io/group-generation"


@contextlib.asynccontextmanager
async def operator(k: kmock.KubernetesEmulator, body: dict, resync_s: float = 60.0):
    """`body` is stored as pipeline "p" unless it names itself otherwise. Every test logs in through
    this one function: kopf keeps a login handler per id (its qualified name), so another helper's
    would stay registered with an earlier test's (stopped) server and be picked at random."""
    declare_resources(k)
    k.objects[CR, NS, body["metadata"]["name"]] = body
    url = str(k.url)

    @kopf.on.login()
    def login(**_: object) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=url, insecure=True)

    memo = make_memo(Kube(api_client(url)), drain_s=5.0, network_policies=True, resync_s=resync_s)
    memo.clock = asyncio.get_running_loop().time  # backoffs and deadlines in loop time
    stop = asyncio.Event()
    task = asyncio.create_task(kopf.operator(standalone=True, namespaces=[NS], memo=memo, stop_flag=stop))
    watchdog = RealTimeBound(asyncio.current_task(), REAL_LIMIT_S)
    try:
        yield
    except asyncio.CancelledError:
        if watchdog.fired:
            raise AssertionError(f"past {REAL_LIMIT_S} s of real time: the operator never idled") from None
        raise
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        watchdog.disarm()


# A real-time bound on every operator test. Loop time (looptime) moves only while every task idles:
# an operator that never idles (a write retried without a backoff, a delete that wakes the next pass)
# freezes the clock, so `eventually` and wait_for would wait forever; pytest-timeout's exception is
# kept by the asyncio task it lands in. The bound cancels the test's task instead, again every few
# seconds until the operator has stopped.
REAL_LIMIT_S = 120.0


class RealTimeBound:
    def __init__(self, task: asyncio.Task | None, limit_s: float) -> None:
        self.fired = False
        self._task, self._loop = task, asyncio.get_running_loop()
        self._done = threading.Event()
        threading.Thread(target=self._watch, args=(limit_s,), daemon=True).start()

    def _watch(self, limit_s: float) -> None:
        while not self._done.wait(limit_s) and self._task is not None:
            self.fired, limit_s = True, 5.0
            self._loop.call_soon_threadsafe(self._task.cancel)

    def disarm(self) -> None:
        self._done.set()


def cr(k: kmock.KubernetesEmulator) -> dict:
    return k.objects[CR, NS, "p"].raw


def groups(k: kmock.KubernetesEmulator) -> list[dict]:
    return (cr(k).get("status") or {}).get("groups") or []


def group_ready(k: kmock.KubernetesEmulator, index: int = 0) -> bool:
    return any(g["index"] == index and g["ready"] for g in groups(k))


async def test_cr_creates_groups_and_scales(kmock: kmock.KubernetesEmulator) -> None:
    async with operator(kmock, pipeline(replicas=1)):
        await eventually(lambda: "p-g0" in live(kmock, STS) and "p-g0" in live(kmock, SVC))
        sts = live(kmock, STS)["p-g0"]
        assert sts["spec"]["podManagementPolicy"] == "Parallel"
        assert sts["spec"]["updateStrategy"] == {"type": "OnDelete"}
        assert sts["spec"]["replicas"] == 2
        assert sts["metadata"]["ownerReferences"][0]["uid"] == UID
        pod = sts["spec"]["template"]
        assert pod["metadata"]["labels"][GEN] == "1"
        env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
        assert env["MASTER_ADDR"]["value"] == "p-g0-0.p-g0.ml.svc"
        assert env["PIPESERVE_WORLD_SIZE"]["value"] == "2"
        assert env["PIPESERVE_HICACHE_URL"]["valueFrom"]["secretKeyRef"] == {"name": "redis", "key": "url"}
        assert env["NCCL_SOCKET_IFNAME"]["value"] == "eth0"
        args = pod["spec"]["containers"][0]["args"]
        assert args[args.index("--max-num-seqs") + 1] == "8"
        svc = live(kmock, SVC)["p-g0"]
        assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
        assert svc["metadata"]["ownerReferences"][0]["uid"] == UID
        # The group's own NetworkPolicy: ring traffic only from its pods, gRPC only from routers.
        await eventually(lambda: "p-g0" in live(kmock, NETPOL))
        policy = live(kmock, NETPOL)["p-g0"]
        kubernetes_validate.validate(policy, "1.35", strict=True)
        own = policy["spec"]["podSelector"]["matchLabels"]
        assert own[GROUP_LABEL] == "0" and own[PIPELINE_LABEL] == "p"
        ring, grpc, _health = policy["spec"]["ingress"]
        assert ring == {"from": [{"podSelector": {"matchLabels": own}}]}
        assert grpc["ports"] == [{"port": 50051, "protocol": "TCP"}]
        assert policy["metadata"]["ownerReferences"][0]["uid"] == UID

        kmock.objects[CR, NS, "p"].patch({"spec": {"replicas": 3}})  # what `kubectl scale` writes
        await eventually(lambda: set(live(kmock, STS)) == {"p-g0", "p-g1", "p-g2"})
        await eventually(lambda: [g["index"] for g in groups(kmock)] == [0, 1, 2])
        assert cr(kmock)["status"]["selector"].startswith("app.kubernetes.io/name=pipeserve")

        kmock.objects[CR, NS, "p"].patch({"spec": {"replicas": 1}})
        # Out of routing (status) first, the objects only after the drain period.
        await eventually(lambda: [g["index"] for g in groups(kmock)] == [0], step=0.1, timeout=30, wall=True)
        assert "p-g2" in live(kmock, STS)

        # A removed group's objects go one call after another (StatefulSet, Service, NetworkPolicy).
        def only_g0() -> bool:
            return set(live(kmock, STS)) == set(live(kmock, SVC)) == set(live(kmock, NETPOL)) == {"p-g0"}

        await eventually(only_g0, timeout=30, wall=True)


async def test_restart_deletes_the_whole_group_once(kmock: kmock.KubernetesEmulator) -> None:
    controller = SimulatedStatefulSetController(kmock)
    async with operator(kmock, pipeline()), running(controller.run()):
        await eventually(lambda: group_ready(kmock))
        kmock.objects[PODS, NS, "p-g0-1"].patch(
            {"status": {"containerStatuses": [{"name": "stage", "restartCount": 1, "lastState": {}}]}}
        )
        await eventually(lambda: deletions(kmock, "p-g0-0") >= 1 and deletions(kmock, "p-g0-1") >= 1)
        await eventually(lambda: group_ready(kmock))
        await asyncio.sleep(10)
        assert deletions(kmock, "p-g0-0") == 1 and deletions(kmock, "p-g0-1") == 1
        assert live(kmock, STS)["p-g0"]["spec"]["template"]["metadata"]["labels"][GEN] == "2"
        assert {p["metadata"]["labels"][GEN] for p in live(kmock, PODS).values()} == {"2"}
        status = cr(kmock)["status"]
        assert status["restarts"] == 1 and status["groups"][0]["restarts"] == 1
        assert "stage 1" in status["groups"][0]["lastFailure"]
        events = [e for e in live(kmock, "v1/events").values() if e.get("reason") == "GroupRestart"]
        assert len(events) == 1 and "stage 1" in events[0]["message"]


async def test_stale_recreation_neither_restarts_nor_counts_ready(kmock: kmock.KubernetesEmulator) -> None:
    controller = SimulatedStatefulSetController(kmock, period_s=0.2)
    mixed: list[dict] = []

    async def watch_readiness() -> None:
        while True:
            for g in groups(kmock):
                pods = [p for n, p in live(kmock, PODS).items() if n.startswith(f"p-g{g['index']}-")]
                if g["ready"] and any(p["metadata"]["labels"][GEN] != str(g["generation"]) for p in pods):
                    mixed.append({"group": g, "pods": [p["metadata"]["labels"] for p in pods]})
            await asyncio.sleep(0.05)

    async with operator(kmock, pipeline()), running(controller.run()), running(watch_readiness()):
        await eventually(lambda: group_ready(kmock))
        controller.stale_template = True  # from now on it recreates pods from the generation-1 template
        kmock.objects[PODS, NS, "p-g0-0"].patch(
            {"status": {"containerStatuses": [{"name": "stage", "restartCount": 1, "lastState": {}}]}}
        )
        await eventually(lambda: cr(kmock)["status"]["restarts"] == 1)
        await asyncio.sleep(15)  # stale pods come back and are deleted again, several times
        assert not group_ready(kmock) and cr(kmock)["status"]["readyReplicas"] == 0
        assert deletions(kmock, "p-g0-0") >= 2  # the stale recreations were deleted
        controller.stale_template = False
        await eventually(lambda: group_ready(kmock))
        await asyncio.sleep(5)
        assert cr(kmock)["status"]["restarts"] == 1 and cr(kmock)["status"]["groups"][0]["generation"] == 2
        events = [e for e in live(kmock, "v1/events").values() if e.get("reason") == "GroupRestart"]
        assert len(events) == 1
    assert not mixed, mixed[:3]


async def test_a_spec_change_rolls_one_group_at_a_time(kmock: kmock.KubernetesEmulator) -> None:
    # `kubectl apply` of a new image: the StatefulSets never replace pods themselves (OnDelete), so the
    # operator restarts each group whole, one at a time, only while the other serves.
    controller = SimulatedStatefulSetController(kmock, period_s=0.2)
    watching, none_ready = [False], []

    async def watch_capacity() -> None:
        while True:
            gs = groups(kmock)
            if watching[0] and len(gs) == 2 and not any(g["ready"] for g in gs):
                none_ready.append(gs)
            await asyncio.sleep(0.05)

    def images() -> set[str]:
        return {p["spec"]["containers"][0]["image"] for p in live(kmock, PODS).values()}

    async with operator(kmock, pipeline(replicas=2)), running(controller.run()), running(watch_capacity()):
        await eventually(lambda: group_ready(kmock, 0) and group_ready(kmock, 1))
        watching[0] = True
        kmock.objects[CR, NS, "p"].patch({"spec": {"image": "pipeserve/stage:v2"}})
        await eventually(lambda: images() == {"pipeserve/stage:v2"}, timeout=120)
        await eventually(lambda: group_ready(kmock, 0) and group_ready(kmock, 1))
        await asyncio.sleep(10)  # nothing rolls twice
        assert [deletions(kmock, f"p-g{g}-{r}") for g in (0, 1) for r in (0, 1)] == [1, 1, 1, 1]
        status = cr(kmock)["status"]
        assert status["restarts"] == 0 and [g["generation"] for g in status["groups"]] == [2, 2]
        # kmock keeps objects made by `generateName` under one name, so only the first Event is stored
        # (the second gets 409 in the emulator): at least one, and no Warning (no restart was counted).
        events = list(live(kmock, "v1/events").values())
        assert [e["reason"] for e in events if e.get("reason") == "GroupRollout"]
        assert not [e for e in events if e.get("type") == "Warning"]
    assert not none_ready, none_ready[:2]
