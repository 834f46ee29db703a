"""The flight recorder and `pipeserve replay` (obs/flight.py, ring/replay.py).

A real 2-stage group records its plans; stage 0 dumps through the API, stage 1 on SIGUSR1, and
`pipeserve replay` (a real CLI process) finds every plan in agreement. A second group whose stage 0
corrupts a plan in flight stops: both stages' dumps are written and named in their log lines, and
replay names the corrupted plan as the first that differs, for what it is (its digest). Also: the
memory bound, a window that starts mid-run, a wedge's dump, unknown versions refused, no pickle.
"""

from __future__ import annotations

import ast
import logging
import os
import random
import re
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import msgspec
import pytest

from conftest import random_prompts
from pipeserve import LLM, SamplingParams
from pipeserve.care.wedge import WedgeDetector
from pipeserve.errors import GroupStopped
from pipeserve.obs.flight import (
    RECORD_OVERHEAD,
    VERSION,
    FlightFormatError,
    FlightRecorder,
    StageSetup,
    read_dump,
)
from pipeserve.ring.faults import ENV, Faults
from pipeserve.ring.messages import Forward, decode_frame
from pipeserve.ring.replay import replay

SETUP = StageSetup("0:2,2:4", 16, 48, 256, "float32", 0, 1, 0, False)
SRC = Path(__file__).resolve().parents[2] / "services" / "pipeserve"


def group(model_dir: Path, tmp_path: Path, **kw) -> LLM:
    return LLM(
        str(model_dir),
        stages=2,
        max_model_len=256,
        num_kv_blocks=48,
        host_cache_gb=0,
        ring_timeout_s=5.0,
        heartbeat_s=0.5,
        log_dir=str(tmp_path / "logs"),
        flight_dir=str(tmp_path / "flight"),
        **kw,
    )


def replay_cli(dump: Path, model: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pipeserve.cli", "replay", str(dump), "--model", str(model), *extra],
        capture_output=True,
        text=True,
        timeout=300,
    )


def wait_for_dump(directory: Path, rank: int, timeout_s: float = 20.0) -> Path:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = sorted(directory.glob(f"flight-*-rank{rank}-*.msgpack"))
        if found:
            return found[-1]
        time.sleep(0.1)
    raise AssertionError(f"no rank {rank} dump in {directory} within {timeout_s}s")


def named_in_log(text: str, path: Path) -> bool:
    return any(f"flight record written: {path} (" in line for line in text.splitlines())


@pytest.mark.slow
def test_a_recorded_run_replays_in_agreement(llama_dir: Path, tmp_path: Path) -> None:
    llm = group(llama_dir, tmp_path)
    try:
        llm.generate(random_prompts(6, 5, 40, 1024, seed=3), SamplingParams(temperature=0, max_tokens=12))
        leader = llm.engine.executor.flight  # type: ignore[attr-defined]
        dump0 = leader.dump("test")
        os.kill(llm.group.pids[1], signal.SIGUSR1)  # stage 1 writes its own
        dump1 = wait_for_dump(tmp_path / "flight", 1)
    finally:
        llm.shutdown()
    assert dump0 is not None and dump0.parent == tmp_path / "flight"
    assert named_in_log((tmp_path / "logs" / "stage-1.log").read_text(), dump1)
    d0, d1 = read_dump(dump0), read_dump(dump1)
    assert (d0.rank, d1.rank, d0.version, d0.dropped) == (0, 1, VERSION, 0)
    assert "thread MainThread" in d0.stacks and "flight-dump" in d1.stacks  # every thread's stack
    assert [r.step_id for r in d0.records] == list(range(1, len(d0.records) + 1))
    assert all(r.out is not None and r.act_digest is not None for r in d0.records if decode_plan(r).chunks)
    assert [r.step_id for r in d1.records] == [r.step_id for r in d0.records]
    for r in d0.records:  # stage 0 keeps the plan as sent, sealed with the digest it recorded
        assert decode_plan(r).digest == r.digest
    for dump in (dump0, dump1):
        run = replay_cli(dump, llama_dir)
        assert run.returncode == 0, run.stdout + run.stderr
        assert f"all {len(d0.records)} plans agree (exact window)" in run.stdout
    run = replay_cli(dump1, llama_dir, "--stage", "1", "--json")
    assert run.returncode == 0 and msgspec.json.decode(run.stdout)["plans"] == len(d0.records)

    # Activations are compared bitwise (same plan, kernels and thread count on the CPU): one flipped bit
    # in a recorded digest is named, at its step.
    k = next(i for i, r in enumerate(d0.records) if r.act_digest is not None and i > 4)
    flipped = [*d0.records]
    flipped[k] = msgspec.structs.replace(flipped[k], act_digest=flipped[k].act_digest ^ 1)
    found = replay(dump0, str(llama_dir), None, msgspec.structs.replace(d0, records=flipped)).first
    assert found is not None and found.step_id == d0.records[k].step_id
    assert found.what.startswith("stage 0 activations differ"), found.what

    # The same dump, as if the bound had dropped its first ten plans: a window that starts mid-run.
    late = msgspec.structs.replace(d0, records=d0.records[10:], dropped=10)
    (cut := tmp_path / "cut.msgpack").write_bytes(msgspec.msgpack.encode(late))
    report = msgspec.json.decode(replay_cli(cut, llama_dir, "--json").stdout)
    assert (report["status"], report["exact"], report["first"]) == (0, False, None), report
    assert report["skipped"], "requests whose history began before the window must be named"


def test_a_quantized_group_replays_with_its_quantized_weights(llama_dir: Path, tmp_path: Path) -> None:
    """The dump names the quantization: replay loads the int8 weights the group ran, so activations
    agree bitwise (a replay in float32 differs at the first step that carries activations)."""
    llm = group(llama_dir, tmp_path, quantization="int8")
    try:
        llm.generate(random_prompts(3, 5, 30, 1024, seed=5), SamplingParams(temperature=0, max_tokens=6))
        dump0 = llm.engine.executor.flight.dump("test")  # type: ignore[attr-defined]
    finally:
        llm.shutdown()
    assert dump0 is not None
    d0 = read_dump(dump0)
    assert (d0.setup.quantization, d0.setup.quantization_group_size) == ("int8", 32)
    run = replay_cli(dump0, llama_dir)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"all {len(d0.records)} plans agree" in run.stdout


def decode_plan(rec):
    fwd = decode_frame(rec.forward)
    assert isinstance(fwd, Forward)
    return fwd.plan


@pytest.mark.slow
def test_replay_names_the_plan_corrupted_in_flight(
    llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(
        ENV, msgspec.json.encode(Faults(corrupt="digest", corrupt_rank=0, corrupt_step=3)).decode()
    )
    llm = group(llama_dir, tmp_path)
    try:
        with caplog.at_level(logging.WARNING, logger="pipeserve.obs.flight"):
            with pytest.raises(GroupStopped):
                llm.generate(
                    random_prompts(4, 5, 30, 1024, seed=31), SamplingParams(temperature=0, max_tokens=16)
                )
    finally:
        llm.shutdown()
    dump0 = wait_for_dump(tmp_path / "flight", 0)
    dump1 = wait_for_dump(tmp_path / "flight", 1)
    assert named_in_log(caplog.text, dump0)
    assert named_in_log((tmp_path / "logs" / "stage-1.log").read_text(), dump1)
    bad = next(r for r in read_dump(dump0).records if decode_plan(r).chunks and r.step_id >= 3)
    reqs = ", ".join(sorted({c.req_id for c in decode_plan(bad).chunks}))
    for dump in (dump0, dump1):  # stage 1 recorded the plan it received before refusing it
        run = replay_cli(dump, llama_dir)
        assert run.returncode == 1, run.stdout + run.stderr
        line = run.stdout.strip()
        assert len(line.splitlines()) == 1
        assert f"step {bad.step_id} differs (requests {reqs}): digest: the plan's bytes hash to" in line
        assert "altered in flight" in line


def test_the_bound_holds_by_count_and_by_bytes(tmp_path: Path) -> None:
    rng = random.Random(5)
    rec = FlightRecorder(0, 2, SETUP, max_records=500, max_bytes=1 << 20, directory=tmp_path)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        pushed = 0
        for step in range(1, 20_001):
            r = rec.record(step, rng.randbytes(rng.randint(50, 12_000)), step, step)
            pushed += 1
            if step % 3:
                rec.complete(r, rng.randbytes(rng.randint(50, 4_000)))
            assert len(rec) <= 500 and rec.nbytes <= 1 << 20
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert rec.dropped == pushed - len(rec)
    records = rec.snapshot("t").records
    assert rec.nbytes == sum(len(r.forward) + len(r.out or b"") + RECORD_OVERHEAD for r in records)
    assert held <= 1 << 20, f"the recorder holds {held} bytes, over its 1 MiB bound"
    assert [r.step_id for r in records] == list(range(20_001 - len(records), 20_001))  # oldest dropped

    small = FlightRecorder(0, 2, SETUP, max_records=100, max_bytes=64 << 20, directory=tmp_path)
    for step in range(1, 1001):
        small.record(step, b"x" * 10)
    assert (len(small), small.dropped) == (100, 900)
    off = FlightRecorder(0, 2, SETUP, max_records=0, max_bytes=1 << 20, directory=tmp_path)
    assert off.record(1, b"x") is None and off.dump("t") is None and len(off) == 0


def test_a_wedge_writes_the_dump(tmp_path: Path) -> None:
    rec = FlightRecorder(1, 2, SETUP, 10, 1 << 20, tmp_path, group="g/1")
    rec.record(1, b"plan")
    detector = WedgeDetector(
        "stage 1", lambda: "1 frame queued", timeout_s=0.01, grace_s=0, exit_fn=lambda c: None
    )
    detector.on_wedge = lambda: rec.dump(f"wedge: {detector.report}")
    assert detector.check(time.monotonic() + 1.0)
    (path,) = rec.dumps
    assert re.fullmatch(r"flight-g_1-rank1-\d{8}T\d{6}\.\d{6}Z\.msgpack", path.name)
    dump = read_dump(path)
    assert dump.reason.startswith("wedge: stage 1: no progress") and dump.records[0].forward == b"plan"


def test_another_version_or_a_foreign_file_is_refused(tmp_path: Path, llama_dir: Path) -> None:
    rec = FlightRecorder(0, 2, SETUP, 10, 1 << 20, tmp_path)
    rec.record(1, b"plan")
    path = rec.dump("t")
    assert path is not None
    raw = msgspec.msgpack.decode(path.read_bytes())
    raw["version"] = 99
    (future := tmp_path / "future.msgpack").write_bytes(msgspec.msgpack.encode(raw))
    with pytest.raises(FlightFormatError, match="version 99 is not supported"):
        read_dump(future)
    (foreign := tmp_path / "foreign.msgpack").write_bytes(b"\x93\x01\x02\x03")
    with pytest.raises(FlightFormatError, match="not a pipeserve flight dump"):
        read_dump(foreign)
    run = replay_cli(future, llama_dir)
    assert (
        run.returncode == 2 and "version 99 is not supported (this pipeserve reads version 1)" in run.stderr
    )


def test_no_pickle_in_the_recorder_or_replay() -> None:
    for path in (SRC / "obs" / "flight.py", SRC / "obs" / "stacks.py", SRC / "ring" / "replay.py"):
        tree = ast.parse(path.read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not names & {"pickle", "cPickle", "dill", "marshal", "shelve"}, path
        assert "torch.load(" not in path.read_text() and "pickle.load" not in path.read_text(), path
