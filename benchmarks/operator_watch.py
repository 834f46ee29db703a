"""The operator's API load in steady state, and how fast a deleted owned object comes back (issue 31, 3).

    python benchmarks/operator_watch.py [--pipelines 50] [--groups 4] [--window 60] [--settle 600]

kmock's emulator (tests/kmock_support.ApiServer: resource versions, PUT, watch events for every change)
serves the API; the real operator (kopf, handlers.py, with --network-policies) runs in this process
against it, as tests/k8s do, but in wall time (no looptime). A simulated StatefulSet controller
(tests/k8s/k8s_support.py) makes every group's pods Running and Ready, so every pipeline settles Ready.

1. Settle: wait until every pipeline's Ready condition is True (at most --settle seconds).
2. Steady state: count the API requests the operator makes during --window seconds, by verb
   (list / watch / get / put / patch / post / delete), per minute and per pipeline per minute.
   A watch counts once, when it is opened (a long-lived stream is one request).
3. Recovery: delete one group's Service, then one group's StatefulSet, through the API (a watch event,
   as a real API server sends), and time until the operator has created it again (wall time).
Prints one JSON object (the figures) on the last line.
"""

# ruff: noqa: E402  (the test helpers are imported from tests/, put on sys.path first)
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import pathlib
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "k8s"), str(ROOT / "operator")]

import kopf
import kubernetes
from k8s_support import CR, NS, STS, SVC, SimulatedStatefulSetController, declare_resources, live, pipeline
from kmock import Server
from kmock_support import ApiServer

from pipeserve_operator import handlers  # noqa: F401  (registers the handlers)
from pipeserve_operator.kube import Kube, api_client
from pipeserve_operator.main import make_memo


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


async def wait(check: Any, timeout: float, step: float = 0.01) -> float:
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"not within {timeout}s")
        await asyncio.sleep(step)
    return time.monotonic() - start


def operator_requests(k: Any, since: int) -> list[Any]:
    # The operator's requests only: the benchmark's own deletes go through a client it names.
    return [r for r in list(k._requests)[since:] if r.headers.get("User-Agent") != "benchmark"]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    async with ApiServer() as k, Server(k):
        declare_resources(k)
        names = [f"p{i:03d}" for i in range(args.pipelines)]
        for i, name in enumerate(names):
            body = pipeline(replicas=args.groups, stages=2)
            body["metadata"].update(name=name, uid=f"uid-{i:04d}")
            k.objects[CR, NS, name] = body
        url = str(k.url)

        @kopf.on.login()
        def login(**_: object) -> kopf.ConnectionInfo:
            return kopf.ConnectionInfo(server=url, insecure=True)

        memo = make_memo(Kube(api_client(url)), drain_s=5.0, network_policies=True)
        stop = asyncio.Event()
        task = asyncio.create_task(kopf.operator(standalone=True, namespaces=[NS], memo=memo, stop_flag=stop))
        controller = SimulatedStatefulSetController(k, period_s=0.5)
        sim = asyncio.create_task(controller.run())
        try:
            settled = await wait(lambda: all(ready(k, n) for n in names), args.settle, step=0.5)
            await asyncio.sleep(args.quiet)  # the last status writes' events go by
            mark, start = len(k._requests), time.monotonic()
            await asyncio.sleep(args.window)
            seen = operator_requests(k, mark)
            minutes = (time.monotonic() - start) / 60.0
            by_verb = collections.Counter(verb(r) for r in seen)
            client = api_client(url)
            client.user_agent = "benchmark"
            core, apps = kubernetes.client.CoreV1Api(client), kubernetes.client.AppsV1Api(client)
            recovery = {}
            for kind, res, delete in (
                ("Service", SVC, core.delete_namespaced_service),
                ("StatefulSet", STS, apps.delete_namespaced_stateful_set),
            ):
                target = f"{names[len(names) // 2]}-g1"
                await asyncio.to_thread(delete, target, NS)
                assert target not in live(k, res)
                recovery[kind] = round(await wait(lambda r=res, t=target: t in live(k, r), 120.0), 3)
        finally:
            sim.cancel()
            stop.set()
            await asyncio.wait_for(task, 60)
    total = sum(by_verb.values())
    return {
        "pipelines": args.pipelines,
        "groups": args.groups,
        "settle_s": round(settled, 1),
        "window_s": round(minutes * 60, 1),
        "requests_per_min": round(total / minutes, 1),
        "per_pipeline_per_min": round(total / minutes / args.pipelines, 2),
        "by_verb_per_min": {v: round(n / minutes, 1) for v, n in sorted(by_verb.items())},
        "recreated_s": recovery,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pipelines", type=int, default=50)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--window", type=float, default=60.0, help="steady-state window, seconds")
    p.add_argument("--settle", type=float, default=900.0, help="deadline for every pipeline Ready, seconds")
    p.add_argument("--quiet", type=float, default=5.0, help="wait after Ready before counting, seconds")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    print(json.dumps(asyncio.run(run(args))))


if __name__ == "__main__":
    main()
