"""A write the API server refuses (422) is visible and retried with backoff, and holds back nothing else.

kmock (apiserver.ApiServer) refuses every write of one StatefulSet with 422 Invalid and the server's
message, as a validation the operator did not foresee would: the pipeline's status says Degraded
(WriteRejected, the message), its generation is not observed (Ready stays False: `kubectl wait`
keeps its meaning), a Warning Event carries the message, the write is retried with growing gaps (and
at once when the spec changes), the pipeline's other group and another pipeline go on; once the
server accepts the write, the pipeline turns Ready.
"""

from __future__ import annotations

import asyncio
import copy
import itertools

import kmock
import pytest
from k8s_support import (
    CR,
    NS,
    STS,
    SimulatedStatefulSetController,
    declare_resources,
    eventually,
    live,
    pipeline,
    running,
)
from test_operator import cr, group_ready, operator

pytestmark = [pytest.mark.asyncio, pytest.mark.looptime]

MESSAGE = (
    'StatefulSet.apps "p-g0" is invalid: spec.template.spec.containers[0].resources.requests: '
    'Invalid value: "2": must be less than or equal to cpu limit of 1'
)


def _condition(k: kmock.KubernetesEmulator, name: str, kind: str) -> dict:
    status = k.objects[CR, NS, name].raw.get("status") or {}
    return next((c for c in status.get("conditions") or [] if c["type"] == kind), {})


def _other_pipeline() -> dict:
    body = pipeline(replicas=1, stages=1)
    body["metadata"].update(name="q", uid="5a0d7c2e-2b1f-4d8e-8c3a-9e4f1b6d7a21")
    return body


async def test_a_refused_write_is_degraded_evented_backed_off_and_holds_back_nothing_else(
    kmock: kmock.KubernetesEmulator,
) -> None:
    controller = SimulatedStatefulSetController(kmock, period_s=0.2)
    declare_resources(kmock)
    kmock.objects[CR, NS, "q"] = _other_pipeline()
    kmock.reject[(STS, "p-g0")] = (422, MESSAGE)

    def refusals() -> list[float]:
        return [t for t, _, name in kmock.refused if name == "p-g0"]

    async with operator(kmock, pipeline(replicas=2, stages=1)), running(controller.run()):
        await eventually(lambda: _condition(kmock, "p", "Degraded").get("reason") == "WriteRejected")
        degraded = _condition(kmock, "p", "Degraded")
        assert (
            degraded["status"] == "True" and MESSAGE in degraded["message"] and "422" in degraded["message"]
        )
        # The pipeline's other group and the other pipeline go on.
        await eventually(
            lambda: group_ready(kmock, 1) and _condition(kmock, "q", "Ready").get("status") == "True"
        )
        assert "p-g0" not in live(kmock, STS) and {"p-g1", "q-g0"} <= set(live(kmock, STS))
        assert kmock.objects[CR, NS, "q"].raw["status"]["observedGeneration"] == 1
        # Not observed: Ready is False for the generation, as `kubectl wait --for=condition=Ready` sees it.
        assert "observedGeneration" not in cr(kmock)["status"]
        assert _condition(kmock, "p", "Ready")["status"] == "False"
        events = [e for e in live(kmock, "v1/events").values() if e.get("reason") == "WriteRejected"]
        assert events and events[0]["type"] == "Warning" and MESSAGE in events[0]["message"]
        assert events[0]["involvedObject"]["name"] == "p"

        # Backoff: the gaps between attempts grow (2 s doubling: 0, 2, 6, 14, 30 s after the first), not
        # one attempt per 2 s tick (about 10 in 20 s).
        await asyncio.sleep(20)
        times = refusals()
        gaps = [b - a for a, b in itertools.pairwise(times)]
        assert 4 <= len(times) <= 5, times
        assert all(b > a for a, b in itertools.pairwise(gaps)) and gaps[2] >= 6, gaps

        # A changed spec is a new rendering: tried at once, not after the backoff.
        tried = len(refusals())
        spec = copy.deepcopy(cr(kmock)["spec"])
        spec["engine"]["max-num-seqs"] = 9
        kmock.objects[CR, NS, "p"].patch({"spec": spec, "metadata": {"generation": 2}})
        await eventually(lambda: len(refusals()) > tried, timeout=2 * 2.0 + 1, step=0.1)

        # The server accepts the write: the group is created, the generation observed, Ready.
        del kmock.reject[(STS, "p-g0")]
        await eventually(lambda: _condition(kmock, "p", "Ready").get("status") == "True", timeout=120)
        assert _condition(kmock, "p", "Degraded")["status"] == "False"
        assert cr(kmock)["status"]["observedGeneration"] == 2 and "p-g0" in live(kmock, STS)
