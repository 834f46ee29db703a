"""`pipeserve-operator` / `python -m pipeserve_operator`: kopf's operator for InferencePipeline resources.

    pipeserve-operator [--namespace NS | --all-namespaces] [--liveness-port 8080] [--standalone]

Without --standalone, the operator first wins the Lease `pipeserve-operator` (leader.py) in its own
namespace (POD_NAMESPACE, else --lease-namespace, else the watched namespace), then runs kopf while
renewing it; when it cannot renew for a whole lease duration it stops kopf and exits 1 (the pod
restarts and campaigns again). Liveness: `http://0.0.0.0:<port>/healthz` — kopf's probe endpoint
while it runs; a standby waiting for the Lease serves its own /healthz on the same port (a standby
is alive: without it the Deployment's liveness probe would restart every standby replica).
kopf's own peering is off (`standalone=True` for kopf): the Lease is the only election.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import sys
import time

import kopf
from aiohttp import web

from pipeserve import env as pipeserve_env
from pipeserve_operator import handlers  # noqa: F401  (registers the handlers)
from pipeserve_operator.indexes import Owned, Wakeups
from pipeserve_operator.kube import Kube, api_client
from pipeserve_operator.leader import LeaseElector

log = logging.getLogger("pipeserve.operator")
LEASE_NAME = "pipeserve-operator"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pipeserve-operator", description=__doc__.split("\n\n")[0])
    where = p.add_mutually_exclusive_group()
    where.add_argument("--namespace", "-n", default=None, help="watch one namespace")
    where.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace")
    p.add_argument("--liveness-port", type=int, default=8080)
    p.add_argument("--standalone", action="store_true", help="no leader election (a single replica)")
    p.add_argument("--lease-namespace", default=pipeserve_env.get(pipeserve_env.POD_NAMESPACE))
    p.add_argument("--lease-seconds", type=int, default=15)
    p.add_argument("--renew-seconds", type=float, default=5.0)
    p.add_argument("--drain-seconds", type=float, default=30.0, help="wait after a group leaves routing")
    p.add_argument(
        "--resync-seconds",
        type=float,
        default=60.0,
        help="reconcile every pipeline this often even without a watch event (a safety net: changes "
        "to a pipeline or to what it owns are reconciled as their watch events arrive)",
    )
    p.add_argument(
        "--network-policies",
        action="store_true",
        help="a NetworkPolicy per group: ring traffic only from the group's own pods, gRPC only from routers",
    )
    return p


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: object) -> None:
    # Progress and the last handled spec live in annotations: status belongs to the reconcile loop alone.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="pipeserve.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="pipeserve.io")
    # No scanning: the CRD is installed before the operator (the chart), and the watched namespaces
    # are named, so the operator needs no cluster-wide list/watch of namespaces and CRDs.
    settings.scanning.disabled = True
    settings.posting.level = logging.WARNING  # Events: ours (restarts, failures), not every handler's success


def make_memo(
    kube: Kube, drain_s: float, network_policies: bool = False, resync_s: float = 60.0
) -> kopf.Memo:
    return kopf.Memo(
        kube=kube,
        clock=time.time,
        drain_s=drain_s,
        drains={},
        network_policies=network_policies,
        statuses={},
        refusals={},
        owned=Owned(kube.recent),
        wakes=Wakeups(),
        resync_s=resync_s,
        loop=None,
    )


async def _run(args: argparse.Namespace) -> int:
    kube = Kube(api_client())
    stop = asyncio.Event()
    operator = kopf.operator(
        standalone=True,
        clusterwide=args.all_namespaces,
        namespaces=[args.namespace] if args.namespace else [],
        liveness_endpoint=f"http://0.0.0.0:{args.liveness_port}/healthz",
        memo=make_memo(kube, args.drain_seconds, args.network_policies, args.resync_seconds),
        stop_flag=stop,
    )
    if args.standalone:
        await operator
        return 0
    ns = args.lease_namespace or args.namespace or "default"
    identity = pipeserve_env.get(pipeserve_env.POD_NAME) or socket.gethostname()
    elector = LeaseElector(kube, ns, LEASE_NAME, identity, args.lease_seconds, args.renew_seconds)
    standby = await _standby_liveness(args.liveness_port)
    try:
        while not await _campaign(elector):
            await asyncio.sleep(args.renew_seconds)
    finally:
        await standby.cleanup()  # the port is kopf's from here on
    log.info("leader: %s holds lease %s/%s", identity, ns, LEASE_NAME)
    task = asyncio.create_task(operator)
    while not task.done():
        await asyncio.sleep(args.renew_seconds)
        try:
            await elector.try_acquire()
        except Exception as e:  # noqa: BLE001  (an unreachable API server: keep trying until the lease is lost)
            log.warning("lease renewal failed: %s", e)
        if elector.lost():
            log.error("leader: lost lease %s/%s; stopping", ns, LEASE_NAME)
            stop.set()
            await task
            return 1
    await task
    return 0


async def _campaign(elector: LeaseElector) -> bool:
    try:
        return await elector.try_acquire()
    except Exception as e:  # noqa: BLE001  (an API server not answering yet: campaign again later)
        log.warning("lease campaign failed: %s", e)
        return False


async def _standby_liveness(port: int) -> web.AppRunner:
    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"standby": True})

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "0.0.0.0", port).start()
    return runner


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=pipeserve_env.get(pipeserve_env.LOG_LEVEL) or "INFO")
    args = build_parser().parse_args(argv)
    if not args.namespace and not args.all_namespaces:
        args.namespace = pipeserve_env.get(pipeserve_env.POD_NAMESPACE) or "default"
    return asyncio.run(_run(args))


if __name__ == "__main__":
    sys.exit(main())
