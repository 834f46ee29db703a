"""kmock's KubernetesEmulator, with what the operator's writes need from a real API server.

kmock stores objects and merges every PATCH into them; it knows neither resource versions nor PUT.
`ApiServer` (every `kmock` fixture, through tests/conftest.py) adds, as the API server does:

* `metadata.resourceVersion`: every write through the API (POST, PATCH, PUT) stores a new one, a
  counter, as a string (clients only compare it for equality). A create gets a `metadata.uid`
  (kopf tells objects apart by namespace, name and uid: a Service and a StatefulSet of the same name
  without uids would be one object to its indexes).
* PUT (replace): the stored object becomes the body, whole (a field the body lacks is gone), except
  `status` on the main resource (only the status subresource writes it) and the immutable
  `metadata.uid` and `creationTimestamp`. A body naming another
  `resourceVersion` than the stored one is refused 409 Conflict; an unknown object 404.
* A PATCH that names `metadata.resourceVersion` is preconditioned on it the same way (409).
* A write (POST, PATCH, PUT) to a resource not declared in `resources` (once any is) is 404, as a
  resource the API server does not serve (a cluster without Volcano: no PodGroups).
* `reject[(resource, name)] = (status, message)`: every write of that object (create, patch, replace)
  is refused with that status and an apimachinery `Status` body (reason `Invalid` for 422), as an
  admission webhook or a validation the operator did not foresee would; reads still answer. Each
  refusal is logged in `refused` as (loop time, HTTP method, name).

* Watch events for every change, as the API server's watch cache sends them: kmock sends one only
  for a write through the API; a change a test (or a simulated controller) makes to `objects`
  directly (assigned, `.patch()`, `.create()`, `.delete()`, `del`) is sent too, by a task that scans
  the store every `SCAN_S` (loop time) for versions no event announced yet. A watch is marked on
  the event bus before it lists, so no event falls between its listing and its stream.
* Watch bookmarks: every `BOOKMARK_S` (loop time) a BOOKMARK event (the current resourceVersion) on
  every watch that asked for them (`allowWatchBookmarks`, as kopf does), as the API server's watch
  cache sends them: without them kopf takes a quiet stream for a dead one and re-opens it after its
  `inactivity_timeout` (70 s), and a re-opened stream lists every object again as ADDED (the emulator
  ignores the `resourceVersion` a watch resumes from).

Objects a test puts into `objects` directly keep the resourceVersion they were given (or none): a
replace that names it (or none) still matches.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp.web
import attrs
import kmock
from kmock._internal import aiobus, k8s, rendering

REASONS = {400: "BadRequest", 403: "Forbidden", 409: "Conflict", 422: "Invalid"}
SCAN_S = 0.05
BOOKMARK_S = 30.0  # under kopf's 70 s inactivity timeout (the API server sends one at least a minute)
Key = tuple[Any, Any, Any]  # (resource, namespace, name), as kmock's `objects` keys them


class _Bus(aiobus.Bus[Any]):
    """One resource's event bus: every event put on it marks its object's version as announced."""

    def __init__(self, server: ApiServer, resource: Any) -> None:
        super().__init__()
        self.server, self.resource = server, resource

    async def put(self, item: Any) -> None:
        meta = (item.get("object") or {}).get("metadata") or {}
        self.server._announced((self.resource, meta.get("namespace"), meta.get("name")))
        await super().put(item)


class _Buses(dict[Any, _Bus]):
    def __init__(self, server: ApiServer) -> None:
        super().__init__()
        self.server = server

    def __missing__(self, resource: Any) -> _Bus:
        bus = self[resource] = _Bus(self.server, resource)
        return bus


@attrs.define(kw_only=True)
class ApiServer(k8s.KubernetesEmulator):
    reject: dict[tuple[str, str], tuple[int, str]] = attrs.field(factory=dict)
    refused: list[tuple[float, str, str]] = attrs.field(factory=list)
    _versions: Any = attrs.field(factory=lambda: itertools.count(1000), init=False)
    # key → (the history length last announced by an event, the body it announced)
    _seen: dict[Key, tuple[int, Any]] = attrs.field(factory=dict, init=False)
    _scanner: asyncio.Task[None] | None = attrs.field(default=None, init=False)
    _last_version: str = attrs.field(default="0", init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._buses = _Buses(self)

    async def __aexit__(self, *exc: Any) -> None:
        if self._scanner is not None and self._entered == 1:
            self._scanner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._scanner
            self._scanner = None
        await super().__aexit__(*exc)

    def _announced(self, key: Key) -> None:
        obj = self.objects[key] if key in self.objects else None
        if obj is not None:
            self._seen[key] = (len(obj.history), None if obj.deleted else obj.raw)

    async def _scan_forever(self) -> None:
        loop = asyncio.get_running_loop()
        bookmark_at = loop.time() + BOOKMARK_S
        while True:
            await asyncio.sleep(SCAN_S)
            async with self._lock:
                await self._scan()
                if loop.time() >= bookmark_at:
                    bookmark_at = loop.time() + BOOKMARK_S
                    await self._bookmark()

    async def _bookmark(self) -> None:
        """A BOOKMARK on every watched resource's stream (the lock is held): the current resourceVersion,
        no object. A watch with allowWatchBookmarks gets it; a quiet stream then stays open, as on a
        real API server (kopf re-opens a stream that said nothing for 70 s)."""
        for resource, bus in list(self._buses.items()):
            meta = {"resourceVersion": self._last_version}
            kind = str(getattr(resource, "plural", ""))
            await bus.put({"type": "BOOKMARK", "object": {"kind": kind, "metadata": meta}})

    async def _scan(self) -> None:
        """Send the events of the changes made to the store directly (the lock is held)."""
        current = dict(self.objects.items())
        for key, obj in current.items():
            versions, before = self._seen.get(key, (0, None))
            if len(obj.history) == versions:
                continue
            if obj.deleted:
                event = {"type": "DELETED", "object": obj.history.last.raw} if before is not None else None
            else:
                event = {"type": "MODIFIED" if before is not None else "ADDED", "object": obj.raw}
            self._seen[key] = (len(obj.history), None if obj.deleted else obj.raw)
            if event is not None:
                await self._buses[key[0]].put(event)
        for key in set(self._seen) - set(current):  # `del objects[key]`: gone with its history
            versions, before = self._seen.pop(key)
            if before is not None:
                await self._buses[key[0]].put({"type": "DELETED", "object": before})

    async def _serve_watch(self, request: rendering.Request) -> AsyncIterator[Any]:
        yield b""  # the headers: the stream has begun
        assert request.resource is not None
        bus = self._buses[request.resource]
        async with self._lock:  # marked before listing: no event between the two is lost
            mark = await bus.mark()
            listed = [
                {"type": "ADDED", "object": obj.raw}
                for (res, ns, name), obj in self.objects.items()
                if self._KubernetesEmulator__check(request, res, ns, name, strict=False) and not obj.deleted
            ]
        try:
            for event in listed:
                yield event
            bookmarks = request.params.get("allowWatchBookmarks") in ("true", "1")
            async for event in bus.stream(since=mark):
                if event.get("type") == "BOOKMARK":
                    if bookmarks:
                        yield event
                    continue
                meta = (event.get("object") or {}).get("metadata") or {}
                check = self._KubernetesEmulator__check
                if check(request, request.resource, meta.get("namespace"), meta.get("name"), strict=False):
                    yield event
        finally:
            await bus.unmark(mark)

    def _next_version(self) -> str:
        self._last_version = str(next(self._versions))
        return self._last_version

    def _refusal(self, request: rendering.Request) -> k8s.KubernetesError | None:
        if request.resource is None or request.method not in ("POST", "PATCH", "PUT"):
            return None
        name = request.name or ((request.data or {}).get("metadata") or {}).get("name")
        for (resource, rejected), (status, message) in self.reject.items():
            if request.resource == kmock.resource(resource) and name == rejected:
                kind = request.resource.plural
                details = {"name": name, "kind": kind, "causes": [{"message": message}]}
                self.refused.append((asyncio.get_running_loop().time(), str(request.method.value), name))
                return k8s.KubernetesError(
                    status=status, reason=REASONS.get(status, "BadRequest"), message=message, details=details
                )
        return None

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        if self._scanner is None:  # started by the first request: under looptime, in the test's clock
            self._scanner = asyncio.create_task(self._scan_forever(), name="kmock store scanner")
        refusal = self._refusal(request)
        if refusal is not None:
            raise refusal
        if self._unserved(request):
            raise k8s.KubernetesResourceNotFoundError()
        if request.resource is not None and request.name is not None and request.method == "PUT":
            return await self._replace(request)
        if request.resource is not None and request.method in ("POST", "PATCH"):
            body = request.data if isinstance(request.data, dict) else None
            if request.method == "PATCH" and body is not None:
                self._precondition(request, (body.get("metadata") or {}).get("resourceVersion"))
            if body is not None:
                body.setdefault("metadata", {})["resourceVersion"] = self._next_version()
            if body is not None and request.method == "POST":
                body["metadata"].setdefault("uid", str(uuid.uuid4()))
        return await super()._handle(request)

    def _unserved(self, request: rendering.Request) -> bool:
        """A write to a resource the API does not serve (once a test declared any: kmock itself stores
        whatever it is sent), as a cluster without Volcano answers a PodGroup's create: 404."""
        if request.resource is None or request.method not in ("POST", "PUT", "PATCH") or not self.resources:
            return False
        return not any(declared == request.resource for declared in self.resources)

    def _stored(self, request: rendering.Request) -> Any:
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            raise k8s.KubernetesObjectNotFoundError()
        return self.objects[key]

    def _precondition(self, request: rendering.Request, version: Any) -> None:
        if version is None or request.name is None:
            return
        have = (self._stored(request).raw.get("metadata") or {}).get("resourceVersion")
        if have is not None and str(version) != str(have):
            raise k8s.KubernetesError(
                status=409,
                reason="Conflict",
                message=f"the object has been modified (resourceVersion {version} != {have})",
            )

    async def _replace(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        async with self._lock:
            obj = self._stored(request)
            body = copy.deepcopy(request.data or {})
            self._precondition(request, (body.get("metadata") or {}).get("resourceVersion"))
            old = obj.raw
            if request.subresource is None:
                body.pop("status", None)
                if "status" in old:
                    body["status"] = copy.deepcopy(old["status"])
            meta = body.setdefault("metadata", {})
            meta["resourceVersion"] = self._next_version()
            for key in ("uid", "creationTimestamp"):  # immutable: the server keeps its own
                if key in (old.get("metadata") or {}):
                    meta[key] = old["metadata"][key]
            obj.create(body)
            raw = obj.raw
            await self._buses[request.resource].put({"type": "MODIFIED", "object": raw})
        return aiohttp.web.json_response(raw)
