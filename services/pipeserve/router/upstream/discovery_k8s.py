"""Kubernetes discovery: the Ready groups of one InferencePipeline's status.

    pipeserve router --discover kubernetes --namespace NS --pipeline NAME [--kube-api URL]

Watches the InferencePipeline NAME (pipeserve.io/v1alpha1, plural
inferencepipelines) in NS with the `kubernetes` client (imported here only):
in-cluster config, else the kubeconfig, or `--kube-api URL` without auth
(tests, dev). The sync client runs in one daemon thread; every target set it
computes is handed to the loop with `call_soon_threadsafe`, and only when it
changed.

Contract:
* Targets = `status.groups[*]` with `phase == "Ready"` and a valid `endpoint`
  ("host:port"), named `group-<index>`. A group whose phase leaves Ready is
  left out of the next set, so the ReplicaSet takes it out of routing at once
  (not at its next Health poll). The CR deleted, absent, or the resource not
  served at all ⇒ no groups (requests get 503 at once).
* List, then watch from the list's resourceVersion. A watch that ends (its
  server-side `timeout_seconds`, or the client's read deadline) is resumed
  from the last resourceVersion seen; 410 Gone, any other API error or a
  broken connection ⇒ list again, after a backoff that doubles per failure in
  a row (`backoff_s` .. `backoff_max_s`). Every call has a deadline:
  `timeout_seconds` on the server and `_request_timeout` on the client (a
  watch's read deadline is `watch_timeout_s + request_timeout_s`: a watch
  that stays silent that long is resumed).
* The field selector names the CR, and events are filtered by name here too
  (an API that ignores the selector changes nothing).
* While the API cannot be reached the last targets stand: the groups keep
  serving, still polled for Health by the ReplicaSet. One log line per change
  between failing and succeeding, never one per retry.
* `spec.router.policy` (round_robin | least_load | prefix_affinity) is handed to `on_policy`
  (in the loop, like the targets) when it changes, None when the CR has none or is gone: the router
  applies it unless its own flags or --models entry name a policy.
* Cancelling `run` stops the watch (its socket is shut down) and the thread
  exits; being a daemon thread, it can never hold the process up.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

from pipeserve import env as pipeserve_env
from pipeserve.config import POLICIES, DiscoveryConfig
from pipeserve.obs.ratelimit import RateLimitedLog
from pipeserve.router.upstream.discovery import Apply, valid_target

log = logging.getLogger("pipeserve.router")

GROUP, VERSION, PLURAL = "pipeserve.io", "v1alpha1", "inferencepipelines"
SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def pod_namespace(path: str = SERVICE_ACCOUNT_NAMESPACE) -> str:
    """The namespace this pod runs in (its service account's file), else "default"."""
    try:
        with open(path) as f:
            return f.read().strip() or "default"
    except OSError:
        return "default"


def ready_targets(obj: dict[str, Any] | None) -> dict[str, str]:
    """group-<index> -> endpoint for each group of the CR's status that is Ready with an endpoint."""
    if not obj:
        return {}
    groups = (obj.get("status") or {}).get("groups") or []
    targets = {}
    for g in groups:
        if not isinstance(g, dict) or g.get("phase") != "Ready":
            continue
        index, endpoint = g.get("index"), g.get("endpoint")
        if isinstance(index, int) and index >= 0 and isinstance(endpoint, str) and valid_target(endpoint):
            targets[f"group-{index}"] = endpoint
    return targets


def pipeline_policy(obj: dict[str, Any] | None) -> str | None:
    """The CR's spec.router.policy when it names a known policy, else None."""
    router = ((obj or {}).get("spec") or {}).get("router") or {}
    policy = router.get("policy") if isinstance(router, dict) else None
    return policy if policy in POLICIES else None


class Kubernetes:
    def __init__(
        self, config: DiscoveryConfig, on_policy: Callable[[str | None], None] | None = None
    ) -> None:
        self.config = config
        self.on_policy = on_policy
        self._policy: str | None = None
        self._publish_policy: Callable[[str | None], None] = lambda p: None
        self._stop = threading.Event()
        self._watch: Any = None  # the kubernetes.watch.Watch in progress, to stop it from the loop
        self._failing = False
        # A watch expires (410) every few minutes by design: a periodic line, rolled up hourly.
        self._relists = RateLimitedLog(log, interval_s=3600.0)

    async def run(self, apply: Apply) -> None:
        loop = asyncio.get_running_loop()
        ended: asyncio.Future[None] = loop.create_future()

        def publish(targets: dict[str, str]) -> None:
            if not self._stop.is_set():
                loop.call_soon_threadsafe(apply, targets)

        def publish_policy(policy: str | None) -> None:
            if self.on_policy is not None and not self._stop.is_set():
                loop.call_soon_threadsafe(self.on_policy, policy)

        self._publish_policy = publish_policy

        def main() -> None:
            try:
                self._main(publish)
            finally:
                if not self._stop.is_set():  # a bug ended the thread: say so in the loop
                    loop.call_soon_threadsafe(ended.set_result, None)

        thread = threading.Thread(target=main, name="router-discovery-k8s", daemon=True)
        thread.start()
        try:
            await ended
            raise RuntimeError("kubernetes discovery stopped")
        finally:
            self._stop.set()
            if self._watch is not None:
                self._watch.stop()  # shuts the socket down: the thread's blocked read ends now

    # --- the thread ----------------------------------------------------------
    def _api(self) -> Any:
        from kubernetes import client, config

        if self.config.kube_api:
            cfg = client.Configuration()
            cfg.host = self.config.kube_api
        else:
            cfg = client.Configuration()
            if pipeserve_env.get(pipeserve_env.KUBERNETES_SERVICE_HOST):
                config.load_incluster_config(client_configuration=cfg)
            else:
                config.load_kube_config(client_configuration=cfg)
        return client.CustomObjectsApi(client.ApiClient(cfg))

    def _main(self, publish: Callable[[dict[str, str]], None]) -> None:
        from kubernetes.client.exceptions import ApiException
        from kubernetes.config.config_exception import ConfigException
        from urllib3.exceptions import HTTPError

        c = self.config
        last: dict[str, str] | None = None

        def emit(targets: dict[str, str]) -> None:
            nonlocal last
            if targets != last:
                log.info("pipeline %s/%s: ready groups %s", c.namespace, c.pipeline, targets or "none")
                last = targets
                publish(targets)

        delay = c.backoff_s
        while not self._stop.is_set():
            try:
                api = self._api()
                version = self._list(api, emit)
                self._ok()
                delay = c.backoff_s
                while not self._stop.is_set():
                    version = self._watch_once(api, version, emit)
            except ApiException as e:
                if self._stop.is_set():
                    break
                if e.status == 404:  # the CRD is not installed (or not served): no pipeline, no groups
                    emit({})
                self._failed(f"API error {e.status}: {e.reason}", gone=e.status == 410)
                if e.status == 410:
                    continue  # our resourceVersion expired: list again now
            except (HTTPError, OSError, ConfigException) as e:
                if self._stop.is_set():
                    break  # our own stop() shut the socket down
                self._failed(f"{type(e).__name__}: {e}")
            except Exception:  # a bug here must not silently stop discovery
                log.exception("kubernetes discovery failed")
            self._stop.wait(delay)
            delay = min(delay * 2, c.backoff_max_s)

    def _list(self, api: Any, emit: Callable[[dict[str, str]], None]) -> str | None:
        c = self.config
        listing = api.list_namespaced_custom_object(
            GROUP,
            VERSION,
            c.namespace,
            PLURAL,
            field_selector=f"metadata.name={c.pipeline}",
            timeout_seconds=max(1, int(c.request_timeout_s)),
            _request_timeout=c.request_timeout_s,
        )
        items = [o for o in listing.get("items") or [] if _name(o) == c.pipeline]
        self._note_spec(items[0] if items else None)
        emit(ready_targets(items[0] if items else None))
        return (listing.get("metadata") or {}).get("resourceVersion") or None

    def _watch_once(
        self, api: Any, version: str | None, emit: Callable[[dict[str, str]], None]
    ) -> str | None:
        """One watch call from `version`, to its end; the last resourceVersion seen."""
        from kubernetes import watch
        from urllib3.exceptions import ReadTimeoutError

        c = self.config
        w = watch.Watch()
        self._watch = w
        kwargs: dict[str, Any] = {
            "field_selector": f"metadata.name={c.pipeline}",
            "timeout_seconds": max(1, int(c.watch_timeout_s)),
            "_request_timeout": (c.request_timeout_s, c.watch_timeout_s + c.request_timeout_s),
        }
        if version:
            kwargs["resource_version"] = version
        try:
            for event in w.stream(
                api.list_namespaced_custom_object, GROUP, VERSION, c.namespace, PLURAL, **kwargs
            ):
                if self._stop.is_set():
                    break
                obj = event.get("raw_object") or {}
                if _name(obj) != c.pipeline:
                    continue
                if event["type"] == "DELETED":
                    emit({})
                    self._note_spec(None)
                elif event["type"] in ("ADDED", "MODIFIED"):
                    self._note_spec(obj)
                    emit(ready_targets(obj))
        except ReadTimeoutError:
            pass  # silent for the whole read deadline: resume from where we were
        finally:
            self._watch = None
        return w.resource_version or version

    def _note_spec(self, obj: dict[str, Any] | None) -> None:
        """Hand spec.router.policy on when it changed (before the targets it may route)."""
        policy = pipeline_policy(obj)
        if policy != self._policy:
            c = self.config
            log.info("pipeline %s/%s: router policy %s", c.namespace, c.pipeline, policy or "unset")
            self._policy = policy
            self._publish_policy(policy)

    def _ok(self) -> None:
        if self._failing:
            log.info("pipeline %s/%s: watching again", self.config.namespace, self.config.pipeline)
        self._failing = False

    def _failed(self, why: str, gone: bool = False) -> None:
        if gone:
            c = self.config
            self._relists.info(
                "410", "pipeline %s/%s: watch expired (410), listing again", c.namespace, c.pipeline
            )
            return
        if not self._failing:
            log.warning(
                "pipeline %s/%s: cannot list/watch (%s); keeping the groups known, retrying with backoff",
                self.config.namespace,
                self.config.pipeline,
                why,
            )
        self._failing = True


def _name(obj: dict[str, Any]) -> str | None:
    return (obj.get("metadata") or {}).get("name")
