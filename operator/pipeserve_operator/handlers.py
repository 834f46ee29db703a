"""kopf wiring for InferencePipeline: watch-fed indexes, wake-ups, and one operator-level loop.

* `pipelines` (`@kopf.index`): every InferencePipeline kopf sees, by (namespace, name), kept current by
  kopf's watch. An index adds no finalizer (kopf adds its finalizer only for deletion handlers, timers
  and daemons), so a pipeline or its namespace is deleted at once even when no operator runs.
  indexes.py adds one index per owned kind (StatefulSets, pods, Services, NetworkPolicies, PDBs,
  PodGroups), by pipeline: the loop reads nothing from the API server.
* Wake-ups: a watch event of a pipeline (`wake_pipeline`) or of anything it owns (indexes.py) marks
  the pipeline due; the loop reconciles it at once (a deleted Service is back within one pass).
* `start_loop` (`@kopf.on.startup`) starts `run_loop`, which waits (with a deadline) for the first
  wake-up (kopf's indexes are then populated), then reconciles (`supervise.tick`), one after another
  (an error in one is logged and does not stop the others):
  - every pipeline woken since the last pass (one woken during a pass goes next, before the rest);
  - every TICK_S, the pipelines with something in flight (`_in_flight`: not Ready, a write refused
    and backed off, a drain or a pod Terminating): their timers (startup deadlines, restart backoff,
    drain_s, stuck pods) run on the clock, not on events;
  - every `resync_s` (--resync-seconds), every pipeline: the safety net for a missed event.
  `stop_loop` (`@kopf.on.cleanup`) cancels it. The loop is the only writer of status; it keeps the
  status it wrote last per pipeline uid (the index may lag behind its own write by one watch event),
  and writes only a status that changed.
Deletion: every object carries an owner reference to the pipeline; the cluster's garbage collector
removes them with it, so there is no deletion handler.
Operator-wide state is in kopf's memo (main.make_memo): `kube` (kube.Kube), `clock` (wall time:
records persist across operator restarts), `drain_s`, `drains` (when each scale-down's drain began),
`statuses`, `refusals` (writes.py: per pipeline uid, the writes the API server refused and their
backoff), `owned` (indexes.Owned), `wakes` (indexes.Wakeups), `resync_s`, `loop`.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import math
from typing import Any

import kopf

from pipeserve_operator import indexes  # noqa: F401  (registers the owned kinds' indexes and wake-ups)
from pipeserve_operator.crd import GROUP, PLURAL, VERSION
from pipeserve_operator.supervise import tick

TICK_S = 2.0
log = logging.getLogger("pipeserve.operator")


@kopf.index(GROUP, VERSION, PLURAL)
def pipelines(body: Any, namespace: Any, name: Any, **_: Any) -> dict[tuple[str, str], dict[str, Any]]:
    return {(namespace, name): copy.deepcopy(dict(body))}


@kopf.on.event(GROUP, VERSION, PLURAL, id="wake_pipeline")
def wake_pipeline(memo: Any, body: Any, namespace: Any, name: Any, type: Any, **_: Any) -> None:
    if memo.wakes.changed("InferencePipeline", body, type):  # a replayed pipeline wakes nothing
        memo.wakes.wake((namespace, name))


def _in_flight(memo: Any, pipeline: dict[str, Any], status: dict[str, Any]) -> bool:
    """Something in this pipeline waits on the clock rather than on an event."""
    uid = pipeline["metadata"].get("uid")
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
    )
    drains = any(key[0] == uid for key in memo.drains)
    terminating = any(p["metadata"].get("deletionTimestamp") for p in memo.owned.of(pipeline).list("Pod"))
    return not ready or bool(memo.refusals.get(uid)) or drains or terminating


async def _reconcile(memo: Any, index: Any, key: tuple[str, str]) -> bool:
    """One pipeline's reconcile; True while it has something in flight."""
    bodies = list(index.get(key) or [])
    if not bodies:
        return False
    body = bodies[-1]
    uid = body["metadata"].get("uid")
    status = memo.statuses.get(uid) or dict(body.get("status") or {})
    try:
        written = await tick(memo, body, status)
    except Exception:
        log.exception("reconciling %s/%s failed; retrying in %ss", *key, TICK_S)
        return True
    if written is not None:
        memo.statuses[uid] = status = written
    return _in_flight(memo, body, status)


async def run_loop(memo: Any, index: Any) -> None:
    loop = asyncio.get_running_loop()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(memo.wakes.ready.wait(), memo.resync_s)
    busy: set[tuple[str, str]] = set()
    resync_at = tick_at = loop.time()
    while True:
        due = memo.wakes.take()
        now = loop.time()
        if now >= resync_at:
            due |= set(index)
            resync_at = now + memo.resync_s
        if now >= tick_at:
            due |= busy
            tick_at = now + TICK_S
        live = {b["metadata"].get("uid") for key in list(index) for b in index.get(key) or []}
        for uid in set(memo.statuses) - live:
            del memo.statuses[uid]  # a deleted pipeline (a new one of the same name has another uid)
        for uid in set(memo.refusals) - live:
            del memo.refusals[uid]
        queue = sorted(due)
        while queue:
            key = queue.pop(0)
            if await _reconcile(memo, index, key):
                busy.add(key)
            else:
                busy.discard(key)
            # A pipeline woken meanwhile goes before the rest of a resync or a tick's batch: a deleted
            # Service waits for one reconcile, not for every pipeline's.
            woken = memo.wakes.take()
            queue = sorted(woken) + [k for k in queue if k not in woken]
        wake_at = min(resync_at, tick_at if busy else math.inf)
        await memo.wakes.wait(wake_at - loop.time())


@kopf.on.startup()
async def start_loop(memo: Any, **kwargs: Any) -> None:
    # kopf passes every index to every handler by its id (here: `pipelines` above, indexes.py's).
    memo.statuses = {}
    memo.owned.attach(kwargs)
    memo.loop = asyncio.create_task(run_loop(memo, kwargs["pipelines"]), name="pipeserve reconcile loop")


@kopf.on.cleanup()
async def stop_loop(memo: Any, **_: Any) -> None:
    task = getattr(memo, "loop", None)
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
