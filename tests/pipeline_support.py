"""Helpers for pipeline-group tests: per-step congruence watching, process and log checks."""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

from pipeserve import LLM
from pipeserve.engine.plan import StepOutput, StepPlan
from pipeserve.errors import GroupStopped


class CongruenceWatch:
    """Checks, for every step, that each stage holds the request tables stage 0 holds.

    Stage 0's runner applies plan k before sending it, so its table sizes right
    after submit(k) are what every follower must report in the result of k.
    Wraps the real executor's submit/collect; records the largest number of
    plans that were in the ring at once.
    """

    def __init__(self, llm: LLM) -> None:
        self.executor = llm.engine.executor
        self.runner = llm.engine.executor.runner
        self.expected: dict[int, tuple[int, int]] = {}
        self.held_reqs: dict[int, frozenset[str]] = {}  # step -> request ids in the tables after it
        self.reported: dict[int, list[tuple[int, int]]] = {}  # step -> [(num_reqs, blocks)] by rank
        self.last_step = 0
        self.mismatches: list[tuple[int, int, tuple[int, int], tuple[int, int]]] = []
        self.max_inflight_seen = 0
        self.shared_chunks = 0  # plans sent while another plan in the ring held the same request
        self._ring: dict[int, set[str]] = {}
        self.steps = 0
        submit, collect = self.executor.submit, self.executor.collect

        def watched_submit(plan: StepPlan) -> None:
            ids = {c.req_id for c in plan.chunks}
            self.shared_chunks += any(ids & other for other in self._ring.values())
            self._ring[plan.step_id] = ids
            submit(plan)
            self.expected[plan.step_id] = (len(self.runner.reqs), len(self.runner.block_refs))
            self.held_reqs[plan.step_id] = frozenset(self.runner.reqs)
            self.max_inflight_seen = max(self.max_inflight_seen, self.executor.num_inflight)

        def watched_collect() -> StepOutput:
            out = collect()
            want = self.expected.pop(out.step_id)
            self._ring.pop(out.step_id)
            self.steps += 1
            self.last_step = out.step_id
            self.reported[out.step_id] = [(r.num_reqs, r.blocks_held) for r in out.reports]
            for r in out.reports:
                if (r.num_reqs, r.blocks_held) != want:
                    self.mismatches.append((out.step_id, r.rank, (r.num_reqs, r.blocks_held), want))
            return out

        self.executor.submit = watched_submit  # type: ignore[method-assign]
        self.executor.collect = watched_collect  # type: ignore[method-assign]

    def check(self) -> None:
        assert self.steps > 0, "no step was watched"
        assert not self.mismatches, f"stage tables diverged (step, rank, got, want): {self.mismatches[:3]}"


def pid_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def wait_dead(pids: list[int], timeout_s: float) -> list[int]:
    """Wait until every pid is gone; returns those still alive at the deadline."""
    deadline = time.monotonic() + timeout_s
    while (alive := [p for p in pids if pid_alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def stage_log(log_dir: Path, rank: int) -> str:
    path = log_dir / f"stage-{rank}.log"
    return path.read_text() if path.is_file() else ""


def group_stop_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "GROUP STOP:" in line]


# How a stage names a silent stage 1: waiting for (part of) a frame from it, or for it
# to take a send (a stage stopped mid-frame leaves its successor waiting on the rest).
SILENT_STAGE_1 = re.compile(
    r"deadline: ((no frame|frame body|activations) from stage 1|send of \w+ to stage 1 not completed)"
)


def stop_reasons(llm: LLM, err: BaseException | None) -> list[str]:
    """Stage 0's error and every follower's GROUP STOP line (needs log_dir).

    Stages with similar deadlines detect a silent peer at about the same time;
    whichever exits first turns the others' waits into broken links, so a
    test looks for the named cause among all stages' lines.
    """
    log_dir = Path(llm.engine.config.log_dir or "")
    lines = [f"stage 0: {err}"] if err is not None else []
    for rank in range(1, llm.engine.config.stages):
        lines += group_stop_lines(stage_log(log_dir, rank))
    return lines


def step_until_stopped(llm: LLM, bound_s: float) -> GroupStopped | None:
    """Step on a thread; the error it stopped with, or None if it still ran after bound_s."""
    result: list[BaseException] = []

    def loop() -> None:
        try:
            while llm.engine.has_unfinished():
                llm.engine.step()
        except GroupStopped as e:
            result.append(e)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    t.join(bound_s)
    return result[0] if result else None  # type: ignore[return-value]


def kill_quietly(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def stage_processes(parent_pid: int) -> list[int]:
    """Live stage processes started by `parent_pid` (found by PIPESERVE_PARENT_PID in /proc)."""
    marker = f"PIPESERVE_PARENT_PID={parent_pid}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if marker in env and pid_alive(int(entry.name)):
            found.append(int(entry.name))
    return found
