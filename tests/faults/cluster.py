"""A pipeline group, its router and Redis, each stage on a host of its own (netns.Hosts).

    hosts:  s0 .. s{S-1}  one stage each: `pipeserve stage --rank k --master-addr s0.pipeserve
                          --host <own address>` (gloo binds to --host: the hostname resolves to
                          loopback here, see netns.py)
            router        `pipeserve router --upstream s0.pipeserve:GRPC`, on 0.0.0.0 (back and
                          front links)
            redis         redis-server bound to its own address, every stage's L3
                          (redis://redis.pipeserve), pages written on first computation

Peers are named as the operator names them (a DNS name per pod: here every host's hosts file), so a
host that comes back with a new address is found again. The ring (gloo), gRPC and Redis traffic all
cross the bridge, so a link fault on a host is a fault between machines. Every host is its own
network namespace, so every process listens on the same fixed ports. There is no supervisor here:
`restart_group()` does what the operator does on a group stop (every stage of the group, together,
with a fresh rendezvous).
Deadlines are short so that a fault test ends in seconds: the ring's (`RING_TIMEOUT_S`), the
wedge detector's (`WEDGE_TIMEOUT_S`), the router's first message and
stream idle deadlines, Redis calls' (1 s).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import httpx
import redis
from netns import Hosts

from pipeserve.errors import ExitCode
from pipeserve.hicache.page import PageError, PageLayout, decode_page
from serving_support import metric, wait_compilers, wait_until

GRPC, HEALTH, MASTER, ROUTER, REDIS = 50051, 8080, 29500, 8000, 6379
RING_TIMEOUT_S = 4.0  # a silent peer stops the group after this long
WEDGE_TIMEOUT_S = 20.0  # work pending and no progress this long: the stage reports a wedge and exits
READY_AFTER_HEAL_S = WEDGE_TIMEOUT_S + 10  # the bound on the time from a heal to the group Ready
FIRST_TOKEN_S, STREAM_IDLE_S = 8.0, 6.0  # the router's Generate deadlines
BLOCK = 16
STAGE_FLAGS = [
    "--num-threads", "1", "--num-kv-blocks", "64", "--max-model-len", "256", "--max-num-seqs", "8",
    "--ring-timeout-s", str(RING_TIMEOUT_S), "--heartbeat-s", "0.5", "--connect-timeout-s", "60",
    "--wedge-timeout-s", str(WEDGE_TIMEOUT_S), "--hicache-timeout-s", "1", "--block-size", str(BLOCK),
    "--hicache-write-policy", "always",
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
        self.stage_procs: dict[str, list] = {h: [] for h in self.stage_hosts}  # each start's Popen
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
            argv += ["--master-addr", "s0.pipeserve", "--master-port", str(MASTER)]
            argv += ["--host", self.addr(host), "--health-port", str(HEALTH)]
            argv += ["--grpc-port", str(GRPC) if rank == 0 else "0", *STAGE_FLAGS]
            if self.redis:
                argv += ["--hicache-url", f"redis://redis.pipeserve:{REDIS}"]
            log = self.log_dir / f"{host}.{self.restarts}.log"
            parent = {"PIPESERVE_PARENT_PID": str(os.getpid())}  # no orphan if the test process dies
            self.stage_procs[host].append(self.hosts.spawn(host, argv, log, env=parent))

    def restart_group(self) -> None:
        """The operator's answer to a group stop: every stage killed, then all started together."""
        for host in self.stage_hosts:
            self.hosts.kill_host(host)
        self.restarts += 1
        self.start_group()

    def _start_router(self) -> None:
        argv = [sys.executable, "-m", "pipeserve.cli", "router", "--tokenizer", str(self.model_dir)]
        argv += ["--upstream", f"s0.pipeserve:{GRPC}", "--host", "0.0.0.0", "--port", str(ROUTER)]
        argv += ["--health-interval-s", "0.2", "--rpc-timeout-s", "1"]
        argv += ["--first-token-timeout-s", str(FIRST_TOKEN_S), "--stream-idle-timeout-s", str(STREAM_IDLE_S)]
        self.hosts.spawn("router", argv, self.log_dir / "router.log")

    def reset(self) -> None:
        """Between tests (one cluster serves the whole suite): every fault healed, and the group
        restarted whole if a stage of it is gone or it is not ready."""
        self.hosts.heal_all()
        try:
            healthy = not self.stage_exited() and self._ready()
        except httpx.HTTPError:
            healthy = False
        if not healthy:
            self.restart_group()
            self.wait_ready()
        self.wait_compilers()  # each test starts on a warm group (its structured requests compile)

    def _ready(self) -> bool:
        urls = [self.health_url(h) + "/readyz" for h in self.stage_hosts] + [self.url + "/health"]
        return all(httpx.get(u, timeout=1).status_code == 200 for u in urls)

    def health_url(self, host: str) -> str:
        return f"http://{self.addr(host)}:{HEALTH}"

    def stage_exited(self) -> list[str]:
        """The stage hosts whose stage process (of the last start) has exited (a stopped group's
        stages exit)."""
        return [h for h in self.stage_hosts if self.stage_procs[h][-1].poll() is not None]

    def exit_codes(self) -> list[int | None]:
        return [p.poll() for procs in self.stage_procs.values() for p in procs]

    def assert_never_diverged(self) -> None:
        """No stage of any start saw the group execute different plans (it exits DIVERGED)."""
        codes = self.exit_codes()
        assert ExitCode.DIVERGED not in codes, f"a stage exited DIVERGED: {codes}"

    def wait_ready(self, timeout_s: float = 90) -> float:
        """Every stage's /readyz is 200 and the router's /health too; returns the seconds it took."""
        t0 = time.monotonic()

        def ready() -> bool:
            if gone := self.stage_exited():
                raise AssertionError(f"stages exited while starting: {gone}\n{self.failure_report()}")
            try:
                return self._ready()
            except httpx.HTTPError:
                return False

        wait_until(ready, timeout_s, "every stage and the router ready", interval_s=0.1)
        return time.monotonic() - t0

    def wait_compilers(self, timeout_s: float = 120) -> None:
        """Stage 0's grammar compiler workers are up (serving_support.wait_compilers)."""
        wait_compilers(self.health_url("s0"), timeout_s)

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

    def l3_pages(self) -> tuple[int, int]:
        """(complete, partial) blocks in Redis: a block is complete when every stage's page of it is
        there. Every page must decode under its key's layout (magic, shape, checksum: no torn or
        mixed-up page) and the pages of one block must agree on its tokens. A partial block is legal
        (each stage writes its own pages, a cut drops some): stage 0 never loads it."""
        r = redis.Redis(host=self.addr("redis"), port=REDIS, socket_timeout=5, socket_connect_timeout=5)
        blocks: dict[tuple[str, str], dict[int, int]] = {}
        try:
            for key in r.scan_iter("pipeserve:*", count=1000):
                _, fingerprint, tag, stage, block = key.decode().split(":")
                value = r.get(key)
                if value is None:  # gone meanwhile (eviction): a miss, fine
                    continue
                try:
                    _, tokens = decode_page(_layout(fingerprint, tag, int(stage)), value)
                except PageError as e:
                    raise AssertionError(f"L3 page {key!r} is unusable: {e.kind}: {e}") from None
                blocks.setdefault((fingerprint, block), {})[int(stage)] = tokens
        finally:
            r.close()
        complete = 0
        for (_, block), pages in blocks.items():
            assert len(set(pages.values())) == 1, f"block {block}: stages' pages disagree on tokens {pages}"
            complete += sorted(pages) == list(range(self.stages))
        return complete, len(blocks) - complete

    def stage0_metric(self, name: str, **labels: str) -> float:
        text = httpx.get(self.health_url("s0") + "/metrics", timeout=2).text
        return metric(text, name, **labels) or 0.0

    def failure_report(self, lines: int = 40) -> str:
        """The last `lines` lines of every process's log, each under its name (printed when a test
        fails: a start-up that fails once in many runs is found from this)."""
        out = []
        for path in sorted(self.log_dir.glob("*.log")):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"==== {path.name} (last {len(tail)} lines)\n" + "\n".join(tail))
        return "\n".join(out)

    def log(self, name: str) -> str:
        return "".join(p.read_text(errors="replace") for p in sorted(self.log_dir.glob(f"{name}*.log")))

    def close(self) -> None:
        self.hosts.close()


def _layout(fingerprint: str, tag: str, stage: int) -> PageLayout:
    """A page's layout from its key's tag (page.py: "<dtype>-b<block>-l<lo>_<hi>-h<heads>x<dim>")."""
    import torch

    dtype, b, layers, heads = tag.split("-")
    lo, hi = layers[1:].split("_")
    kv_heads, head_dim = heads[1:].split("x")
    return PageLayout(
        fingerprint, stage, int(lo), int(hi), int(b[1:]), int(kv_heads), int(head_dim), getattr(torch, dtype)
    )
