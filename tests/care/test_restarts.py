"""The restart decision (care/restarts.py): tables, then a simulated StatefulSet controller.

The simulation plays what the operator faces in a cluster: a controller that recreates deleted pods
from the template it last saw (sometimes still the old generation), deletions that take a while,
pods that start slowly, and random stage failures. The operator's loop (observe → decide → act) runs
on top. Checked on every step: never a mixed or stale generation counted Ready, never a restart
without a failure of the current generation (or its startup deadline), at most one restart per
generation, no start before the backoff is over, and a group that stops failing becomes Ready.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeserve.care.restarts import (
    Action,
    Decision,
    GroupObservation,
    GroupPhase,
    GroupRecord,
    RestartPolicy,
    StageObservation,
    StageState,
    decide,
)

POLICY = RestartPolicy(startup_deadline_s=30.0, backoff_s=1.0, backoff_max_s=8.0, stable_s=20.0)


def ready_stages(gen: int, n: int = 2, **overrides) -> tuple[StageObservation, ...]:
    stages = [StageObservation(rank=r, generation=gen, ready=True) for r in range(n)]
    return tuple(dataclasses.replace(s, **overrides) if s.rank == 1 else s for s in stages)


def started(gen: int = 1, at: float = 0.0) -> GroupRecord:
    return GroupRecord(generation=gen, phase=GroupPhase.STARTING, started_at=at)


def ready_record(gen: int = 1, at: float = 0.0) -> GroupRecord:
    return GroupRecord(generation=gen, phase=GroupPhase.READY, started_at=at, ready_at=at, ever_ready=True)


# --- tables --------------------------------------------------------------------------------------


def test_first_call_starts_generation_one() -> None:
    d = decide(GroupRecord(), GroupObservation(2), POLICY, 0.0)
    assert (d.action, d.phase, d.record.generation) == (Action.START, GroupPhase.STARTING, 1)


def test_all_stages_of_the_generation_ready_makes_the_group_ready() -> None:
    d = decide(started(), GroupObservation(2, ready_stages(1)), POLICY, 5.0)
    assert (d.action, d.phase, d.record.ready_at) == (Action.NONE, GroupPhase.READY, 5.0)
    assert d.record.ever_ready


@pytest.mark.parametrize(
    ("stage", "cause"),
    [
        ({"state": StageState.EXITED, "exit_code": 1}, "stage 1 exited with status 1"),
        ({"restarts": 1, "exit_code": 137}, "stage 1 restarted in place after exiting with status 137"),
        ({"wedged": "no progress for 60s"}, "stage 1 is wedged: no progress for 60s"),
        ({"deleting": True}, "stage 1's pod is being deleted"),
        ({"state": StageState.PENDING, "ready": False}, "stage 1 was replaced"),
    ],
)
def test_any_stage_failure_restarts_the_whole_group(stage: dict, cause: str) -> None:
    d = decide(ready_record(), GroupObservation(2, ready_stages(1, **stage)), POLICY, 100.0)
    assert d.action is Action.RESTART and d.reason == cause
    assert d.stale == (0, 1)  # every stage stops, not only the failed one
    assert (d.record.generation, d.record.restarts, d.phase) == (2, 1, GroupPhase.RESTARTING)
    assert d.delay_s == 1.0 and d.record.restart_at == 101.0


def test_a_missing_stage_of_a_ready_group_restarts_it() -> None:
    d = decide(ready_record(), GroupObservation(2, ready_stages(1)[:1]), POLICY, 3.0)
    assert (d.action, d.reason) == (Action.RESTART, "stage 1 is gone")


def test_a_starting_group_waits_for_missing_stages_until_its_deadline() -> None:
    obs = GroupObservation(2, ready_stages(1)[:1])
    assert decide(started(at=0.0), obs, POLICY, 29.0).action is Action.NONE
    d = decide(started(at=0.0), obs, POLICY, 31.0)
    assert (d.action, d.reason) == (Action.RESTART, "not ready 31s after start")


def test_stale_generation_never_counts_and_never_restarts() -> None:
    # Rank 1 exists only as a pod of the old generation, which has failed: it is listed for deletion,
    # the new generation is not ready, and nothing is restarted.
    stages = (
        StageObservation(0, generation=2, ready=True),
        StageObservation(1, generation=1, ready=True, state=StageState.EXITED, exit_code=1, restarts=3),
    )
    d = decide(started(gen=2), GroupObservation(2, stages), POLICY, 1.0)
    assert (d.action, d.phase, d.stale) == (Action.NONE, GroupPhase.STARTING, (1,))


def test_backoff_doubles_caps_and_is_forgiven_after_stable() -> None:
    rec, now, delays = ready_record(), 0.0, []
    for _ in range(6):
        d = decide(rec, GroupObservation(2, ready_stages(rec.generation, wedged="x")), POLICY, now)
        delays.append(d.delay_s)
        early = decide(d.record, GroupObservation(2), POLICY, d.record.restart_at - 0.01)
        assert early.action is Action.NONE  # no start before the backoff ends
        s = decide(d.record, GroupObservation(2), POLICY, d.record.restart_at)
        assert s.action is Action.START and s.record.generation == d.record.generation
        now = d.record.restart_at
        rec = decide(s.record, GroupObservation(2, ready_stages(s.record.generation)), POLICY, now).record
    assert delays == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    stable = decide(rec, GroupObservation(2, ready_stages(rec.generation)), POLICY, now + 20.0)
    assert stable.record.failures_in_a_row == 0 and stable.record.restarts == 6


def test_cannot_start_on_first_try_fails_but_later_it_restarts() -> None:
    bad = ready_stages(1, state=StageState.EXITED, exit_code=2)
    d = decide(started(), GroupObservation(2, bad), POLICY, 1.0)
    assert (d.action, d.phase) == (Action.FAIL, GroupPhase.FAILED)
    assert "cannot start" in d.reason
    assert decide(d.record, GroupObservation(2, bad), POLICY, 50.0).action is Action.NONE  # stays failed
    after_ready = dataclasses.replace(started(), ever_ready=True)
    assert decide(after_ready, GroupObservation(2, bad), POLICY, 1.0).action is Action.RESTART


def test_max_restarts_fails_the_group() -> None:
    policy = dataclasses.replace(POLICY, max_restarts=2)
    rec = dataclasses.replace(ready_record(), restarts=2)
    d = decide(rec, GroupObservation(2, ready_stages(1, wedged="x")), policy, 1.0)
    assert d.action is Action.FAIL


def test_a_stage_no_longer_ready_takes_the_group_out_then_back() -> None:
    d = decide(ready_record(), GroupObservation(2, ready_stages(1, ready=False)), POLICY, 7.0)
    assert (d.action, d.phase, d.record.started_at) == (Action.NONE, GroupPhase.STARTING, 7.0)
    back = decide(d.record, GroupObservation(2, ready_stages(1)), POLICY, 8.0)
    assert back.phase is GroupPhase.READY


def test_an_outdated_ready_group_rolls_when_allowed_without_backoff_or_a_restart_count() -> None:
    outdated = ready_stages(1, outdated=True)
    held = decide(ready_record(), GroupObservation(2, outdated, may_roll=False), POLICY, 5.0)
    assert (held.action, held.phase) == (Action.NONE, GroupPhase.READY)  # another group is rolling
    d = decide(ready_record(), GroupObservation(2, outdated), POLICY, 5.0)
    assert (d.action, d.phase, d.stale, d.delay_s) == (Action.ROLL, GroupPhase.RESTARTING, (0, 1), 0.0)
    assert (d.record.generation, d.record.rollouts, d.record.restarts, d.record.failures_in_a_row) == (
        2,
        1,
        0,
        0,
    )
    again = decide(d.record, GroupObservation(2, outdated), POLICY, 5.0)  # the old pods are still there
    assert again.action is Action.START and again.stale == (0, 1)
    # A starting group becomes Ready first (and rolls on a later look, like any Ready group); a failed
    # stage is a failure, not a roll.
    assert decide(started(), GroupObservation(2, outdated), POLICY, 5.0).action is Action.NONE
    failed = ready_stages(1, outdated=True, wedged="stuck")
    assert decide(ready_record(), GroupObservation(2, failed), POLICY, 5.0).action is Action.RESTART


def test_record_round_trips_through_json() -> None:
    rec = dataclasses.replace(ready_record(gen=4), restarts=3, last_failure="stage 0 is wedged")
    assert GroupRecord.from_json(rec.to_json()) == rec
    assert GroupRecord.from_json({**rec.to_json(), "unknown": 1}) == rec


def test_policy_is_validated() -> None:
    with pytest.raises(ValueError, match="backoff_max_s"):
        RestartPolicy(backoff_s=5.0, backoff_max_s=1.0)
    with pytest.raises(ValueError, match="startup_deadline_s"):
        RestartPolicy(startup_deadline_s=0)


# --- a simulated StatefulSet controller ----------------------------------------------------------


@dataclass
class Pod:
    generation: int
    created: int
    state: StageState = StageState.PENDING
    ready: bool = False
    restarts: int = 0
    exit_code: int | None = None
    wedged: str = ""
    deleting_until: int | None = None  # deleted: gone at this tick


@dataclass
class Cluster:
    """One group's StatefulSet (template generation + replicas) and its pods, one tick a second."""

    stages: int
    template: int = 0
    replicas: int = 0
    seen_template: int = 0  # the controller's (possibly stale) view of the template
    pods: dict[int, Pod] = dataclasses.field(default_factory=dict)

    def controller(self, tick: int, lag: bool) -> None:
        if not lag:
            self.seen_template = self.template
        for rank in range(self.stages):
            pod = self.pods.get(rank)
            if pod is not None and pod.deleting_until is not None and tick >= pod.deleting_until:
                del self.pods[rank]
                pod = None
            if pod is None and rank < self.replicas:
                self.pods[rank] = Pod(self.seen_template, tick)
            elif pod is not None and rank >= self.replicas and pod.deleting_until is None:
                pod.deleting_until = tick + 1

    def kubelet(self, tick: int, start_ticks: int) -> None:
        for pod in self.pods.values():
            if pod.state is StageState.PENDING and tick - pod.created >= start_ticks:
                pod.state = StageState.RUNNING
            elif pod.state is StageState.RUNNING and not pod.wedged and pod.deleting_until is None:
                pod.ready = True

    def delete(self, rank: int, tick: int, slow: bool) -> None:
        pod = self.pods.get(rank)
        if pod is not None and pod.deleting_until is None:
            pod.deleting_until = tick + (3 if slow else 1)
            pod.ready = False

    def observe(self) -> GroupObservation:
        return GroupObservation(
            self.stages,
            tuple(
                StageObservation(
                    rank=r,
                    generation=p.generation,
                    state=p.state,
                    ready=p.ready,
                    restarts=p.restarts,
                    exit_code=p.exit_code,
                    wedged=p.wedged,
                    deleting=p.deleting_until is not None,
                )
                for r, p in sorted(self.pods.items())
            ),
        )


FAULTS = ("restart", "exit", "wedge", "delete")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    stages=st.integers(1, 4),
    start_ticks=st.integers(0, 4),
    events=st.lists(
        st.tuples(st.integers(0, 80), st.integers(0, 3), st.sampled_from(FAULTS), st.booleans()),
        max_size=8,
    ),
    lags=st.sets(st.integers(0, 120), max_size=25),
)
def test_simulated_statefulset_controller(stages: int, start_ticks: int, events: list, lags: set) -> None:
    policy = RestartPolicy(startup_deadline_s=15.0, backoff_s=1.0, backoff_max_s=4.0, stable_s=10.0)
    cluster = Cluster(stages)
    record = GroupRecord()
    faulted: set[int] = set()  # generations that had a failure injected
    restarted: list[int] = []  # the generation each RESTART stopped
    stop_at: dict[int, float] = {}  # generation -> earliest allowed START
    last_fault = max((t for t, *_ in events), default=0)
    ready_after_faults = False
    for tick in range(200):
        cluster.controller(tick, lag=tick in lags)
        cluster.kubelet(tick, start_ticks)
        for t, rank, kind, slow in events:
            pod = cluster.pods.get(rank % stages)
            if t != tick or pod is None or pod.state is not StageState.RUNNING:
                continue
            faulted.add(pod.generation)
            if kind == "restart":  # the kubelet restarted the container in place
                pod.restarts, pod.exit_code, pod.ready = pod.restarts + 1, 1, False
            elif kind == "exit":
                pod.state, pod.exit_code, pod.ready = StageState.EXITED, 1, False
            elif kind == "wedge":
                pod.wedged, pod.ready = "no progress", False
            else:
                cluster.delete(rank % stages, tick, slow)

        before = record
        d = decide(record, cluster.observe(), policy, float(tick))
        record = d.record
        check(d, before, cluster, faulted, restarted, stop_at, tick)
        # The operator acts: stale pods deleted; RESTART = new template generation, replicas 0, every
        # pod deleted in one step; START = replicas back to S.
        for rank in d.stale:
            cluster.delete(rank, tick, slow=False)
        if d.action is Action.RESTART:
            restarted.append(before.generation)
            stop_at[record.generation] = tick + d.delay_s
            cluster.template, cluster.replicas = record.generation, 0
        elif d.action is Action.START:
            cluster.template, cluster.replicas = record.generation, stages
        if tick > last_fault and d.ready:
            ready_after_faults = True
    assert len(restarted) == len(set(restarted)), "two restarts of one generation"
    assert record.phase is not GroupPhase.FAILED
    assert ready_after_faults, f"never ready after the last fault: {record}"


def check(
    d: Decision,
    before: GroupRecord,
    cluster: Cluster,
    faulted: set[int],
    restarted: list[int],
    stop_at: dict[int, float],
    tick: int,
) -> None:
    if d.ready:
        gens = {p.generation for p in cluster.pods.values()}
        ready = [p for p in cluster.pods.values() if p.ready and p.generation == d.record.generation]
        assert len(ready) == cluster.stages, f"Ready with {len(ready)}/{cluster.stages} stages ({gens})"
    if d.action is Action.RESTART:
        assert before.generation not in restarted, "a second restart for one failure"
        deadline = d.reason.startswith("not ready")
        assert deadline or before.generation in faulted, f"restart without a failure: {d.reason}"
    if d.action is Action.START and d.record.generation in stop_at:
        assert tick >= stop_at[d.record.generation], "started before the backoff ended"
