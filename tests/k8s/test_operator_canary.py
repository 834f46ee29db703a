"""Canary rollouts (spec.rollout.partition) against kmock, in loop time (issue 31, point 5).

A new image with partition 2 of 3 groups: only group 2 rolls; groups 0 and 1 keep the previous
rendering (their StatefulSets, and one recreated after a deletion) and their pods; every group stays
in status.groups, Ready (the router serves them all); `Ready` turns True for the new generation only
once group 2 runs the new spec, with updatedReplicas 1 and the two revisions in status. Partition 0
then rolls the rest, after which the current revision is the update revision.
"""

from __future__ import annotations

import asyncio

import kmock
import pytest
from k8s_support import (
    PODS,
    STS,
    SimulatedStatefulSetController,
    deletions,
    eventually,
    live,
    pipeline,
    running,
)
from test_operator import cr, groups, operator
from test_operator_reconcile import bump, condition

pytestmark = [pytest.mark.asyncio, pytest.mark.looptime]
V1, V2 = "pipeserve/stage:test", "pipeserve/stage:v2"


def image(obj: dict) -> str:
    spec = obj["spec"]["template"]["spec"] if obj["kind"] == "StatefulSet" else obj["spec"]
    return spec["containers"][0]["image"]


def sts_images(k: kmock.KubernetesEmulator) -> dict[str, str]:
    return {name: image(s) for name, s in sorted(live(k, STS).items())}


def pod_images(k: kmock.KubernetesEmulator) -> dict[str, str]:
    return {name: image(p) for name, p in sorted(live(k, PODS).items())}


def ready_for(k: kmock.KubernetesEmulator, generation: int) -> bool:
    c = condition(k)
    return c.get("status") == "True" and c.get("observedGeneration") == generation


async def test_a_partition_rolls_only_the_groups_at_or_above_it(kmock: kmock.KubernetesEmulator) -> None:
    controller = SimulatedStatefulSetController(kmock, period_s=0.2)
    early: list[dict] = []

    async def watch() -> None:  # Ready for generation 2 must mean: the canary group runs the new spec
        while True:
            if ready_for(kmock, 2) and pod_images(kmock).get("p-g2-0") != V2:
                early.append(pod_images(kmock))
            await asyncio.sleep(0.05)

    async with operator(kmock, pipeline(replicas=3, stages=1)), running(controller.run()), running(watch()):
        await eventually(lambda: ready_for(kmock, 1), timeout=120)
        status = cr(kmock)["status"]
        assert status["currentRevision"] == status["updateRevision"] and status["currentSpec"]
        first = status["currentRevision"]

        bump(kmock, {"image": V2, "rollout": {"partition": 2}})
        await eventually(lambda: ready_for(kmock, 2), timeout=120)
        assert sts_images(kmock) == {"p-g0": V1, "p-g1": V1, "p-g2": V2}
        assert pod_images(kmock) == {"p-g0-0": V1, "p-g1-0": V1, "p-g2-0": V2}
        assert [deletions(kmock, f"p-g{g}-0") for g in range(3)] == [0, 0, 1]
        status = cr(kmock)["status"]
        assert (status["updatedReplicas"], status["readyReplicas"]) == (1, 3)
        assert status["currentRevision"] == first != status["updateRevision"]
        assert [g["index"] for g in groups(kmock) if g["ready"]] == [0, 1, 2]  # the router serves all
        assert "rollout.partition 2" in condition(kmock)["message"]

        # A group below the partition that is deleted comes back on the previous spec.
        kmock.objects[STS, "ml", "p-g0"].delete()
        await eventually(lambda: "p-g0" in live(kmock, STS))
        await asyncio.sleep(10)
        assert sts_images(kmock)["p-g0"] == V1 and pod_images(kmock)["p-g0-0"] == V1

        bump(kmock, {"rollout": {"partition": 0}})
        await eventually(lambda: ready_for(kmock, 3), timeout=180)
        assert set(pod_images(kmock).values()) == set(sts_images(kmock).values()) == {V2}
        status = cr(kmock)["status"]
        assert status["updatedReplicas"] == 3 and status["currentRevision"] == status["updateRevision"]
    assert not early, early[:2]
