"""Watch-fed indexes of what every pipeline owns, the client's own recent writes, and the wake-ups.

    view = memo.owned.of(pipeline)          # this pipeline's objects, as kopf's watches last saw them
    view.list("Pod"), view.get("Service", "p-g0")

* Indexes. For each kind in `KINDS` a `@kopf.index` (id `owned_<plural>`) keeps every object that
  carries the stage labels (`OWNED_LABELS`: the pipeline label, app.kubernetes.io/name pipeserve,
  component stage; the router's objects are not matched), keyed by (namespace, pipeline name): kopf
  lists each kind once and then watches it, so reading costs the API server nothing, however many
  pipelines and groups there are. kopf starts no other handler before every index has had its first
  listing.
* Read your own writes. The watch delivers a write some milliseconds after its answer; a reconcile
  woken in between would see the object missing (and create it again: 409) or outdated (a replace on
  the old resourceVersion: 409). `Recent` (held by `kube.Kube`, filled by its create / replace /
  patch / delete of an owned kind) lays the server's answer (a deletion: a tombstone) over the index
  until the watch delivers that version (the same resourceVersion; for a tombstone a DELETED or a new
  ADDED) or `RECENT_S` pass (a version the watch skipped). Pods are not laid over: a pod deleted by
  the supervisor stays visible until the watch says it is gone, as a Terminating pod would.
* Wake-ups. A `@kopf.on.event` per kind (and one for the pipelines, handlers.py) marks the object's
  pipeline due: the reconcile loop (handlers.py) waits on `Wakeups` with a deadline, so a deleted
  Service or a hand-edited NetworkPolicy is put back within one pass, not at the next resync. kopf
  calls event handlers only once every index is populated and after the event's own index update, so
  the first wake-up also says the indexes are complete (`Wakeups.ready`). An event that carries an
  object as the last one did (a re-opened watch or a new listing replaying everything as ADDED)
  wakes nothing (`Wakeups.changed`).
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
from typing import Any

import kopf

from pipeserve_operator.resources import PIPELINE_LABEL

# kind → (API group, version, plural): everything a pipeline owns, and its pods.
KINDS = {
    "StatefulSet": ("apps", "v1", "statefulsets"),
    "Pod": ("", "v1", "pods"),
    "Service": ("", "v1", "services"),
    "NetworkPolicy": ("networking.k8s.io", "v1", "networkpolicies"),
    "PodDisruptionBudget": ("policy", "v1", "poddisruptionbudgets"),
    "PodGroup": ("scheduling.volcano.sh", "v1beta1", "podgroups"),
}
OWNED_LABELS: dict[str, Any] = {  # values: a label value or kopf.PRESENT
    "app.kubernetes.io/name": "pipeserve",
    "app.kubernetes.io/component": "stage",
    PIPELINE_LABEL: kopf.PRESENT,
}
RECENT_S = 10.0  # how long a write stands in for the watch's copy at most (loop time)
Key = tuple[str, str]  # (namespace, pipeline name)


def _now() -> float:
    return asyncio.get_running_loop().time()


def index_id(kind: str) -> str:
    return f"owned_{KINDS[kind][2]}"


class Recent:
    """The owned objects this client wrote lately: (kind, namespace, name) → (the server's answer, or
    None for a deletion; when it stops standing in for the index)."""

    def __init__(self) -> None:
        self._entries: dict[tuple[str, str, str], tuple[dict[str, Any] | None, float]] = {}

    def wrote(self, kind: str, body: dict[str, Any]) -> None:
        meta = body.get("metadata") or {}
        if kind in KINDS and meta.get("name"):
            self._entries[(kind, meta.get("namespace") or "", meta["name"])] = (body, _now() + RECENT_S)

    def gone(self, kind: str, ns: str, name: str) -> None:
        self._entries[(kind, ns, name)] = (None, _now() + RECENT_S)

    def delivered(self, kind: str, body: dict[str, Any], event: str | None) -> None:
        """The watch delivered `body` (event ADDED / MODIFIED / DELETED; None: a listing)."""
        meta = body.get("metadata") or {}
        key = (kind, meta.get("namespace") or "", meta.get("name") or "")
        entry = self._entries.get(key)
        if entry is None:
            return
        wrote = entry[0]
        if wrote is None:
            if event in ("DELETED", "ADDED"):
                del self._entries[key]
        elif (wrote.get("metadata") or {}).get("resourceVersion") == meta.get("resourceVersion"):
            del self._entries[key]

    def overlay(self, kind: str, ns: str) -> dict[str, dict[str, Any] | None]:
        """name → what stands in for the index's copy (None: deleted), expired entries dropped."""
        now, out = _now(), {}
        for key, (body, until) in list(self._entries.items()):
            if until < now:
                del self._entries[key]
            elif key[0] == kind and key[1] == ns:
                out[key[2]] = body
        return out


class View:
    """One pipeline's objects of every kind: kopf's index, with `Recent` laid over it."""

    def __init__(self, owned: Owned, ns: str, pipeline: str) -> None:
        self.owned, self.ns, self.pipeline = owned, ns, pipeline

    def list(self, kind: str) -> list[dict[str, Any]]:
        index = self.owned.indexes.get(kind)
        found = (
            {b["metadata"]["name"]: b for b in (index.get((self.ns, self.pipeline)) or [])} if index else {}
        )
        if kind != "Pod":
            for name, body in self.owned.recent.overlay(kind, self.ns).items():
                if body is None:
                    found.pop(name, None)
                elif ((body.get("metadata") or {}).get("labels") or {}).get(PIPELINE_LABEL) == self.pipeline:
                    found[name] = body
        return [found[name] for name in sorted(found)]

    def get(self, kind: str, name: str) -> dict[str, Any] | None:
        return next((b for b in self.list(kind) if b["metadata"]["name"] == name), None)


class Owned:
    """kopf's indexes of the owned kinds (attached by the loop: kopf hands them to handlers only)."""

    def __init__(self, recent: Recent) -> None:
        self.recent = recent
        self.indexes: dict[str, Any] = {}

    def attach(self, handler_kwargs: dict[str, Any]) -> None:
        self.indexes = {kind: handler_kwargs[index_id(kind)] for kind in KINDS}

    def of(self, pipeline: dict[str, Any]) -> View:
        return View(self, pipeline["metadata"]["namespace"], pipeline["metadata"]["name"])


class Wakeups:
    """The pipelines due for a reconcile, and an event the loop waits on (with a deadline)."""

    def __init__(self) -> None:
        self.due: set[Key] = set()
        self.ready = asyncio.Event()  # set by the first wake-up: kopf's indexes are populated
        self._event = asyncio.Event()
        # (kind, namespace, name) -> the version of the object the last event carried
        self._versions: dict[tuple[str, str, str], bytes] = {}

    def changed(self, kind: str, body: Any, event: str | None) -> bool:
        """Whether a watch event brings something new: False for an object delivered again as it was
        (a watch re-opened or a listing repeated: kopf lists again after a 410 Gone, and replays every
        object as ADDED; waking every pipeline for that would delay the one whose object did change).
        Compared: a digest of the whole body, its resourceVersion included (on a real API server the
        version alone would do; the emulator's store, changed directly by a test or the simulated
        controller, keeps the version a changed object had)."""
        meta = body.get("metadata") or {}
        key = (kind, meta.get("namespace") or "", meta.get("name") or "")
        if event == "DELETED":
            self._versions.pop(key, None)
            return True
        text = json.dumps(dict(body), sort_keys=True, default=str).encode()  # kopf.Body: a mapping view
        version = hashlib.blake2b(text, digest_size=16).digest()
        if self._versions.get(key) == version:
            return False
        self._versions[key] = version
        return True

    def wake(self, key: Key) -> None:
        self.due.add(key)
        self.ready.set()
        self._event.set()

    def take(self) -> set[Key]:
        due, self.due = self.due, set()
        self._event.clear()
        return due

    async def wait(self, timeout: float) -> None:
        """Until a wake-up or `timeout` seconds (a due pipeline: at once)."""
        if self.due or timeout <= 0:
            return
        try:
            await asyncio.wait_for(self._event.wait(), timeout)
        except TimeoutError:
            pass


def _register(kind: str) -> None:
    group, version, plural = KINDS[kind]

    def index(body: Any, namespace: Any, labels: Any, **_: Any) -> dict[Key, dict[str, Any]]:
        return {(namespace, labels[PIPELINE_LABEL]): copy.deepcopy(dict(body))}

    def event(memo: Any, body: Any, namespace: Any, labels: Any, type: Any, **_: Any) -> None:
        memo.kube.recent.delivered(kind, body, type)
        if memo.wakes.changed(kind, body, type):
            memo.wakes.wake((namespace, labels[PIPELINE_LABEL]))

    kopf.index(group, version, plural, id=index_id(kind), labels=OWNED_LABELS)(index)
    kopf.on.event(group, version, plural, id=f"wake_{plural}", labels=OWNED_LABELS)(event)


for _kind in KINDS:
    _register(_kind)
