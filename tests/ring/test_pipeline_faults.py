"""Group stops: a corrupted plan, a killed stage, a stopped (hung) stage.

Each case runs a real group (stage 0 here, stages 1..S-1 as processes over
gloo) and checks that the whole group stops within a bounded time: stage 0's
generate raises GroupStopped naming the cause, the stage that detected it
logs exactly one GROUP STOP line naming it, and no stage process is left.
"""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import msgspec
import pytest

from conftest import random_prompts
from pipeline_support import (
    SILENT_STAGE_1,
    group_stop_lines,
    kill_quietly,
    stage_log,
    step_until_stopped,
    stop_reasons,
    wait_dead,
)
from pipeserve import LLM, SamplingParams
from pipeserve.errors import Diverged, ExitCode, GroupStopped
from pipeserve.ring.faults import ENV, Faults

RING_TIMEOUT = 3.0

CORRUPTIONS = [
    # (kind, corrupting rank, detecting rank, what the detector's line must say)
    ("digest", 0, 1, r"stage 1: step \d+: digest 0x[0-9a-f]+ != plan's 0x[0-9a-f]+"),
    ("block_range", 1, 2, r"stage 2: step \d+: 'req-\d+' block ids \[\d+\] outside pool of 48"),
    ("unknown_request", 0, 1, r"stage 1: step \d+: chunk for unknown request 'req-\d+-corrupt'"),
    ("rows", 1, 2, r"stage 2: received (\d+) activation rows for a (?!\1)\d+-token plan"),
    # Stage 2 says it executed another plan: stage 0 compares the digests that come back.
    (
        "report_digest",
        2,
        0,
        r"step \d+: stages executed a different plan: digest 0x[0-9a-f]+, "
        r"stages reported \[\(2, \d+\)\]",
    ),
]


def group(model_dir: Path, tmp_path: Path, **kw) -> LLM:
    return LLM(
        str(model_dir),
        stages=3,
        max_model_len=256,
        num_kv_blocks=48,
        ring_timeout_s=RING_TIMEOUT,
        heartbeat_s=0.5,
        log_dir=str(tmp_path),
        **kw,
    )


@pytest.mark.parametrize(("kind", "rank", "detector", "pattern"), CORRUPTIONS)
def test_corrupted_plan_stops_the_whole_group(
    llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind, rank, detector, pattern
) -> None:
    faults = Faults(corrupt=kind, corrupt_rank=rank, corrupt_step=3)
    monkeypatch.setenv(ENV, msgspec.json.encode(faults).decode())
    llm = group(llama_dir, tmp_path)
    pids = list(llm.group.pids.values())
    t0 = time.monotonic()
    try:
        with pytest.raises(GroupStopped) as err:
            llm.generate(
                random_prompts(4, 5, 30, 1024, seed=31), SamplingParams(temperature=0, max_tokens=16)
            )
        assert re.search(pattern, str(err.value)), str(err.value)
        assert not wait_dead(pids, 15), "a stage outlived the group stop"
        assert time.monotonic() - t0 < 15
        # Stage 0 raises Diverged for what it found itself; a follower's find reaches it as a Stop.
        assert isinstance(err.value, Diverged) == (detector == 0), repr(err.value)
        # The stage that found it exits DIVERGED (the restart's cause), the others followed its stop.
        want = {r: ExitCode.DIVERGED if r == detector else ExitCode.GROUP_STOP for r in llm.group.pids}
        assert llm.group.exited() == want
        if detector > 0:  # stage 0's line is the error checked above
            lines = group_stop_lines(stage_log(tmp_path, detector))
            assert len(lines) == 1 and re.search(pattern, lines[0]), lines
    finally:
        llm.shutdown()


def _running_group(llm: LLM) -> None:
    """Put long requests in the ring and step until every stage has executed plans."""
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    for p in random_prompts(6, 10, 40, 1024, seed=32):
        llm.engine.add_request(p, params)
    for _ in range(6):
        llm.engine.step()


@pytest.mark.parametrize("victim", [1, 2])
def test_killed_stage_stops_the_others_within_the_deadline(
    llama_dir: Path, tmp_path: Path, victim: int
) -> None:
    llm = group(llama_dir, tmp_path)
    try:
        _running_group(llm)
        pids = llm.group.pids
        t0 = time.monotonic()
        kill_quietly(pids[victim], signal.SIGKILL)
        err = step_until_stopped(llm, RING_TIMEOUT + 5)
        assert err is not None, "stage 0 kept waiting after a stage died"
        others = [pid for rank, pid in pids.items() if rank != victim]
        assert not wait_dead(others, RING_TIMEOUT + 5), "a stage kept waiting on a dead peer"
        assert time.monotonic() - t0 < RING_TIMEOUT + 5
        assert all(rc == ExitCode.GROUP_STOP for r, rc in llm.group.exited().items() if r != victim)
    finally:
        llm.shutdown()


@pytest.mark.slow  # waits out ring deadlines
def test_stopped_stage_is_caught_by_the_deadline(llama_dir: Path, tmp_path: Path) -> None:
    """SIGSTOP: the peer is alive but silent; only deadlines can end the waits (rule 4)."""
    llm = group(llama_dir, tmp_path)
    pids = llm.group.pids
    try:
        _running_group(llm)
        t0 = time.monotonic()
        kill_quietly(pids[1], signal.SIGSTOP)
        err = step_until_stopped(llm, RING_TIMEOUT + 5)
        assert err is not None, "stage 0 waited forever on a stopped stage"
        assert not wait_dead([pids[2]], RING_TIMEOUT + 5), "stage 2 waited forever on a stopped stage 1"
        assert time.monotonic() - t0 < 2 * RING_TIMEOUT + 5
        reasons = stop_reasons(llm, err)
        named = [r for r in reasons if SILENT_STAGE_1.search(r)]
        assert named, reasons
        assert len(group_stop_lines(stage_log(tmp_path, 2))) == 1
    finally:
        kill_quietly(pids[1], signal.SIGCONT)
        llm.shutdown()
    assert not wait_dead(list(pids.values()), 10)
