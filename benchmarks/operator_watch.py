"""The operator's API load in steady state, and how fast a deleted owned object comes back (issue 31, 3).

    python benchmarks/operator_watch.py [--pipelines 50] [--groups 4] [--window 60] [--repeats 3]

Two processes, so that the operator is timed alone:
* the *cluster* (a child process): kmock's emulator (tests/kmock_support.ApiServer: resource versions,
  PUT, watch events for every change, watch bookmarks) serving the API over HTTP, and a simulated
  StatefulSet controller (tests/k8s/k8s_support.py) making every group's pods Running and Ready;
* the *operator* (this process): the real one (kopf, handlers.py, with --network-policies), as in
  production, but in wall time.
The benchmark talks to the cluster over a pipe (how many pipelines are Ready, the requests counted,
when an object exists again) and deletes objects through the API, as a user would.

1. Settle: wait until every pipeline's Ready condition is True (at most --settle seconds).
2. Steady state: count the API requests the operator makes during --window seconds, by verb
   (list / watch / get / put / patch / post / delete), per minute and per pipeline per minute, and
   the watches by resource. A watch counts once, when it is opened (a long-lived stream is one request).
3. Recovery, --repeats times (a different pipeline each time): delete one group's Service, then one
   group's StatefulSet, through the API (the watch event a real API server sends), and time until the
   operator has created it again (wall time, CLOCK_MONOTONIC: the same clock in both processes), from
   the moment the emulator deleted it (`Service`, `StatefulSet`: the watch event, the operator's
   reconcile, its create) and from the benchmark's DELETE request (`..._from_request`: plus the
   client and the emulator answering the DELETE).
Prints one JSON object (the figures, medians and every sample) on the last line.
"""

# ruff: noqa: E402  (the test helpers are imported from tests/, put on sys.path first)
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import multiprocessing
import pathlib
import statistics
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "k8s"), str(ROOT / "operator")]

import kopf
import kubernetes
from k8s_support import CR, NS, STS, SVC, SimulatedStatefulSetController, declare_resources, pipeline, stored
from kmock import Server
from kmock_support import ApiServer

from pipeserve_operator import handlers  # noqa: F401  (registers the handlers)
from pipeserve_operator.kube import Kube, api_client
from pipeserve_operator.main import make_memo

BENCHMARK_AGENT = "benchmark"  # the benchmark's own requests (deletes) are not the operator's


def verb(request: Any) -> str:
    method = str(request.method.value).upper()
    if method == "GET":
        if request.params.get("watch") in ("true", "1"):
            return "watch"
        return "get" if request.name else "list"
    return method.lower()


def ready(k: Any, name: str) -> bool:
    body = k.objects[CR, NS, name].raw
    conditions = (body.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


# --- the cluster process ---------------------------------------------------------------------------


def _gone(k: Any, resource: str, name: str) -> bool:
    obj = stored(k, resource, name)
    return obj is None or obj.deleted


async def _when(check: Any, timeout: float, step: float) -> float | None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return None
        await asyncio.sleep(step)
    return time.monotonic()


async def _answer(k: Any, names: list[str], command: tuple, armed: dict) -> Any:
    what, *args = command
    if what == "ready":
        return sum(ready(k, n) for n in names)
    if what == "mark":
        return len(k._requests)
    if what == "count":  # the operator's requests since a mark: by verb, and the watches by resource
        seen = [r for r in list(k._requests)[args[0] :] if r.headers.get("User-Agent") != BENCHMARK_AGENT]
        watches = collections.Counter(str(r.resource.plural) for r in seen if verb(r) == "watch")
        return dict(collections.Counter(verb(r) for r in seen)), dict(watches)
    if what == "arm":  # note when (resource, name) is deleted (polled every 1 ms: one lookup, no scan)
        resource, name = args
        armed[resource, name] = asyncio.create_task(_when(lambda: _gone(k, resource, name), 120.0, 0.001))
        return True
    if what == "exists_at":  # (CLOCK_MONOTONIC when it was deleted, when it exists again)
        resource, name, timeout = args
        gone = await armed.pop((resource, name))
        return gone, await _when(lambda: not _gone(k, resource, name), timeout, 0.001)
    raise ValueError(what)


async def _cluster(conn: Connection, pipelines: int, groups: int) -> None:
    async with ApiServer() as k, Server(k):
        declare_resources(k)
        names = [f"p{i:03d}" for i in range(pipelines)]
        for i, name in enumerate(names):
            body = pipeline(replicas=groups, stages=2)
            body["metadata"].update(name=name, uid=f"uid-{i:04d}")
            k.objects[CR, NS, name] = body
        sim = asyncio.create_task(SimulatedStatefulSetController(k, period_s=0.5).run())
        conn.send(str(k.url))
        loop, armed = asyncio.get_running_loop(), {}
        while True:
            command = await loop.run_in_executor(None, conn.recv)
            if command == ("stop",):
                break
            conn.send(await _answer(k, names, command, armed))
        sim.cancel()


def cluster_main(conn: Connection, pipelines: int, groups: int) -> None:
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(_cluster(conn, pipelines, groups))


class Cluster:
    """The parent's end of the pipe: one command at a time (a lock: the pipe is not shared-safe)."""

    def __init__(self, conn: Connection) -> None:
        self.conn, self.lock = conn, threading.Lock()

    def _call(self, *command: Any) -> Any:
        with self.lock:
            self.conn.send(command)
            return self.conn.recv()

    async def call(self, *command: Any) -> Any:
        return await asyncio.to_thread(self._call, *command)


# --- the operator process (this one) ----------------------------------------------------------------


async def wait_until(check: Any, timeout: float, step: float) -> float:
    start = time.monotonic()
    while not await check():
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"not within {timeout}s")
        await asyncio.sleep(step)
    return time.monotonic() - start


async def recovery(cluster: Cluster, url: str, names: list[str], repeats: int) -> dict[str, list[float]]:
    client = api_client(url)
    client.user_agent = BENCHMARK_AGENT
    core, apps = kubernetes.client.CoreV1Api(client), kubernetes.client.AppsV1Api(client)
    out: dict[str, list[float]] = {
        k: [] for k in ("Service", "StatefulSet", "Service_from_request", "StatefulSet_from_request")
    }
    for rep in range(repeats):
        for kind, res, delete in (
            ("Service", SVC, core.delete_namespaced_service),
            ("StatefulSet", STS, apps.delete_namespaced_stateful_set),
        ):
            target = f"{names[(len(names) // 2 + 7 * rep) % len(names)]}-g1"
            await cluster.call("arm", res, target)
            start = time.monotonic()
            await asyncio.to_thread(delete, target, NS)
            gone, back = await cluster.call("exists_at", res, target, 120.0)
            if gone is None or back is None:
                raise TimeoutError(f"{kind} {target} not deleted and recreated within 120 s")
            out[kind].append(round(back - gone, 3))  # from the deletion, as the API server made it
            out[kind + "_from_request"].append(round(back - start, 3))
            await asyncio.sleep(3.0)  # its pods and status settle before the next deletion
    return out


async def run(args: argparse.Namespace, cluster: Cluster, url: str) -> dict[str, Any]:
    names = [f"p{i:03d}" for i in range(args.pipelines)]

    @kopf.on.login()
    def login(**_: object) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=url, insecure=True)

    memo = make_memo(Kube(api_client(url)), drain_s=5.0, network_policies=True)
    stop = asyncio.Event()
    task = asyncio.create_task(kopf.operator(standalone=True, namespaces=[NS], memo=memo, stop_flag=stop))
    try:

        async def all_ready() -> bool:
            return int(await cluster.call("ready")) == len(names)

        settled = await wait_until(all_ready, args.settle, step=0.5)
        await asyncio.sleep(args.quiet)  # the last status writes' events go by
        mark, start = await cluster.call("mark"), time.monotonic()
        await asyncio.sleep(args.window)
        by_verb, watches = await cluster.call("count", mark)
        minutes = (time.monotonic() - start) / 60.0
        recreated = await recovery(cluster, url, names, args.repeats)
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
    total = sum(by_verb.values())
    return {
        "pipelines": args.pipelines,
        "groups": args.groups,
        "settle_s": round(settled, 1),
        "window_s": round(minutes * 60, 1),
        "requests_per_min": round(total / minutes, 1),
        "per_pipeline_per_min": round(total / minutes / args.pipelines, 3),
        "by_verb_per_min": {v: round(n / minutes, 1) for v, n in sorted(by_verb.items())},
        "watches_by_resource": watches,
        "recreated_median_s": {kind: round(statistics.median(v), 3) for kind, v in recreated.items()},
        "recreated_s": recreated,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pipelines", type=int, default=50)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--window", type=float, default=60.0, help="steady-state window, seconds")
    p.add_argument("--settle", type=float, default=900.0, help="deadline for every pipeline Ready, seconds")
    p.add_argument("--quiet", type=float, default=5.0, help="wait after Ready before counting, seconds")
    p.add_argument("--repeats", type=int, default=3, help="deletions of each kind (medians reported)")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    ours, theirs = multiprocessing.Pipe()
    child = multiprocessing.get_context("spawn").Process(
        target=cluster_main, args=(theirs, args.pipelines, args.groups), daemon=True
    )
    child.start()
    cluster = Cluster(ours)
    try:
        if not ours.poll(60):
            raise TimeoutError("the cluster process did not start within 60 s")
        url = ours.recv()
        print(json.dumps(asyncio.run(run(args, cluster, url))))
    finally:
        with cluster.lock:
            ours.send(("stop",))
        child.join(30)
        if child.is_alive():
            child.terminate()


if __name__ == "__main__":
    main()
