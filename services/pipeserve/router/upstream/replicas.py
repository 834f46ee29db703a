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
* `pick(prompt_ids, exclude)` applies `self.policy` (config.policy unless set) to the
  routable groups; `acquire`/`release` keep the router's own in-flight count per
  group, which least_load reads.
* Logs one line per readiness change of a group, never per poll.

Dynamic membership (discovery, router/upstream/discovery.py): `set_targets(targets)`,
called inside the loop, makes the set of groups equal `targets`. A new name
gets a channel and a poller, and is routable once its own Health says ready.
A removed name leaves routing (and `snapshot`, `limits`, its metrics labels)
at once; its requests in flight go on, on its channel, and its poller is
cancelled and its channel closed once they have ended, or after
`retire_grace_s` (default: first_token_timeout_s + stream_idle_timeout_s)
whatever is left, so nothing waits unboundedly. A changed target for a name is
a removal and an addition; a name added back with the same target while it is
still retiring takes its retiring channel back (its requests still count), but
is routable again only after a poll says ready. `targets` may be empty (the
router then answers 503 until a group is ready); `pipeserve up` passes fixed
targets and never calls set_targets.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
from prometheus_client import CollectorRegistry

from pipeserve.config import RouterConfig
from pipeserve.errors import ConfigError
from pipeserve.lifecycle import ProcessPhase
from pipeserve.router.upstream import policy
from pipeserve.router.upstream.groups import GroupState, candidates
from pipeserve.router.upstream.metrics import GroupMetrics
from pipeserve.rpc import generation_pb2 as pb
from pipeserve.rpc import generation_pb2_grpc as pb_grpc

SLOW_POLLS = 3  # Health polls in a row that time out before a group is taken out of routing

UNROUTABLE_POLL_S = 0.05  # Health poll period of a group that is not routable

log = logging.getLogger("pipeserve.router")

# A restarted group listens on the same address again within seconds; gRPC's default
# reconnect backoff (1 s growing to 120 s) would leave it unused for minutes. The cap also bounds
# how long after a starting stage begins to listen the router connects (start-up time: at 250 ms
# the router saw a ready stage ~0.2 s late): a reconnect to a closed port every 100 ms costs one
# refused SYN.
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 100),
]


def check_targets(targets: dict[str, str]) -> None:
    for name, target in targets.items():
        if not name or ":" not in target:
            raise ConfigError(f"targets: expected name -> 'host:port' (got {name!r} -> {target!r})")


@dataclass(eq=False)
class _Link:
    """One group's connection: its state, channel, stub and poller (kept together while it retires)."""

    state: GroupState
    channel: grpc.aio.Channel | None = None
    stub: pb_grpc.GenerationStub | None = None
    poller: asyncio.Task | None = None
    closer: asyncio.Task | None = None  # set while it retires


class ReplicaSet:
    def __init__(
        self,
        config: RouterConfig,
        targets: dict[str, str],
        registry: CollectorRegistry,
        retire_grace_s: float | None = None,
    ) -> None:
        check_targets(targets)
        self.config = config
        self.policy = config.policy  # the picking policy; discovery may set it (spec.router.policy)
        self.retire_grace_s = (
            config.first_token_timeout_s + config.stream_idle_timeout_s
            if retire_grace_s is None
            else retire_grace_s
        )
        self.groups = {name: GroupState(name, target) for name, target in targets.items()}
        self.metrics = GroupMetrics(registry)
        self._links: dict[str, _Link] = {name: _Link(g) for name, g in self.groups.items()}
        self._retiring: dict[str, list[_Link]] = {}  # removed names whose requests may still run
        self._started = False
        self._turn = 0
        for g in self.groups.values():
            self._export(g)

    # --- lifecycle -----------------------------------------------------------
    async def start(self) -> None:
        self._started = True
        for link in self._links.values():
            self._open(link)

    def _open(self, link: _Link) -> None:
        g = link.state
        link.channel = grpc.aio.insecure_channel(g.target, options=CHANNEL_OPTIONS)
        link.stub = pb_grpc.GenerationStub(link.channel)
        link.poller = asyncio.create_task(self._poll_loop(g), name=f"router-poll-{g.name}")

    async def close(self) -> None:
        self._started = False
        links = [*self._links.values(), *(r for rs in self._retiring.values() for r in rs)]
        tasks = [t for link in links for t in (link.poller, link.closer) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(
            *(link.channel.close(grace=None) for link in links if link.channel is not None),
            return_exceptions=True,
        )
        for link in links:
            link.channel = link.stub = link.poller = link.closer = None
        self._retiring.clear()

    # --- membership ----------------------------------------------------------
    def set_targets(self, targets: dict[str, str]) -> None:
        """Make the groups equal `targets` (name -> stage 0's host:port); call inside the loop."""
        check_targets(targets)
        for name in [n for n, g in self.groups.items() if targets.get(n) != g.target]:
            self._remove(name)
        for name, target in targets.items():
            if name not in self.groups:
                self._add(name, target)

    def _add(self, name: str, target: str) -> None:
        retiring = self._retiring.get(name, [])
        back = next((r for r in retiring if r.state.target == target), None)
        if back is not None:  # added back before its requests ended: the same channel, a fresh readiness
            retiring.remove(back)
            if not retiring:
                self._retiring.pop(name, None)
            if back.closer is not None:
                back.closer.cancel()
                back.closer = None
            link = back
            link.state.ready = False
            link.state.status = "added back; waiting for a ready poll"
            if link.poller is not None:  # poll now, not at the old poller's next turn
                link.poller.cancel()
                link.poller = asyncio.create_task(self._poll_loop(link.state), name=f"router-poll-{name}")
        else:
            link = _Link(GroupState(name, target))
            if self._started:
                self._open(link)
        self._links[name] = link
        self.groups[name] = link.state
        log.info("group %s added (%s)", name, target)
        self._export(link.state)

    def _remove(self, name: str) -> None:
        link = self._links.pop(name)
        g = self.groups.pop(name)
        log.info("group %s removed from routing (%s; %d in flight)", name, g.target, g.inflight)
        m = self.metrics
        for gauge in (m.ready, m.running, m.waiting, m.kv_used, m.kv_total, m.inflight):
            try:
                gauge.remove(name)
            except KeyError:  # never exported
                pass
        if link.channel is None:  # not started: nothing to close
            return
        self._retiring.setdefault(name, []).append(link)
        link.closer = asyncio.create_task(self._retire(name, link), name=f"router-retire-{name}")

    async def _retire(self, name: str, link: _Link) -> None:
        deadline = time.monotonic() + self.retire_grace_s
        while link.state.inflight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if link.state.inflight > 0:
            log.warning("group %s: closing with %d requests still in flight", name, link.state.inflight)
        retiring = self._retiring.get(name, [])
        if link in retiring:
            retiring.remove(link)
        if not retiring:
            self._retiring.pop(name, None)
        if link.poller is not None:
            link.poller.cancel()
            await asyncio.gather(link.poller, return_exceptions=True)
        if link.channel is not None:
            await link.channel.close(grace=None)
        link.channel = link.stub = link.poller = link.closer = None

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
        g = self.groups.get(name)
        if g is None:  # removed meanwhile: out of routing already
            return
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
        return candidates(self.groups.values(), exclude)

    def pick(self, prompt_ids: Sequence[int], exclude: Sequence[str] = ()) -> GroupState | None:
        groups = self.ready_groups(exclude)
        chosen = policy.pick(self.policy, groups, prompt_ids, self._turn, self.config.affinity_overload)
        self._turn += 1
        return chosen

    def stub(self, name: str) -> pb_grpc.GenerationStub:
        """The group's stub, or a retiring one's (an Abort of its request); KeyError once closed."""
        link = self._links.get(name)
        if link is None or link.stub is None:
            link = next((r for r in reversed(self._retiring.get(name, [])) if r.stub is not None), None)
        if link is None or link.stub is None:
            raise KeyError(name)
        return link.stub

    def acquire(self, name: str) -> None:
        g = self.groups[name]  # only a routable group is picked, so it is current
        g.inflight += 1
        self.metrics.inflight.labels(name).set(g.inflight)

    def release(self, name: str) -> None:
        g = self.groups.get(name)
        if g is None or g.inflight == 0:
            # A request on a removed group (or on an older target of this name) ended: the
            # retiring link's count is what lets it close as soon as its last stream ends.
            old = next((r.state for r in self._retiring.get(name, []) if r.state.inflight > 0), None)
            if old is not None:
                old.inflight -= 1
                return
        if g is not None:
            g.inflight = max(0, g.inflight - 1)
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
            # A group not routable (starting, or coming back) is polled fast so it serves as soon as its
            # Health turns ready, not up to an interval later (start-up time); a poll of a group that is
            # not listening fails at once on its channel, so this costs little while one stays down.
            fast = not g.routable
            await asyncio.sleep(
                min(UNROUTABLE_POLL_S, self.config.health_interval_s)
                if fast
                else self.config.health_interval_s
            )

    async def _poll(self, g: GroupState) -> None:
        sent = time.monotonic()
        link = self._links.get(g.name)
        if link is None or link.state is not g:  # retiring: its state no longer routes anything
            link = next((r for r in self._retiring.get(g.name, []) if r.state is g), None)
        stub = link.stub if link is not None else None
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
            g.phase = ProcessPhase.of_status(g.status)
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
        if self.groups.get(g.name) is not g:  # removed (retiring): its labels are gone for good
            return
        m = self.metrics
        m.ready.labels(g.name).set(1 if g.routable else 0)
        m.running.labels(g.name).set(g.running)
        m.waiting.labels(g.name).set(g.waiting)
        m.kv_used.labels(g.name).set(g.kv_blocks_used)
        m.kv_total.labels(g.name).set(g.kv_blocks_total)
        m.inflight.labels(g.name).set(g.inflight)
