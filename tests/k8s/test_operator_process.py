"""`pipeserve-operator` as real processes against kmock's Kubernetes API: what the chart's Deployment
runs (its console script, a kubeconfig login, the Lease election, the liveness port).

Two replicas: one leads (creates the group's objects), the other stands by and still answers
liveness; the leader is killed, the standby takes the Lease after it expires and follows a scale-up;
SIGTERM stops it cleanly. Wall-clock time (separate processes): a 3 s Lease keeps it short.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import sys
import time
from pathlib import Path

import httpx
import kmock
import pytest
import yaml
from k8s_support import CR, NS, STS, declare_resources, eventually, live, pipeline

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]
LEASE = "coordination.k8s.io/v1/leases"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kubeconfig(path: Path, server: str) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "kmock", "cluster": {"server": server}}],
                "users": [{"name": "test", "user": {"token": "test"}}],
                "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "test"}}],
                "current-context": "kmock",
            }
        )
    )
    return path


async def start(name: str, config: Path, port: int, log: Path) -> asyncio.subprocess.Process:
    exe = shutil.which("pipeserve-operator", path=os.path.dirname(sys.executable))
    assert exe, "the pipeserve-operator console script is installed with the package"
    env = {**os.environ, "KUBECONFIG": str(config), "POD_NAME": name, "POD_NAMESPACE": NS}
    return await asyncio.create_subprocess_exec(
        *[exe, "--namespace", NS, "--liveness-port", str(port)],
        *["--lease-seconds", "3", "--renew-seconds", "1", "--drain-seconds", "1"],
        env=env,
        stdout=log.open("wb"),
        stderr=asyncio.subprocess.STDOUT,
    )


async def alive(port: int) -> bool:
    try:
        async with httpx.AsyncClient(timeout=2) as client:
            return (await client.get(f"http://127.0.0.1:{port}/healthz")).status_code == 200
    except httpx.HTTPError:
        return False


async def until_alive(port: int, timeout: float = 60.0) -> bool:
    """Whether the process answers /healthz within `timeout` s (wall): a replica may still be
    starting after the other one leads (imports take seconds on a busy machine)."""
    deadline = time.monotonic() + timeout  # wall time: kmock's loop may run on looptime's clock
    while not await alive(port):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.5)
    return True


def holder(k: kmock.KubernetesEmulator) -> str | None:
    lease = live(k, LEASE).get("pipeserve-operator")
    return lease["spec"].get("holderIdentity") if lease else None


async def test_leader_election_failover_and_clean_stop(
    kmock: kmock.KubernetesEmulator, tmp_path: Path
) -> None:
    declare_resources(kmock)
    kmock.objects[CR, NS, "p"] = pipeline(replicas=1)
    config = kubeconfig(tmp_path / "kubeconfig", str(kmock.url).rstrip("/"))
    ports = {"op-a": free_port(), "op-b": free_port()}
    procs = {name: await start(name, config, port, tmp_path / f"{name}.log") for name, port in ports.items()}
    try:
        await eventually(lambda: "p-g0" in live(kmock, STS), timeout=60, wall=True)
        leader = holder(kmock)
        assert leader in procs, leader
        standby = next(n for n in procs if n != leader)
        for name in procs:  # the standby is alive too (or the Deployment's probe would restart it)
            assert await until_alive(ports[name]), name

        procs[leader].kill()  # no chance to hand the Lease over: the standby waits for it to expire
        await procs[leader].wait()
        kmock.objects[CR, NS, "p"].patch({"spec": {"replicas": 2}})
        await eventually(lambda: holder(kmock) == standby, timeout=30, wall=True)
        await eventually(lambda: "p-g1" in live(kmock, STS), timeout=60, wall=True)
        assert live(kmock, LEASE)["pipeserve-operator"]["spec"]["leaseTransitions"] >= 1

        procs[standby].send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(procs[standby].wait(), 30) == 0
    finally:
        for p in procs.values():
            if p.returncode is None:
                p.kill()
                with contextlib.suppress(ProcessLookupError):
                    await asyncio.wait_for(p.wait(), 10)
        for name in procs:
            print(f"--- {name}\n{(tmp_path / f'{name}.log').read_text()[-3000:]}")
