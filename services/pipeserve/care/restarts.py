"""The one restart decision for a pipeline group: `pipeserve up`'s supervisor and the operator both call it.

    decide(record, observation, policy, now) -> Decision(action, record, phase, reason, stale)

Pure: no clock, no I/O, no logging. The caller observes (process exit statuses and side-port probes
locally; pods, container restart counts and probe-driven Ready conditions in Kubernetes), calls `decide`,
acts on the action, and keeps `Decision.record` for the next call (the operator persists it in the
resource's status, so an operator restart loses no backoff).

Why whole groups: a group that lost one stage cannot live (its communicator is broken), so a group is
never repaired stage by stage. Every failure of a stage means: stop *every* stage of the group in one
step, wait a backoff, start a new incarnation.

Generations. Every incarnation has a number (`record.generation`), stamped by the caller on the
processes or pods it starts for it (in Kubernetes, the StatefulSet template's `pipeserve.io/group-generation`
label). A stage observed with any other generation is *stale*: it never counts toward readiness, its
failures never cause a restart, and the decision lists its rank in `stale` for the caller to delete.
This is what keeps a StatefulSet controller that recreates one pod from the old template (before the
group's delete or template patch landed) from causing a second restart or a mixed group.

Actions (one per call):
* START: a new incarnation may begin (first start, or the restart backoff is over). The record's
  generation is the one to stamp; phase becomes Starting.
* RESTART: a stage of the current generation failed — it exited, its container restarted in place,
  it is wedged (liveness), its pod is being deleted, it is missing from a Ready group — or the group
  is not ready `startup_deadline_s` after its start. The caller stops every stage now (all of them are
  listed in `stale`; the record's generation is already the next one), and must not start the next
  incarnation before START. Backoff: `backoff_s * 2**failures_in_a_row`, capped at `backoff_max_s`; a
  group Ready for `stable_s` is forgiven its earlier failures.
* ROLL: a planned restart — the group is Ready but runs an older spec than the caller now wants
  (Kubernetes: its pods were made from a pod template that has since changed), and the caller allows
  it now (`may_roll`: the operator lets one group at a time roll, only while every other group is
  Ready, so capacity never drops by more than one group). Acted on like RESTART, but no backoff
  (the next START comes at once) and it counts in `rollouts`, not in `restarts`.
* FAIL: a stage exited with a status in `fatal_exit_codes` (cannot start: configuration or checkpoint)
  before the group was ever ready and before any restart, or `max_restarts` is used up. Retrying
  would not help; the group stays Failed (NONE from then on) until the caller resets the record (the
  operator: a new spec).
* NONE: nothing to do (maybe a phase change: Starting → Ready, Ready → Starting when a stage stops
  being ready, which the router must see).

Invariants (tested in tests/care/test_restarts.py, by tables and by a simulated StatefulSet controller):
phase Ready only when every rank has a running, ready stage of the current generation; one failure
causes at most one RESTART (the next generation's stages start clean); no START before the backoff ends.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field


class StageState(enum.Enum):
    PENDING = "pending"  # created, not running yet (pod Pending, container waiting, process starting)
    RUNNING = "running"
    EXITED = "exited"  # the process ended; the pod Failed or Succeeded


class GroupPhase(enum.Enum):
    """A group's phase, as `pipeserve up` reports it and the operator writes into status.groups[].phase
    (the restart decision's; a process's own lifecycle is lifecycle.ProcessPhase)."""

    PENDING = "Pending"  # never started
    STARTING = "Starting"
    READY = "Ready"
    RESTARTING = "Restarting"  # stopped after a failure, waiting out the backoff
    FAILED = "Failed"


class Action(enum.Enum):
    NONE = "none"
    START = "start"
    RESTART = "restart"
    ROLL = "roll"
    FAIL = "fail"


@dataclass(frozen=True)
class StageObservation:
    """What one stage process / pod is doing now."""

    rank: int
    generation: int  # the incarnation it was started for
    state: StageState = StageState.RUNNING
    ready: bool = False  # /readyz, or the pod's Ready condition
    wedged: str = ""  # non-empty: why it counts as wedged (/livez 503, unanswered, liveness-killed)
    restarts: int = 0  # container restarts in place (Kubernetes restartCount); 0 for a local process
    exit_code: int | None = None  # the last exit status (EXITED, or the container's last termination)
    deleting: bool = False  # the pod has a deletionTimestamp: someone else is removing it
    outdated: bool = False  # made from an older spec than the caller now wants (a changed pod template)


@dataclass(frozen=True)
class GroupObservation:
    world_size: int
    stages: tuple[StageObservation, ...] = ()  # any generation; the caller lists what exists
    may_roll: bool = True  # the caller allows a planned restart of this group now


@dataclass(frozen=True)
class RestartPolicy:
    startup_deadline_s: float = 900.0  # a new incarnation not Ready this long after START: restart
    backoff_s: float = 1.0
    backoff_max_s: float = 60.0
    stable_s: float = 60.0  # Ready this long: earlier failures are forgiven (the backoff starts over)
    fatal_exit_codes: frozenset[int] = frozenset({2})  # ExitCode.CANNOT_START
    max_restarts: int | None = None  # None: keep restarting (with backoff)

    def __post_init__(self) -> None:
        # Validated here too: the operator builds a policy from a resource's spec, not from EngineConfig.
        for name in ("startup_deadline_s", "backoff_s", "backoff_max_s", "stable_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0 (got {getattr(self, name)})")
        if self.backoff_max_s < self.backoff_s:
            raise ValueError(f"backoff_max_s: must be >= backoff_s (got {self.backoff_max_s})")
        if self.max_restarts is not None and self.max_restarts < 0:
            raise ValueError(f"max_restarts: must be >= 0 or None (got {self.max_restarts})")

    def backoff(self, failures_in_a_row: int) -> float:
        return min(self.backoff_max_s, self.backoff_s * 2 ** min(failures_in_a_row, 32))


@dataclass(frozen=True)
class GroupRecord:
    """What the caller keeps between calls (the operator: in status; plain JSON-able fields)."""

    generation: int = 0  # the incarnation to stamp on stages (0: none started yet)
    phase: GroupPhase = GroupPhase.PENDING
    started_at: float = 0.0  # START of this generation, or when a Ready group stopped being ready
    ready_at: float | None = None  # when this generation became Ready
    ever_ready: bool = False  # any generation was ever Ready (a fatal exit after that is not fatal)
    restarts: int = 0
    rollouts: int = 0  # planned restarts (ROLL)
    failures_in_a_row: int = 0
    restart_at: float = 0.0  # RESTARTING: the next START is not before this
    last_failure: str = ""

    def to_json(self) -> dict:
        return {
            f.name: (v.value if isinstance(v := getattr(self, f.name), GroupPhase) else v) for f in _FIELDS
        }

    @classmethod
    def from_json(cls, data: dict) -> GroupRecord:
        known = {f.name for f in _FIELDS}
        values = {k: v for k, v in data.items() if k in known}
        if "phase" in values:
            values["phase"] = GroupPhase(values["phase"])
        return cls(**values)


_FIELDS = dataclasses.fields(GroupRecord)


@dataclass(frozen=True)
class Decision:
    action: Action
    record: GroupRecord
    reason: str = ""
    stale: tuple[int, ...] = field(default=())  # ranks whose observed stage the caller must stop/delete
    delay_s: float = 0.0  # RESTART: the backoff before the next START

    @property
    def phase(self) -> GroupPhase:
        return self.record.phase

    @property
    def ready(self) -> bool:
        return self.record.phase is GroupPhase.READY


def decide(record: GroupRecord, obs: GroupObservation, policy: RestartPolicy, now: float) -> Decision:
    current = {s.rank: s for s in obs.stages if s.generation == record.generation}
    stale = tuple(sorted({s.rank for s in obs.stages if s.generation != record.generation}))
    phase = record.phase
    if phase is GroupPhase.FAILED:
        return Decision(Action.NONE, record, record.last_failure, stale)
    if phase is GroupPhase.PENDING:
        started = _replace(
            record, generation=record.generation + 1, phase=GroupPhase.STARTING, started_at=now
        )
        return Decision(Action.START, started, "first start", stale)
    if phase is GroupPhase.RESTARTING:
        # Stages of the stopped incarnation are stale now (the record names the next generation).
        if now < record.restart_at:
            return Decision(Action.NONE, record, record.last_failure, _all_ranks(obs))
        started = _replace(record, phase=GroupPhase.STARTING, started_at=now, ready_at=None)
        return Decision(Action.START, started, f"restart {record.restarts}", _all_ranks(obs))

    # STARTING or READY: only the current generation's stages count.
    failure, fatal = _failure(current, obs.world_size, phase, record, policy)
    if failure:
        fail = fatal or (policy.max_restarts is not None and record.restarts >= policy.max_restarts)
        if fail:
            failed = _replace(record, phase=GroupPhase.FAILED, last_failure=failure, ready_at=None)
            return Decision(Action.FAIL, failed, failure, _all_ranks(obs))
        return _restart(record, obs, policy, now, failure)

    all_ready = len(current) == obs.world_size and all(
        s.state is StageState.RUNNING and s.ready for s in current.values()
    )
    if all_ready:
        if phase is GroupPhase.STARTING:
            ready = _replace(record, phase=GroupPhase.READY, ready_at=now, ever_ready=True)
            return Decision(Action.NONE, ready, "ready", stale)
        if obs.may_roll and any(s.outdated for s in current.values()):
            rolled = _stop_generation(record, rollouts=record.rollouts + 1, restart_at=now)
            return Decision(Action.ROLL, rolled, "the spec changed: rolling update", _all_ranks(obs))
        if record.ready_at is not None and now - record.ready_at >= policy.stable_s:
            if record.failures_in_a_row:
                record = _replace(record, failures_in_a_row=0)
        return Decision(Action.NONE, record, "", stale)
    if phase is GroupPhase.READY:
        # A stage stopped being ready (draining, a readiness probe failing): out of routing, and a fresh
        # deadline to come back before the group is restarted.
        unready = _replace(record, phase=GroupPhase.STARTING, started_at=now, ready_at=None)
        return Decision(Action.NONE, unready, "a stage is not ready", stale)
    if now - record.started_at > policy.startup_deadline_s:
        return _restart(record, obs, policy, now, f"not ready {now - record.started_at:.0f}s after start")
    return Decision(Action.NONE, record, "", stale)


def _failure(
    current: dict[int, StageObservation],
    world_size: int,
    phase: GroupPhase,
    record: GroupRecord,
    policy: RestartPolicy,
) -> tuple[str, bool]:
    """(why the current generation failed, whether retrying is pointless); ("", False) when it did not."""
    for rank in range(world_size):
        s = current.get(rank)
        if s is None:
            if phase is GroupPhase.READY:
                return f"stage {rank} is gone", False
            continue  # a starting group's pods may not exist yet: the startup deadline covers it
        if s.state is StageState.EXITED or s.restarts > 0:
            how = "exited" if s.state is StageState.EXITED else "restarted in place after exiting"
            what = f"with status {s.exit_code}" if s.exit_code is not None else "(status unknown)"
            # Cannot start (configuration, checkpoint) on the very first try: a retry would fail alike.
            first_try = not record.ever_ready and record.restarts == 0
            if first_try and s.exit_code in policy.fatal_exit_codes:
                return f"stage {rank} cannot start (exited with status {s.exit_code})", True
            return f"stage {rank} {how} {what}", False
        if s.wedged:
            return f"stage {rank} is wedged: {s.wedged}", False
        if s.deleting:
            return f"stage {rank}'s pod is being deleted", False
        if phase is GroupPhase.READY and s.state is StageState.PENDING:
            # Recreated under the same generation (deleted and replaced between two looks): it cannot
            # join the running group's communicator.
            return f"stage {rank} was replaced", False
    return "", False


def _restart(
    record: GroupRecord, obs: GroupObservation, policy: RestartPolicy, now: float, cause: str
) -> Decision:
    delay = policy.backoff(record.failures_in_a_row)
    stopped = _stop_generation(
        record,
        restarts=record.restarts + 1,
        failures_in_a_row=record.failures_in_a_row + 1,
        restart_at=now + delay,
        last_failure=cause,
    )
    return Decision(Action.RESTART, stopped, cause, _all_ranks(obs), delay)


def _stop_generation(record: GroupRecord, **changes: object) -> GroupRecord:
    """The record once the current generation's pods are to go: the next one is what counts from now."""
    nxt = record.generation + 1
    return _replace(record, generation=nxt, phase=GroupPhase.RESTARTING, ready_at=None, **changes)


def _all_ranks(obs: GroupObservation) -> tuple[int, ...]:
    return tuple(sorted({s.rank for s in obs.stages}))


def _replace(record: GroupRecord, **changes: object) -> GroupRecord:
    return dataclasses.replace(record, **changes)  # type: ignore[arg-type]


# Fleet rules: which group may roll now, and whether a surge group is wanted. Pure, like `decide`; the
# operator calls them once per tick over every group it runs (`pipeserve up` runs one spec: no rolls).


@dataclass(frozen=True)
class FleetGroup:
    """One group of a fleet as the fleet rules see it."""

    index: int
    phase: GroupPhase
    outdated: bool = False  # its stages run an older spec than the caller now wants
    surge: bool = False  # it was started as a rollout's surge group (not a group left by a scale-down)


def max_surge(replicas: int, requested: int | None) -> int:
    """The surge groups a rollout may add: the request (0 or 1); unset, 1 for one group, else 0 (a lone
    group rolling in place would leave no group serving)."""
    if requested is None:
        return 1 if replicas == 1 else 0
    if requested not in (0, 1):
        raise ValueError(f"rollout.maxSurge: must be 0 or 1 (got {requested})")
    return requested


def may_roll(index: int, fleet: list[FleetGroup]) -> bool:
    """Group `index` may be taken down for a planned restart now: every other group (a surge group
    included) is Ready, so capacity drops by one group at most and some group always serves."""
    return all(g.phase is GroupPhase.READY for g in fleet if g.index != index)


def want_surge(replicas: int, surge: int, fleet: list[FleetGroup]) -> bool:
    """A surge group (index = replicas) is wanted while a rollout is under way: a regular group is
    outdated, or a surge group exists and a regular group has not come back Ready since it rolled (a
    group left over from a scale-down is no surge group: it never keeps a surge wanted)."""
    if surge < 1:
        return False
    regular = [g for g in fleet if g.index < replicas]
    surging = any(g.surge and g.index >= replicas for g in fleet)
    if any(g.outdated for g in regular):
        return True
    return surging and any(g.phase is not GroupPhase.READY for g in regular)
