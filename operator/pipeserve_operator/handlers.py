"""kopf wiring for InferencePipeline: an index of the pipelines and one operator-level loop.

* `pipelines` (`@kopf.index`): every InferencePipeline kopf sees, by (namespace, name), kept current by
  kopf's watch. An index adds no finalizer (kopf adds its finalizer only for deletion handlers, timers
  and daemons), so a pipeline or its namespace is deleted at once even when no operator runs.
* `start_loop` (`@kopf.on.startup`) starts `run_loop`: every TICK_S, `supervise.tick` for every
  indexed pipeline, one after another (an error in one is logged and does not stop the others).
  `stop_loop` (`@kopf.on.cleanup`) cancels it. The loop is the only writer of status; it keeps the
  status it wrote last per pipeline uid (the index may lag behind its own write by one watch event).
Deletion: every object carries an owner reference to the pipeline; the cluster's garbage collector
removes them with it, so there is no deletion handler.
Operator-wide state is in kopf's memo: `kube` (kube.Kube), `clock` (wall time: records persist across
operator restarts), `drain_s`, `drains` (when each scale-down's drain began), `statuses`, `refusals`
(writes.py: per pipeline uid, the writes the API server refused and their backoff), `loop`.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
from typing import Any

import kopf

from pipeserve_operator.crd import GROUP, PLURAL, VERSION
from pipeserve_operator.supervise import tick

TICK_S = 2.0
log = logging.getLogger("pipeserve.operator")


@kopf.index(GROUP, VERSION, PLURAL)
def pipelines(body: Any, namespace: Any, name: Any, **_: Any) -> dict[tuple[str, str], dict[str, Any]]:
    return {(namespace, name): copy.deepcopy(dict(body))}


async def run_loop(memo: Any, index: Any) -> None:
    while True:
        live = {b["metadata"].get("uid") for key in list(index) for b in index.get(key) or []}
        for uid in set(memo.statuses) - live:
            del memo.statuses[uid]  # a deleted pipeline (a new one of the same name has another uid)
        for uid in set(memo.refusals) - live:
            del memo.refusals[uid]
        for key in list(index):
            bodies = list(index.get(key) or [])
            if not bodies:
                continue
            body = bodies[-1]
            uid = body["metadata"].get("uid")
            status = memo.statuses.get(uid) or dict(body.get("status") or {})
            try:
                written = await tick(memo, body, status)
            except Exception:
                log.exception("reconciling %s/%s failed; retrying next tick", *key)
                continue
            if written is not None:
                memo.statuses[uid] = written
        await asyncio.sleep(TICK_S)


@kopf.on.startup()
async def start_loop(memo: Any, **kwargs: Any) -> None:
    # kopf passes every index to every handler by its name (here: the function `pipelines` above).
    memo.statuses = {}
    memo.loop = asyncio.create_task(run_loop(memo, kwargs["pipelines"]), name="pipeserve reconcile loop")


@kopf.on.cleanup()
async def stop_loop(memo: Any, **_: Any) -> None:
    task = getattr(memo, "loop", None)
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
