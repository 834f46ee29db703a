"""Lease leader election (pipeserve_operator.leader) against kmock: one holder at a time, renewals keep
it, a takeover only after the lease duration, and a leader that cannot renew knows it lost."""

from __future__ import annotations

import kmock
import pytest
from k8s_support import NS, declare_resources

from pipeserve_operator.kube import Kube, api_client
from pipeserve_operator.leader import LeaseElector


@pytest.mark.asyncio
async def test_one_holder_and_takeover_after_expiry(kmock: kmock.KubernetesEmulator) -> None:
    declare_resources(kmock)
    now = [1000.0]
    kube = Kube(api_client(str(kmock.url)))
    a = LeaseElector(kube, NS, "pipeserve-operator", "op-a", lease_s=15, renew_s=5, clock=lambda: now[0])
    b = LeaseElector(kube, NS, "pipeserve-operator", "op-b", lease_s=15, renew_s=5, clock=lambda: now[0])
    assert await a.try_acquire()
    assert not await b.try_acquire()
    now[0] += 10
    assert await a.try_acquire()  # renewed
    now[0] += 10
    assert not await b.try_acquire()  # 10 s since a's renewal < 15 s
    assert not a.lost()
    now[0] += 6  # a stopped renewing 16 s ago
    assert a.lost()
    assert await b.try_acquire()
    assert not await a.try_acquire()
    lease = kmock.objects["coordination.k8s.io/v1/leases", NS, "pipeserve-operator"].raw["spec"]
    assert lease["holderIdentity"] == "op-b" and lease["leaseTransitions"] == 1
    assert lease["leaseDurationSeconds"] == 15


def test_renew_period_must_be_shorter_than_the_lease() -> None:
    with pytest.raises(ValueError):
        LeaseElector(None, NS, "l", "me", lease_s=5, renew_s=5)  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_a_standby_answers_liveness_and_frees_the_port() -> None:
    # A standby waiting for the Lease is alive (the Deployment's probe must not restart it); once it
    # leads, kopf's own liveness endpoint takes the same port.
    import httpx

    from pipeserve.local.ports import free_port
    from pipeserve_operator.main import _standby_liveness

    port = free_port()
    runner = await _standby_liveness(port)
    try:
        async with httpx.AsyncClient(timeout=5) as client:
            r = await client.get(f"http://127.0.0.1:{port}/healthz")
        assert r.status_code == 200 and r.json() == {"standby": True}
    finally:
        await runner.cleanup()
    again = await _standby_liveness(port)  # the port is free again
    await again.cleanup()
