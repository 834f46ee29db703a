"""The ordering rules of ring/transport.py, each pinned with live stage processes over gloo.

Every rule has a correct run and a *can-fail* variant that breaks the rule on
purpose (ring/faults.py). The variant must be caught by the deadlines —
the group stops with a line naming what it waited for, within ring_timeout
plus a margin — instead of hanging the suite; for the deadline rule itself,
the variant is shown to hang past the bound and the test cleans it up.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import msgspec
import pytest

from conftest import hf_greedy, random_prompts
from pipeline_support import (
    SILENT_STAGE_1,
    CongruenceWatch,
    kill_quietly,
    pid_alive,
    step_until_stopped,
    stop_reasons,
    wait_dead,
)
from pipeserve import LLM, SamplingParams
from pipeserve.errors import GroupStopped
from pipeserve.ring.faults import ENV, Faults

RING_TIMEOUT = 3.0
BOUND = RING_TIMEOUT + 6  # a broken rule must be reported within this


def use_faults(monkeypatch: pytest.MonkeyPatch, **kw) -> None:
    monkeypatch.setenv(ENV, msgspec.json.encode(Faults(**kw)).decode())


def ring(model_dir: Path, stages: int, log_dir: Path, **kw) -> LLM:
    return LLM(
        str(model_dir),
        stages=stages,
        max_model_len=256,
        num_kv_blocks=64,
        max_num_batched_tokens=16,  # several plans can be in the ring at once
        ring_timeout_s=RING_TIMEOUT,
        heartbeat_s=0.5,
        log_dir=str(log_dir),
        **kw,
    )


PROMPTS = random_prompts(8, 10, 40, 1024, seed=41)


def run(llm: LLM) -> tuple[str, float, object]:
    """('completed', seconds, outputs) or ('stopped', seconds, every stage's GROUP STOP reason)."""
    t0 = time.monotonic()
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8))
    except GroupStopped as e:
        seconds = time.monotonic() - t0
        llm.shutdown()
        return "stopped", seconds, "\n".join(stop_reasons(llm, e))
    finally:
        llm.shutdown()
    return "completed", time.monotonic() - t0, outs


# --- rules 1 and 2: receives posted ahead, sends never block the loop ----------------
@pytest.mark.parametrize("stages", [2, 3])
def test_full_ring_completes_with_async_sends_and_standing_receives(
    llama_dir: Path, tmp_path: Path, stages: int
) -> None:
    llm = ring(llama_dir, stages, tmp_path)
    watch = CongruenceWatch(llm)
    verdict, _, outs = run(llm)
    assert verdict == "completed", outs
    assert watch.max_inflight_seen == stages, "the ring was never full: the rule was not exercised"
    for p, o in zip(PROMPTS, outs, strict=True):  # type: ignore[arg-type]
        assert o.outputs[0].token_ids == hf_greedy(llama_dir, p, 8)


@pytest.mark.slow  # waits out ring deadlines
@pytest.mark.parametrize("stages", [2, 3])
def test_can_fail_blocking_io_deadlocks_and_the_deadline_reports_it(
    llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stages: int
) -> None:
    use_faults(monkeypatch, blocking_io=True)
    verdict, seconds, message = run(ring(llama_dir, stages, tmp_path))
    assert verdict == "stopped", "the naive transport did not deadlock: the test cannot see the rule"
    assert "deadline: send of" in str(message) and seconds < BOUND, (seconds, message)


# --- rule 3: stage 0 sends what it owes before waiting on the return link -----------
@pytest.mark.slow  # waits out ring deadlines
def test_can_fail_waiting_on_the_return_link_before_sending_is_caught(
    llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    use_faults(monkeypatch, return_first=True)
    verdict, seconds, message = run(ring(llama_dir, 3, tmp_path))
    assert verdict == "stopped" and seconds < BOUND, (verdict, seconds, message)
    # Stage 0 holds the plan, so every stage starves waiting on its predecessor and all
    # three deadlines expire together; whichever fires first names the starved link.
    starved = [
        f"stage {k}: deadline: no frame from stage {(k - 1) % 3} within {RING_TIMEOUT:g}s" for k in range(3)
    ]
    assert any(line in str(message) for line in starved), message


# --- rule 4: every wait has a deadline; an idle ring stays inside them ---------------
@pytest.mark.slow  # waits out ring deadlines
@pytest.mark.parametrize("no_heartbeat", [False, True], ids=["heartbeats", "can-fail-no-heartbeat"])
def test_idle_ring_is_not_a_failure(
    llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_heartbeat
) -> None:
    use_faults(monkeypatch, no_heartbeat=no_heartbeat)
    llm = ring(llama_dir, 3, tmp_path)
    pids = list(llm.group.pids.values())
    time.sleep(2.5 * RING_TIMEOUT)  # idle for longer than any deadline
    verdict, _, result = run(llm)
    if no_heartbeat:
        assert verdict == "stopped" and "deadline" in str(result), (verdict, result)
        assert not wait_dead(pids, 10)
    else:
        assert verdict == "completed", result


@pytest.mark.slow  # waits out ring deadlines
@pytest.mark.parametrize("no_deadline", [False, True], ids=["deadlines", "can-fail-no-deadline"])
def test_silent_peer_is_reported_within_the_deadline(
    llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_deadline: bool
) -> None:
    use_faults(monkeypatch, no_deadline=no_deadline)
    llm = ring(llama_dir, 3, tmp_path)
    pids = llm.group.pids
    for p in PROMPTS:
        llm.engine.add_request(p, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    llm.engine.step()
    kill_quietly(pids[1], signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        err = step_until_stopped(llm, BOUND)
        if no_deadline:
            # The broken rule: nothing reports the hang; the harness sees it at its bound.
            assert err is None and pid_alive(pids[2]), "a wait without deadline still ended"
        else:
            assert err is not None and time.monotonic() - t0 < BOUND, "stage 0 waited forever"
            assert not wait_dead([pids[2]], BOUND), "stage 2 waited on stopped stage 1 forever"
            named = [r for r in stop_reasons(llm, err) if SILENT_STAGE_1.search(r)]
            assert named, stop_reasons(llm, err)
    finally:
        kill_quietly(pids[1], signal.SIGKILL)  # unblocks every wait of the hung variant
        llm.shutdown()
    assert not wait_dead(list(pids.values()), 10)
