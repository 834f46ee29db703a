"""Leader election on a coordination.k8s.io/v1 Lease (kopf's peering is not leader election).

One replica holds the Lease (`holderIdentity` = its pod name) and renews `renewTime` every `renew_s`;
another replica takes it over only once `renewTime + leaseDurationSeconds` has passed. Every write
names the Lease's resourceVersion (when the server keeps one), so two candidates racing for an
expired Lease cannot both win: the loser gets a Conflict. A leader that cannot renew for a whole
lease duration has lost the Lease and must stop acting (main.py stops the operator and exits).
Invariant: at most one holder whose last successful renewal is younger than the lease duration.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from typing import Any

from pipeserve_operator.kube import Conflict, Kube


def micro_time(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(text: str | None) -> float:
    if not text:
        return 0.0
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


class LeaseElector:
    def __init__(
        self,
        kube: Kube,
        namespace: str,
        name: str,
        identity: str,
        lease_s: int = 15,
        renew_s: float = 5.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not 0 < renew_s < lease_s:
            raise ValueError(f"renew_s must be in (0, lease_s): {renew_s}, {lease_s}")
        self.kube, self.namespace, self.name, self.identity = kube, namespace, name, identity
        self.lease_s, self.renew_s, self.clock = lease_s, renew_s, clock
        self.last_renewed = 0.0  # our last successful write (0: never)

    def _spec(self, now: float, acquired: str, transitions: int) -> dict[str, Any]:
        return {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": self.lease_s,
            "acquireTime": acquired,
            "renewTime": micro_time(now),
            "leaseTransitions": transitions,
        }

    async def try_acquire(self) -> bool:
        """Acquire or renew the Lease; True when this candidate holds it now."""
        now = self.clock()
        lease = await self.kube.get_lease(self.namespace, self.name)
        try:
            if lease is None:
                body = {
                    "apiVersion": "coordination.k8s.io/v1",
                    "kind": "Lease",
                    "metadata": {"name": self.name, "namespace": self.namespace},
                    "spec": self._spec(now, micro_time(now), 0),
                }
                await self.kube.create_lease(self.namespace, body)
            else:
                spec = lease.get("spec") or {}
                holder = spec.get("holderIdentity")
                duration = spec.get("leaseDurationSeconds") or self.lease_s
                if holder and holder != self.identity and now < parse_time(spec.get("renewTime")) + duration:
                    return False
                mine = holder == self.identity
                transitions = int(spec.get("leaseTransitions") or 0) + (0 if mine else 1)
                acquired = str(spec.get("acquireTime") or micro_time(now)) if mine else micro_time(now)
                patch: dict[str, Any] = {"spec": self._spec(now, acquired, transitions)}
                version = (lease.get("metadata") or {}).get("resourceVersion")
                if version:
                    patch["metadata"] = {"resourceVersion": version}
                await self.kube.patch_lease(self.namespace, self.name, patch)
        except Conflict:
            return False
        self.last_renewed = now
        return True

    def lost(self) -> bool:
        """True once a whole lease duration passed since our last successful renewal."""
        return self.clock() - self.last_renewed >= self.lease_s
