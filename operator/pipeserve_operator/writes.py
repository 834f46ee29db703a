"""Writing the objects a pipeline owns: whole, and a refused write made visible.

    writer = Writer(memo, pipeline, now)
    live = writer.view.get("Service", name)         # kopf's watch-fed copy (indexes.py)
    present = await writer.ensure(desired, live)   # create, or replace when drifted
    writer.refused, writer.conflicts                # this tick's refusals (status, Events), races

* Whole. A missing object is created; a present one that drifted is replaced (PUT) by the rendering,
  whole, preconditioned on the live object's `resourceVersion`: a field the operator no longer
  renders (a removed priorityClassName, podLabels entry, volcano's schedulerName) is gone from the
  object and from the pods made from it later, which a merge patch (it keeps every key it does not
  name) never achieved. Kept from the live object: labels and annotations the rendering does not set
  (another tool's, the surge mark), its finalizers, and a StatefulSet's `spec.replicas` (the
  supervisor's: 0 during a restart's backoff). The API server's defaults come back on the replace.
* Drift. The rendering's hash (annotation `pipeserve.io/rendered`, over the labels and the spec less
  the supervisor's fields: replicas and the template's group-generation label) differs from the
  object's — the rendering changed, a field went away — or the object no longer contains what is
  rendered (a hand edit; defaults the API server added are not drift: `contains`), or the
  caller saw drift of its own (a pod-spec key added by hand).
* Refused writes. A 4xx (`kube.Rejected`: 422 Invalid, 403 Forbidden, an admission webhook's denial)
  is kept per object with the server's reason and message: the pipeline's status says `Degraded`
  (reason WriteRejected, the message), a Warning Event `WriteRejected` is posted per failed attempt,
  and the write is retried with backoff (REFUSAL_BACKOFF_S doubling up to REFUSAL_BACKOFF_MAX_S) while
  the rendering stays the same; a new rendering (the spec was fixed) is tried at once. Nothing else
  waits: the other objects, groups and pipelines are written on the same tick. A Conflict (the object
  changed since it was read, or appeared) is retried on the next tick (`conflicts`).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
from typing import Any

from pipeserve_operator.groups import post_event
from pipeserve_operator.kube import Conflict, Kube, Rejected
from pipeserve_operator.resources import GENERATION_LABEL

RENDERED_ANNOTATION = "pipeserve.io/rendered"
REFUSAL_BACKOFF_S, REFUSAL_BACKOFF_MAX_S = 2.0, 300.0
# kind → the Kube methods that create it and replace it.
METHODS = {
    "StatefulSet": ("create_statefulset", "replace_statefulset"),
    "Service": ("create_service", "replace_service"),
    "NetworkPolicy": ("create_network_policy", "replace_network_policy"),
    "PodDisruptionBudget": ("create_pdb", "replace_pdb"),
    "PodGroup": ("create_pod_group", "replace_pod_group"),
}


def contains(live: Any, want: Any) -> bool:
    """`want` is found in `live` (dicts: every key of `want`, recursively; lists: same length, item by
    item): the API server's defaulted fields on `live` are not drift."""
    if isinstance(want, dict):
        return isinstance(live, dict) and all(contains(live.get(k), v) for k, v in want.items())
    if isinstance(want, list):
        return isinstance(live, list) and len(live) == len(want) and all(map(contains, live, want))
    return bool(live == want or (want is not None and str(live) == str(want) and type(live) is not bool))


def _owned_part(body: dict[str, Any]) -> dict[str, Any]:
    """What the rendering decides (hashed, compared): labels and spec, less the supervisor's fields."""
    spec = copy.deepcopy(body.get("spec") or {})
    spec.pop("replicas", None)
    template_labels = ((spec.get("template") or {}).get("metadata") or {}).get("labels")
    if isinstance(template_labels, dict):
        template_labels.pop(GENERATION_LABEL, None)
    return {"labels": (body.get("metadata") or {}).get("labels") or {}, "spec": spec}


def rendered_hash(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(_owned_part(body), sort_keys=True).encode()).hexdigest()[:16]


def drifted(live: dict[str, Any], desired: dict[str, Any]) -> bool:
    annotations = (live.get("metadata") or {}).get("annotations") or {}
    if annotations.get(RENDERED_ANNOTATION) != rendered_hash(desired):
        return True
    return not contains(_compared(live), _compared(desired))


def _compared(body: dict[str, Any]) -> dict[str, Any]:
    spec = {k: v for k, v in (body.get("spec") or {}).items() if k != "replicas"}
    return {"labels": (body.get("metadata") or {}).get("labels") or {}, "spec": spec}


def whole(desired: dict[str, Any], live: dict[str, Any]) -> dict[str, Any]:
    """The replace body: `desired`, plus what the live object keeps (see the module's docstring)."""
    out = copy.deepcopy(desired)
    meta, have = out["metadata"], live.get("metadata") or {}
    meta["resourceVersion"] = have.get("resourceVersion")  # the precondition (None: an emulator's)
    for key in ("labels", "annotations"):
        merged = {**(have.get(key) or {}), **(meta.get(key) or {})}
        if merged:
            meta[key] = merged
    if have.get("finalizers"):
        meta["finalizers"] = list(have["finalizers"])
    if out["kind"] == "StatefulSet" and "replicas" in (live.get("spec") or {}):
        out["spec"]["replicas"] = live["spec"]["replicas"]
    return out


@dataclasses.dataclass
class Refusal:
    """A write the API server refused: its answer, and when the same rendering may be tried again."""

    kind: str
    name: str
    status: int
    reason: str
    message: str
    digest: str
    failures: int = 1
    retry_at: float = 0.0

    def describe(self, now: float) -> str:
        wait = max(0.0, self.retry_at - now)
        return (
            f"{self.kind} {self.name}: {self.status} {self.reason}: {self.message} "
            f"(attempt {self.failures}, next in {wait:.0f}s)"
        )


def backoff(failures: int) -> float:
    return float(min(REFUSAL_BACKOFF_MAX_S, REFUSAL_BACKOFF_S * 2 ** (failures - 1)))


class Writer:
    """One tick's writes of one pipeline's objects; refusals persist in `memo.refusals[uid]`."""

    def __init__(self, memo: Any, pipeline: dict[str, Any], now: float) -> None:
        self.kube: Kube = memo.kube
        self.pipeline, self.now = pipeline, now
        self.view = memo.owned.of(pipeline)  # the pipeline's live objects (indexes.py: no API reads)
        uid = pipeline["metadata"].get("uid")
        self.held: dict[tuple[str, str], Refusal] = memo.refusals.setdefault(uid, {})
        self.refused: list[Refusal] = []
        self.conflicts = 0
        self._touched: set[tuple[str, str]] = set()

    async def ensure(self, desired: dict[str, Any], live: dict[str, Any] | None, drift: bool = False) -> bool:
        """Create or replace `desired` (see the module's docstring); True when the object exists now."""
        kind, meta = desired["kind"], desired["metadata"]
        key, ns = (kind, meta["name"]), meta["namespace"]
        self._touched.add(key)
        body = copy.deepcopy(desired)
        digest = rendered_hash(body)
        body["metadata"].setdefault("annotations", {})[RENDERED_ANNOTATION] = digest
        if live is not None and not drift and not drifted(live, body):
            self.held.pop(key, None)
            return True
        held = self.held.get(key)
        if held is not None and held.digest == digest and self.now < held.retry_at:
            self.refused.append(held)
            return live is not None
        create, replace = METHODS[kind]
        try:
            if live is None:
                await getattr(self.kube, create)(ns, body)
            else:
                await getattr(self.kube, replace)(ns, meta["name"], whole(body, live))
        except Conflict:
            self.conflicts += 1
            return live is not None
        except Rejected as e:
            await self._refused(key, digest, e, held)
            return live is not None
        self.held.pop(key, None)
        return True

    async def _refused(self, key: tuple[str, str], digest: str, e: Rejected, held: Refusal | None) -> None:
        failures = held.failures + 1 if held is not None and held.digest == digest else 1
        refusal = Refusal(*key, e.status, e.reason, e.message, digest, failures)
        refusal.retry_at = self.now + backoff(failures)
        self.held[key] = refusal
        self.refused.append(refusal)
        await post_event(self.kube, self.pipeline, "Warning", "WriteRejected", refusal.describe(self.now))

    def finish(self) -> None:
        """Forget the refusals of objects this tick no longer writes (a group scaled away)."""
        for key in set(self.held) - self._touched:
            del self.held[key]
