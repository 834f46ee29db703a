"""kmock's KubernetesEmulator, with what the operator's writes need from a real API server.

kmock stores objects and merges every PATCH into them; it knows neither resource versions nor PUT.
`ApiServer` (every `kmock` fixture, through tests/conftest.py) adds, as the API server does:

* `metadata.resourceVersion`: every write through the API (POST, PATCH, PUT) stores a new one, a
  counter, as a string (clients only compare it for equality).
* PUT (replace): the stored object becomes the body, whole (a field the body lacks is gone), except
  `status` on the main resource (only the status subresource writes it). A body naming another
  `resourceVersion` than the stored one is refused 409 Conflict; an unknown object 404.
* A PATCH that names `metadata.resourceVersion` is preconditioned on it the same way (409).
* `reject[(resource, name)] = (status, message)`: every write of that object (create, patch, replace)
  is refused with that status and an apimachinery `Status` body (reason `Invalid` for 422), as an
  admission webhook or a validation the operator did not foresee would; reads still answer. Each
  refusal is logged in `refused` as (loop time, HTTP method, name).

Objects a test puts into `objects` directly keep the resourceVersion they were given (or none): a
replace that names it (or none) still matches.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
from typing import Any

import aiohttp.web
import attrs
import kmock
from kmock._internal import k8s, rendering

REASONS = {400: "BadRequest", 403: "Forbidden", 409: "Conflict", 422: "Invalid"}


@attrs.define(kw_only=True)
class ApiServer(k8s.KubernetesEmulator):
    reject: dict[tuple[str, str], tuple[int, str]] = attrs.field(factory=dict)
    refused: list[tuple[float, str, str]] = attrs.field(factory=list)
    _versions: Any = attrs.field(factory=lambda: itertools.count(1000), init=False)

    def _next_version(self) -> str:
        return str(next(self._versions))

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
        refusal = self._refusal(request)
        if refusal is not None:
            raise refusal
        if request.resource is not None and request.name is not None and request.method == "PUT":
            return await self._replace(request)
        if request.resource is not None and request.method in ("POST", "PATCH"):
            body = request.data if isinstance(request.data, dict) else None
            if request.method == "PATCH" and body is not None:
                self._precondition(request, (body.get("metadata") or {}).get("resourceVersion"))
            if body is not None:
                body.setdefault("metadata", {})["resourceVersion"] = self._next_version()
        return await super()._handle(request)

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
            body.setdefault("metadata", {})["resourceVersion"] = self._next_version()
            obj.create(body)
            raw = obj.raw
            await self._buses[request.resource].put({"type": "MODIFIED", "object": raw})
        return aiohttp.web.json_response(raw)
