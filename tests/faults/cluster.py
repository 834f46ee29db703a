"""A pipeline group, its router and Redis, each stage on a host of its own (netns.Hosts).

    hosts:  s0 .. s{S-1}  one stage each: `pipeserve stage --rank k --master-addr <s0> --host <own>`
            router        `pipeserve router --upstream <s0>:GRPC`, on 0.0.0.0 (back and front links)
            redis         redis-server bound to its own address, every stage's L3

The ring (gloo, GLOO_SOCKET_IFNAME=eth0), gRPC and Redis traffic all cross the bridge, so a link
fault on a host is a fault between machines. Every host is its own network namespace, so every
process listens on the same fixed ports. There is no supervisor here: `restart_group()` does what
the operator does on a group stop (every stage of the group, together, with a fresh rendezvous).
Deadlines are short so that a fault test ends in seconds: the ring's (`RING_TIMEOUT_S`), the
router's first message and stream idle deadlines.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import httpx
from netns import Hosts

from serving_support import metric, wait_until

GRPC, HEALTH, MASTER, ROUTER, REDIS = 50051, 8080, 29500, 8000, 6379
RING_TIMEOUT_S = 4.0  # a silent peer stops the group after this long
FIRST_TOKEN_S, STREAM_IDLE_S = 8.0, 6.0  # the router's Generate deadlines
STAGE_FLAGS = [
    "--num-threads", "1", "--num-kv-blocks", "64", "--max-model-len", "256", "--max-num-seqs", "8",
    "--ring-timeout-s", str(RING_TIMEOUT_S), "--heartbeat-s", "0.5", "--connect-timeout-s", "60",
    "--wedge-timeout-s", "20", "--hicache-timeout-s", "1",
]  # fmt: skip


class Cluster:
    def __init__(self, model_dir: Path, log_dir: Path, stages: int = 2, redis: bool = True) -> None:
        self.model_dir, self.log_dir, self.stages = model_dir, log_dir, stages
        self.stage_hosts = [f"s{k}" for k in range(stages)]
        names = [*self.stage_hosts, "router", *(["redis"] if redis else [])]
        self.hosts = Hosts(names, front="router")
        self.url = f"http://{self.hosts.front_addr}:{ROUTER}"
        self.restarts = 0
        self.redis = redis
        log_dir.mkdir(parents=True, exist_ok=True)
        try:
            if redis:
                self._start_redis()
            self.start_group()
            self._start_router()
        except BaseException:
            self.hosts.close(check=False)
            raise

    def addr(self, host: str) -> str:
        return self.hosts.addr[host]

    def _start_redis(self) -> None:
        exe = shutil.which("redis-server")
        assert exe is not None, "redis-server is not installed"
        argv = [exe, "--bind", self.addr("redis"), "--port", str(REDIS), "--save", "", "--appendonly", "no"]
        self.hosts.spawn("redis", [*argv, "--protected-mode", "no"], self.log_dir / "redis.log")

    def start_group(self) -> None:
        """Every stage of the group, each on its host; the group forms on its own (TCP rendezvous)."""
        for rank, host in enumerate(self.stage_hosts):
            argv = [sys.executable, "-m", "pipeserve.cli", "stage", "--model", str(self.model_dir)]
            argv += ["--rank", str(rank), "--world-size", str(self.stages)]
            argv += ["--master-addr", self.addr("s0"), "--master-port", str(MASTER)]
            argv += ["--host", self.addr(host), "--health-port", str(HEALTH)]
            argv += ["--grpc-port", str(GRPC) if rank == 0 else "0", *STAGE_FLAGS]
            if self.redis:
                argv += ["--hicache-url", f"redis://{self.addr('redis')}:{REDIS}"]
            log = self.log_dir / f"{host}.{self.restarts}.log"
            parent = {"PIPESERVE_PARENT_PID": str(os.getpid())}  # no orphan if the test process dies
            self.hosts.spawn(host, argv, log, env=parent)

    def restart_group(self) -> None:
        """The operator's answer to a group stop: every stage killed, then all started together."""
        for host in self.stage_hosts:
            self.hosts.kill_host(host)
        self.restarts += 1
        self.start_group()

    def _start_router(self) -> None:
        argv = [sys.executable, "-m", "pipeserve.cli", "router", "--tokenizer", str(self.model_dir)]
        argv += ["--upstream", f"{self.addr('s0')}:{GRPC}", "--host", "0.0.0.0", "--port", str(ROUTER)]
        argv += ["--health-interval-s", "0.2", "--rpc-timeout-s", "1"]
        argv += ["--first-token-timeout-s", str(FIRST_TOKEN_S), "--stream-idle-timeout-s", str(STREAM_IDLE_S)]
        self.hosts.spawn("router", argv, self.log_dir / "router.log")

    def health_url(self, host: str) -> str:
        return f"http://{self.addr(host)}:{HEALTH}"

    def stage_exited(self) -> list[str]:
        """The stage hosts with no process left (a stopped group's stages exit)."""
        return [h for h in self.stage_hosts if not self.hosts.pids(h)]

    def wait_ready(self, timeout_s: float = 90) -> float:
        """Every stage's /readyz is 200 and the router's /health too; returns the seconds it took."""
        t0 = time.monotonic()

        def ready() -> bool:
            if gone := self.stage_exited():
                raise AssertionError(f"stages exited while starting: {gone}\n{self.log('s')[-3000:]}")
            try:
                urls = [self.health_url(h) + "/readyz" for h in self.stage_hosts] + [self.url + "/health"]
                return all(httpx.get(u, timeout=1).status_code == 200 for u in urls)
            except httpx.HTTPError:
                return False

        wait_until(ready, timeout_s, "every stage and the router ready", interval_s=0.1)
        return time.monotonic() - t0

    def blocks_used(self) -> dict[str, float | None]:
        """KV blocks held by requests: stage 0's pool, and each stage's own count as it reported it
        along the ring after the last step (a follower's side port has no engine gauges)."""
        text = httpx.get(self.health_url("s0") + "/metrics", timeout=2).text
        out = {"s0 pool": metric(text, "pipeserve:kv_blocks_used")}
        for rank, h in enumerate(self.stage_hosts):
            out[h] = metric(text, "pipeserve:group_stage_blocks_held", stage=str(rank))
        return out

    def assert_blocks_freed(self, timeout_s: float = 10) -> None:
        last: dict = {}

        def freed() -> bool:
            last.update(self.blocks_used())
            return all(v == 0 for v in last.values())

        try:
            wait_until(freed, timeout_s, "KV blocks back to 0 on every stage", interval_s=0.1)
        except AssertionError as e:
            raise AssertionError(f"{e}: {last}") from None

    def log(self, name: str) -> str:
        return "".join(p.read_text(errors="replace") for p in sorted(self.log_dir.glob(f"{name}*.log")))

    def close(self) -> None:
        self.hosts.close()
