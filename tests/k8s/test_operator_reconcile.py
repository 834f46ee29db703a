"""The operator's reconcile loop against kmock (which honours finalizers: a DELETE of an object with
finalizers only sets its deletionTimestamp), in loop time: no finalizer of ours, owned objects come
back every tick, status users can wait on, rolls that follow the user's spec (a surge group for one
replica), the PodDisruptionBudget and Volcano PodGroups, and forcing pods stuck on a lost node."""

from __future__ import annotations

import asyncio

import kmock
import pytest
from k8s_support import (
    CR,
    NETPOL,
    NODES,
    NS,
    PDB,
    PODGROUPS,
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
    pod_from,
    running,
)
from test_operator import cr, group_ready, groups, operator

from pipeserve_operator import resources
from pipeserve_operator.groups import rfc3339
from pipeserve_operator.handlers import TICK_S
from pipeserve_operator.kube import api_client
from pipeserve_operator.supervise import LEGACY_FINALIZER

pytestmark = [pytest.mark.asyncio, pytest.mark.looptime]


def condition(k: kmock.KubernetesEmulator, kind: str = "Ready") -> dict:
    return next((c for c in (cr(k).get("status") or {}).get("conditions") or [] if c["type"] == kind), {})


def images(k: kmock.KubernetesEmulator) -> set[str]:
    return {p["spec"]["containers"][0]["image"] for p in live(k, PODS).values()}


def bump(k: kmock.KubernetesEmulator, spec: dict) -> None:
    """What the API server does on a spec change: the new spec and metadata.generation + 1."""
    generation = cr(k)["metadata"]["generation"] + 1
    k.objects[CR, NS, "p"].patch({"spec": spec, "metadata": {"generation": generation}})


async def test_no_finalizer_and_the_old_one_is_removed(kmock: kmock.KubernetesEmulator) -> None:
    body = pipeline()
    body["metadata"]["finalizers"] = [LEGACY_FINALIZER]
    seen: list[list] = []

    async def watch() -> None:
        while True:
            seen.append(list(cr(kmock)["metadata"].get("finalizers") or []))
            await asyncio.sleep(0.1)

    async with operator(kmock, body):
        await eventually(lambda: not cr(kmock)["metadata"].get("finalizers"))
        async with running(watch()):
            await asyncio.sleep(10)  # several ticks
            bump(kmock, {"image": "pipeserve/stage:v2"})
            await asyncio.sleep(10)
    assert seen and not any(seen), [s for s in seen if s][:3]


async def test_a_delete_without_an_operator_is_immediate(kmock: kmock.KubernetesEmulator) -> None:
    import kubernetes

    declare_resources(kmock)
    api = kubernetes.client.CustomObjectsApi(api_client(str(kmock.url)))
    kmock.objects[CR, NS, "p"] = pipeline()
    await asyncio.to_thread(
        api.delete_namespaced_custom_object, "pipeserve.io", "v1alpha1", NS, "inferencepipelines", "p"
    )
    assert kmock.objects[CR, NS, "p"].deleted
    # The emulator honours finalizers: the marker an older operator left would have blocked it.
    old = pipeline()
    old["metadata"].update(name="q", finalizers=[LEGACY_FINALIZER])
    kmock.objects[CR, NS, "q"] = old
    await asyncio.to_thread(
        api.delete_namespaced_custom_object, "pipeserve.io", "v1alpha1", NS, "inferencepipelines", "q"
    )
    stuck = kmock.objects[CR, NS, "q"]
    assert not stuck.deleted and stuck.raw["metadata"]["deletionTimestamp"]


async def test_ready_waits_for_the_generation_and_the_rollout(kmock: kmock.KubernetesEmulator) -> None:
    controller = SimulatedStatefulSetController(kmock, period_s=0.2)
    early: list[dict] = []

    async def watch() -> None:
        while True:
            c, gen = condition(kmock), cr(kmock)["metadata"]["generation"]
            status = cr(kmock).get("status") or {}
            if c.get("status") == "True" and c.get("observedGeneration") == gen and gen > 1:
                if images(kmock) != {"pipeserve/stage:v2"} or status.get("updatedReplicas") != 2:
                    early.append({"images": images(kmock), "status": status})
            await asyncio.sleep(0.05)

    async with operator(kmock, pipeline(replicas=2)), running(controller.run()), running(watch()):
        await eventually(lambda: condition(kmock).get("status") == "True")
        status = cr(kmock)["status"]
        assert status["observedGeneration"] == 1 and status["updatedReplicas"] == status["readyReplicas"] == 2
        bump(kmock, {"image": "pipeserve/stage:v2"})
        await eventually(lambda: condition(kmock).get("status") == "False", step=0.05)
        await eventually(
            lambda: condition(kmock).get("observedGeneration") == 2 and condition(kmock)["status"] == "True",
            timeout=120,
        )
        assert cr(kmock)["status"]["observedGeneration"] == 2
        assert images(kmock) == {"pipeserve/stage:v2"}
    assert not early, early[:2]


async def test_ready_is_false_while_a_ready_group_runs_an_older_spec(kmock: kmock.KubernetesEmulator) -> None:
    # A group that turns Ready on pods of the previous spec is counted ready but not updated (it rolls
    # on the next tick): Ready must stay False for generation 2 all along.
    body = pipeline(stages=1)
    body["spec"]["rollout"] = {"maxSurge": 0}
    async with operator(kmock, body):
        await eventually(lambda: "p-g0" in live(kmock, STS) and groups(kmock))
        kmock.objects[PODS, NS, "p-g0-0"] = pod_from(live(kmock, STS)["p-g0"], 0, ready=False)
        bump(kmock, {"image": "pipeserve/stage:v2"})
        await eventually(lambda: cr(kmock)["status"].get("observedGeneration") == 2)
        kmock.objects[PODS, NS, "p-g0-0"].patch(
            {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}
        )
        await eventually(lambda: deletions(kmock, "p-g0-0") == 1)  # rolled: it ran the old image
        await asyncio.sleep(2)
    # Every version the API server stored (a status may last no loop time at all: the next watch
    # event reconciles at once, so sampling could miss it).
    snapshots = [
        {**(v.get("status") or {}), "gen": v["metadata"]["generation"]}
        for v in kmock.objects[CR, NS, "p"].history
        if v is not None
    ]
    seen = [(s.get("readyReplicas"), s.get("updatedReplicas")) for s in snapshots if s["gen"] == 2]
    assert (1, 0) in seen  # the case under test happened: Ready, not updated
    ready = [
        s
        for s in snapshots
        if s["gen"] == 2
        and any(c["type"] == "Ready" and c["status"] == "True" for c in s.get("conditions", []))
    ]
    assert not ready, ready[:2]


async def test_an_invalid_spec_is_not_observed(kmock: kmock.KubernetesEmulator) -> None:
    # Nothing of generation 2 can be ensured: observedGeneration stays 1, Degraded says why.
    async with operator(kmock, pipeline()):
        await eventually(lambda: (cr(kmock).get("status") or {}).get("observedGeneration") == 1)
        bump(kmock, {"engine": {"no-such-flag": 1}})
        await eventually(lambda: condition(kmock, "Degraded").get("status") == "True")
        await asyncio.sleep(5)
        assert cr(kmock)["status"]["observedGeneration"] == 1 and condition(kmock)["status"] == "False"
        assert "no-such-flag" in condition(kmock, "Degraded")["message"]


async def test_owned_objects_come_back_and_drift_is_patched(kmock: kmock.KubernetesEmulator) -> None:
    controller = SimulatedStatefulSetController(kmock, period_s=0.2)
    async with operator(kmock, pipeline()), running(controller.run()):
        await eventually(lambda: group_ready(kmock))
        owned = ((STS, "p-g0"), (SVC, "p-g0"), (NETPOL, "p-g0"), (PDB, "p"))
        for res, name in owned:
            kmock.objects[res, NS, name].delete()
        # Back within one tick.
        await eventually(lambda: all(n in live(kmock, r) for r, n in owned), timeout=TICK_S + 0.5, step=0.1)
        sts = kmock.objects[STS, NS, "p-g0"]
        sts.patch({"spec": {"template": {"spec": {"containers": [{"name": "stage", "image": "evil:1"}]}}}})
        await eventually(
            lambda: (
                live(kmock, STS)["p-g0"]["spec"]["template"]["spec"]["containers"][0]["image"]
                == "pipeserve/stage:test"
            ),
            timeout=TICK_S + 0.5,
            step=0.1,
        )
        container = live(kmock, STS)["p-g0"]["spec"]["template"]["spec"]["containers"][0]
        assert container["args"] and container["readinessProbe"]  # the whole container came back


async def test_a_rendering_change_rolls_no_group(
    kmock: kmock.KubernetesEmulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    controller = SimulatedStatefulSetController(kmock, period_s=0.2)
    async with operator(kmock, pipeline(replicas=2)), running(controller.run()):
        await eventually(lambda: group_ready(kmock, 0) and group_ready(kmock, 1))
        monkeypatch.setattr(resources, "STARTUP_PERIOD_S", 7)  # what a new operator version renders
        probe = lambda: live(kmock, STS)["p-g1"]["spec"]["template"]["spec"]["containers"][0]["startupProbe"]  # noqa: E731
        # A new operator version reconciles every pipeline as it starts; the running one takes the new
        # rendering at its next resync (no watch event says the rendering changed).
        await eventually(lambda: probe()["periodSeconds"] == 7, timeout=70)
        await asyncio.sleep(20)
        assert [deletions(kmock, f"p-g{g}-{r}") for g in (0, 1) for r in (0, 1)] == [0, 0, 0, 0]
        assert condition(kmock)["status"] == "True"


async def test_one_replica_rolls_through_a_surge_group(kmock: kmock.KubernetesEmulator) -> None:
    controller = SimulatedStatefulSetController(kmock, period_s=0.2)
    watching, gaps, surged = [False], [], []

    async def watch() -> None:
        while True:
            gs = groups(kmock)
            surged.extend(g for g in gs if g["index"] == 1)
            if watching[0] and not any(g["ready"] for g in gs):
                gaps.append(gs)
            await asyncio.sleep(0.05)

    async with operator(kmock, pipeline(replicas=1)), running(controller.run()), running(watch()):
        await eventually(lambda: group_ready(kmock))
        watching[0] = True
        bump(kmock, {"image": "pipeserve/stage:v2"})
        await eventually(lambda: deletions(kmock, "p-g0-0") == 1, timeout=120)
        await eventually(lambda: set(live(kmock, STS)) == {"p-g0"} and group_ready(kmock), timeout=120)
        assert images(kmock) == {"pipeserve/stage:v2"} and [g["index"] for g in groups(kmock)] == [0]
        await eventually(lambda: condition(kmock)["status"] == "True", timeout=5)
    assert surged, "no surge group was started"
    assert not gaps, gaps[:2]


async def test_pdb_and_volcano_pod_groups(kmock: kmock.KubernetesEmulator) -> None:
    body = pipeline(replicas=2)
    body["spec"]["placement"] = {"gang": "volcano"}
    body["spec"]["resources"] = {"requests": {"cpu": "1500m", "memory": "1Gi", "nvidia.com/gpu": "1"}}
    async with operator(kmock, body):
        await eventually(lambda: "p" in live(kmock, PDB) and set(live(kmock, PODGROUPS)) == {"p-g0", "p-g1"})
        pdb = live(kmock, PDB)["p"]
        assert (
            pdb["spec"]["maxUnavailable"] == 1 and pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
        )
        assert pdb["spec"]["selector"]["matchLabels"] == resources.pipeline_selector(body)
        assert pdb["metadata"]["ownerReferences"][0]["uid"] == UID
        group = live(kmock, PODGROUPS)["p-g1"]
        assert group["spec"] == {
            "minMember": 2,
            "minResources": {"cpu": "3", "memory": "2147483648", "nvidia.com/gpu": "2"},
        }
        assert group["metadata"]["ownerReferences"][0]["uid"] == UID
        bump(kmock, {"replicas": 1})
        await eventually(
            lambda: set(live(kmock, PODGROUPS)) == {"p-g0"} and set(live(kmock, STS)) == {"p-g0"}
        )


async def test_volcano_gang_without_volcano_is_degraded(kmock: kmock.KubernetesEmulator) -> None:
    async with operator(kmock, pipeline()):
        await eventually(lambda: (cr(kmock).get("status") or {}).get("observedGeneration") == 1)
        del kmock.resources[PODGROUPS]  # no Volcano in this cluster
        bump(kmock, {"placement": {"gang": "volcano"}})
        await eventually(lambda: condition(kmock, "Degraded").get("reason") == "PodGroupsUnavailable")
        assert cr(kmock)["status"]["observedGeneration"] == 1 and condition(kmock)["status"] == "False"
        assert [g["index"] for g in groups(kmock)] == [0]  # the group is still supervised


async def test_pods_stuck_on_a_lost_node_are_forced(kmock: kmock.KubernetesEmulator) -> None:
    # Group 2's pod holds Kueue's finalizer (placement.gang kueue): a forced delete could not remove it;
    # it is left alone, with one StuckPod Event naming the finalizer and the remedy.
    body = pipeline(replicas=3, stages=1)
    body["spec"]["placement"] = {"gang": "kueue", "queueName": "q"}
    async with operator(kmock, body):
        await eventually(lambda: {"p-g0", "p-g1", "p-g2"} <= set(live(kmock, STS)))
        kmock.objects[NODES, None, "lost"] = {
            "metadata": {"name": "lost"},
            "status": {"conditions": [{"type": "Ready", "status": "Unknown"}]},
        }
        kmock.objects[NODES, None, "fine"] = {
            "metadata": {"name": "fine"},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]},
        }
        long_ago = rfc3339(asyncio.get_running_loop().time() - 100)
        for group, node in ((0, "lost"), (1, "fine"), (2, "lost")):
            pod = pod_from(live(kmock, STS)[f"p-g{group}"], 0)
            pod["metadata"].update(
                uid=f"uid-{group}", deletionTimestamp=long_ago, deletionGracePeriodSeconds=30
            )
            if group == 2:
                pod["metadata"]["finalizers"] = ["kueue.x-k8s.io/managed"]
            pod["spec"]["nodeName"] = node
            kmock.objects[PODS, NS, f"p-g{group}-0"] = pod
        await eventually(lambda: (cr(kmock).get("status") or {}).get("forcedDeletions") == 1)
        await asyncio.sleep(10)
        assert deletions(kmock, "p-g0-0") == 1 and "p-g0-0" not in live(kmock, PODS)
        assert deletions(kmock, "p-g1-0") == 0 and "p-g1-0" in live(kmock, PODS)  # its node will finish it
        assert cr(kmock)["status"]["forcedDeletions"] == 1
        events = [e for e in live(kmock, "v1/events").values() if e.get("reason") == "ForcedDeletion"]
        assert len(events) == 1 and "lost" in events[0]["message"]
        assert deletions(kmock, "p-g2-0") == 0 and "p-g2-0" in live(kmock, PODS)
        held = [e for e in live(kmock, "v1/events").values() if e.get("reason") == "StuckPod"]
        assert len(held) == 1 and "kueue.x-k8s.io/managed" in held[0]["message"], held
