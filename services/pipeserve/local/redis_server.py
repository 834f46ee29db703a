"""LocalRedis: a private redis-server on a free loopback port (`--hicache-url local`, tests).

No persistence (`save ""`, no AOF): L3 is a cache, and a restart of this
process's Redis may only cause misses. `start()` waits for PING with a
deadline; `stop()` terminates, then kills after a bounded wait. With
`cluster=True` the server runs in cluster mode (its node file in a private
directory), for `cluster_create` to join several into a Redis Cluster.
"""

from __future__ import annotations

import ctypes
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from pipeserve.errors import ConfigError
from pipeserve.local.ports import PortBook

if TYPE_CHECKING:
    import redis

# redis-py (~80 ms to import) is imported by the functions that talk to the server: `pipeserve up`
# imports this module before it launches the stages, whose start is the long pole of ready.


class LocalRedis:
    def __init__(
        self,
        port: int | None = None,
        cluster: bool = False,
        maxmemory_mb: int | None = None,
        ports: PortBook | None = None,
    ) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise ConfigError(
                "hicache_url: 'local' needs redis-server (Debian: apt-get install redis-server)"
            )
        ports = ports if ports is not None else PortBook()  # the caller's, where it starts more
        self.port = port or ports.take()
        self.dir = Path(tempfile.mkdtemp(prefix="pipeserve-redis-"))
        self.argv = [
            binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ]
        self.argv += ["--dir", str(self.dir), "--protected-mode", "no"]
        if cluster:
            # The cluster bus defaults to port + 10000, beyond 65535 for most free ports: name a free one.
            self.argv += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
            self.argv += ["--cluster-port", str(ports.take())]
        if maxmemory_mb is not None:
            self.argv += ["--maxmemory", f"{maxmemory_mb}mb", "--maxmemory-policy", "allkeys-lru"]
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> LocalRedis:
        import redis

        self.proc = subprocess.Popen(
            self.argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent
        )
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1.0, socket_connect_timeout=1.0)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with status {self.proc.returncode}")
                try:
                    client.ping()
                    return self
                except redis.RedisError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(
                            f"redis-server on port {self.port} not answering after {timeout_s}s"
                        ) from None
                    time.sleep(0.05)
        finally:
            client.close()

    def ensure_running(self) -> bool:
        """Start it again on the same port if it exited (the supervisor's check); True if it had to."""
        if self.proc is None or self.proc.poll() is None:
            return False
        self.start()
        return True

    def stop(self, grace_s: float = 5.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(grace_s)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the process that started it dies (no orphan Redis)."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):
        pass


def cluster_create(nodes: list[LocalRedis], timeout_s: float = 30.0) -> None:
    """Join cluster-mode servers into one Redis Cluster of masters (redis-cli --cluster create)."""
    cli = shutil.which("redis-cli")
    if cli is None:
        raise ConfigError("a Redis Cluster needs redis-cli (Debian: redis-tools)")
    addrs = [f"127.0.0.1:{n.port}" for n in nodes]
    subprocess.run(
        [cli, "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        timeout=timeout_s,
    )
    import redis

    # Every node, not the first alone: each learns the others' slots by gossip and answers
    # CLUSTERDOWN until it has, so a client sent to a late node right after create failed.
    clients = [redis.Redis(host="127.0.0.1", port=n.port, socket_timeout=1.0) for n in nodes]
    deadline = time.monotonic() + timeout_s
    try:
        for client in clients:
            while not _cluster_ok(client, len(nodes)):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the cluster of {addrs} is not ok after {timeout_s}s")
                time.sleep(0.1)
    finally:
        for client in clients:
            client.close()


def _cluster_ok(client: redis.Redis, nodes: int) -> bool:
    """This node sees the cluster ok: every slot served, and every node known."""
    info = client.cluster("info")
    return info.get("cluster_state") == "ok" and int(info.get("cluster_known_nodes", 0)) == nodes
