"""ReplicaSet: the pipeline groups behind the router, their health, and picking one.

Contract:
* `ReplicaSet(config, targets, registry)` with targets = group name -> stage 0's
  "host:port". Nothing async happens in the constructor; `start()` (inside the
  event loop that will serve requests: grpc.aio channels belong to one loop)
  opens one channel per group and starts one poller task per group, which calls
  Health and then Load every `health_interval_s`, each with an `rpc_timeout_s`
  deadline. A failed or timed-out poll makes the group unready.
* A group is routable when its last Health said ready and it is not marked
  down. `set_down(name, reason)` (the supervisor saw the group die) takes it
  out at once. It comes back only once polls *sent after* set_down have seen
  it unready (or unreachable) and then ready again: a reply already in flight,
  or a dying stage 0 that has not yet noticed its group stopped, cannot undo it.
* `pick(prompt_ids, exclude)` applies `config.policy` (see policy.py) to the
  routable groups; `acquire`/`release` keep the router's own in-flight count per
  group, which least_load reads.
* Logs one line per readiness change of a group, never per poll.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

import grpc
from prometheus_client import CollectorRegistry

from pipeserve.config import RouterConfig
from pipeserve.errors import ConfigError
from pipeserve.lifecycle import Phase
from pipeserve.router import policy
from pipeserve.router.metrics import GroupMetrics
from pipeserve.router.policy import GroupState
from pipeserve.rpc import generation_pb2 as pb
from pipeserve.rpc import generation_pb2_grpc as pb_grpc

SLOW_POLLS = 3  # Health polls in a row that time out before a group is taken out of routing

log = logging.getLogger("pipeserve.router")

# A restarted group listens on the same address again within seconds; gRPC's default
# reconnect backoff (1 s growing to 120 s) would leave it unused for minutes.
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class ReplicaSet:
    def __init__(self, config: RouterConfig, targets: dict[str, str], registry: CollectorRegistry) -> None:
        if not targets:
            raise ConfigError("targets: need at least one group")
        for name, target in targets.items():
            if not name or ":" not in target:
                raise ConfigError(f"targets: expected name -> 'host:port' (got {name!r} -> {target!r})")
        self.config = config
        self.groups = {name: GroupState(name, target) for name, target in targets.items()}
        self.metrics = GroupMetrics(registry)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, pb_grpc.GenerationStub] = {}
        self._tasks: list[asyncio.Task] = []
        self._turn = 0
        for g in self.groups.values():
            self._export(g)

    # --- lifecycle -----------------------------------------------------------
    async def start(self) -> None:
        for name, g in self.groups.items():
            self._channels[name] = grpc.aio.insecure_channel(g.target, options=CHANNEL_OPTIONS)
            self._stubs[name] = pb_grpc.GenerationStub(self._channels[name])
        self._tasks = [
            asyncio.create_task(self._poll_loop(g), name=f"router-poll-{g.name}")
            for g in self.groups.values()
        ]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        await asyncio.gather(
            *(ch.close(grace=None) for ch in self._channels.values()), return_exceptions=True
        )
        self._channels.clear()
        self._stubs.clear()

    async def poll_once(self) -> None:
        """Poll every group now (start-up, tests); the background pollers keep running."""
        await asyncio.gather(*(self._poll(g) for g in self.groups.values()))

    async def wait_ready(self, count: int = 1, timeout_s: float = 60.0) -> bool:
        """True once at least `count` groups are routable; False after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while len(self.ready_groups()) < count:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(min(0.05, self.config.health_interval_s))
        return True

    # --- supervisor hooks ----------------------------------------------------
    def set_down(self, name: str, reason: str) -> None:
        g = self.groups[name]
        was = g.routable
        g.down_reason = reason
        g.down_at = time.monotonic()
        g.down_seen_unready = False
        if was:
            log.warning("group %s marked down: %s", name, reason)
        self._export(g)

    def mark_unready(self, name: str, reason: str) -> None:
        """A Generate call found the group unavailable; the next ready poll brings it back."""
        g = self.groups[name]
        if g.ready:
            g.ready = False
            g.status = reason
            if g.down_reason is None:
                log.warning("group %s not ready: %s", name, reason)
            self._export(g)

    def snapshot(self) -> list[dict]:
        now = time.monotonic()
        return [
            {
                "name": g.name,
                "target": g.target,
                "ready": g.routable,
                "status": f"down: {g.down_reason}" if g.down_reason is not None else g.status,
                "running": g.running,
                "waiting": g.waiting,
                "kv_blocks_used": g.kv_blocks_used,
                "kv_blocks_total": g.kv_blocks_total,
                "seconds_since_token": self.seconds_since_token(g, now),
                "inflight": g.inflight,
            }
            for g in self.groups.values()
        ]

    # --- routing -------------------------------------------------------------
    def ready_groups(self, exclude: Sequence[str] = ()) -> list[GroupState]:
        return policy.candidates(self.groups.values(), exclude)

    def pick(self, prompt_ids: Sequence[int], exclude: Sequence[str] = ()) -> GroupState | None:
        groups = self.ready_groups(exclude)
        chosen = policy.pick(
            self.config.policy, groups, prompt_ids, self._turn, self.config.affinity_overload
        )
        self._turn += 1
        return chosen

    def stub(self, name: str) -> pb_grpc.GenerationStub:
        return self._stubs[name]

    def acquire(self, name: str) -> None:
        g = self.groups[name]
        g.inflight += 1
        self.metrics.inflight.labels(name).set(g.inflight)

    def release(self, name: str) -> None:
        g = self.groups[name]
        g.inflight -= 1
        self.metrics.inflight.labels(name).set(g.inflight)

    def limits(self) -> tuple[int, int] | None:
        """(max_model_len, vocab_size) as reported by the groups (the smallest of those that answered)."""
        known = [g for g in self.groups.values() if g.max_model_len > 0 and g.vocab_size > 0]
        if not known:
            return None
        return min(g.max_model_len for g in known), min(g.vocab_size for g in known)

    @staticmethod
    def seconds_since_token(g: GroupState, now: float) -> float:
        """Health's figure aged by the time since that reply; -1 if the group never produced a token."""
        if g.seconds_since_token < 0 or g.polled_at == 0:
            return -1.0
        return g.seconds_since_token + (now - g.polled_at)

    # --- polling -------------------------------------------------------------
    async def _poll_loop(self, g: GroupState) -> None:
        while True:
            try:
                await self._poll(g)
            except Exception:  # a bug here must not silently stop polling this group
                log.exception("polling group %s failed", g.name)
                g.ready = False
                self._export(g)
            await asyncio.sleep(self.config.health_interval_s)

    async def _poll(self, g: GroupState) -> None:
        sent = time.monotonic()
        stub = self._stubs.get(g.name)
        if stub is None:
            return
        was = g.routable
        timeout = self.config.rpc_timeout_s
        try:
            health = await stub.Health(pb.HealthRequest(), timeout=timeout)
            load = await stub.Load(pb.LoadRequest(), timeout=timeout) if health.ready else None
        except grpc.aio.AioRpcError as e:
            # Refused: the process is gone, stop routing now. A timeout may be a busy machine:
            # like a readiness probe's failureThreshold, only SLOW_POLLS in a row make it unready.
            g.slow_polls += 1
            if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED or g.slow_polls >= SLOW_POLLS:
                g.ready = False
                g.status = f"unreachable: {e.code().name}"
                g.phase = None
                if g.down_reason is not None and sent > g.down_at:
                    g.down_seen_unready = True
        else:
            g.slow_polls = 0
            g.polled_at = time.monotonic()
            g.ready = health.ready and health.max_model_len > 0
            g.status = health.status or ("ready" if health.ready else "not ready")
            g.phase = Phase.of_status(g.status)
            g.max_model_len = health.max_model_len or g.max_model_len
            g.vocab_size = health.vocab_size or g.vocab_size
            g.seconds_since_token = health.seconds_since_token
            g.running, g.waiting = health.running, health.waiting
            if load is not None:
                g.running, g.waiting = load.running, load.waiting
                g.kv_blocks_used, g.kv_blocks_total = load.kv_blocks_used, load.kv_blocks_total
                g.pending_tokens = load.pending_tokens
            g.inflight_at_poll = g.inflight
            if g.down_reason is not None and sent > g.down_at:
                if not g.ready:
                    g.down_seen_unready = True
                elif g.down_seen_unready:
                    g.down_reason = None
        if g.routable != was:
            if g.routable:
                log.info("group %s ready (%s)", g.name, g.target)
            else:
                log.warning("group %s not ready: %s", g.name, g.status)
        self._export(g)

    def _export(self, g: GroupState) -> None:
        m = self.metrics
        m.ready.labels(g.name).set(1 if g.routable else 0)
        m.running.labels(g.name).set(g.running)
        m.waiting.labels(g.name).set(g.waiting)
        m.kv_used.labels(g.name).set(g.kv_blocks_used)
        m.kv_total.labels(g.name).set(g.kv_blocks_total)
        m.inflight.labels(g.name).set(g.inflight)
