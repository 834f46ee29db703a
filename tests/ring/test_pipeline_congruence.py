"""Start-up congruence of `pipeserve stage` processes (the command a pod runs).

Stages agree on the model fingerprint, the layer split, block size, context
length and dtype, and take the group minimum of KV blocks; a difference stops
the group at start-up with a line naming both values. Configuration comes from
flags or from PIPESERVE_* environment variables. Rendezvous is a file, so no
test process listens on a port.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeserve.errors import ExitCode


class Stage:
    def __init__(self, tmp: Path, rank: int, args: list[str], env: dict[str, str] | None = None) -> None:
        self.log = tmp / f"cli-stage-{rank}.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pipeserve.cli", "stage", *args],
                env=dict(os.environ, **(env or {})),
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def text(self) -> str:
        return self.log.read_text()

    def wait_for(self, needle: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while needle not in self.text():
            assert self.proc.poll() is None, self.text()
            assert time.monotonic() < deadline, f"no {needle!r} in: {self.text()}"
            time.sleep(0.1)

    def finish(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout_s)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


def args(model: Path, rank: int, world: int, rdzv: Path, *extra: str) -> list[str]:
    return [
        *("--model", str(model), "--rank", str(rank), "--world-size", str(world)),
        *("--rendezvous-file", str(rdzv), "--max-model-len", "128", *extra),
    ]


def test_different_checkpoints_stop_the_group_naming_both_fingerprints(
    llama_dir: Path, qwen2_dir: Path, tmp_path: Path
) -> None:
    rdzv = tmp_path / "rdzv"
    stages = [
        Stage(tmp_path, 0, args(llama_dir, 0, 2, rdzv, "--num-kv-blocks", "32")),
        Stage(tmp_path, 1, args(qwen2_dir, 1, 2, rdzv, "--num-kv-blocks", "32")),
    ]
    codes = [s.finish(60) for s in stages]
    assert codes == [ExitCode.GROUP_STOP, ExitCode.GROUP_STOP], [s.text() for s in stages]
    for s in stages:
        line = next(x for x in s.text().splitlines() if "GROUP STOP" in x)
        assert "congruence: model fingerprint differs: stage 0 has '" in line
        assert ", stage 1 has '" in line


def test_different_layer_splits_stop_the_group_naming_both(llama_dir: Path, tmp_path: Path) -> None:
    rdzv = tmp_path / "rdzv"
    stages = [
        Stage(tmp_path, 0, args(llama_dir, 0, 2, rdzv, "--num-kv-blocks", "32", "--layer-split", "0:2,2:4")),
        Stage(tmp_path, 1, args(llama_dir, 1, 2, rdzv, "--num-kv-blocks", "32", "--layer-split", "0:1,1:4")),
    ]
    assert [s.finish(60) for s in stages] == [ExitCode.GROUP_STOP] * 2
    for s in stages:
        assert "layer split differs: stage 0 has '0:2,2:4', stage 1 has '0:1,1:4'" in s.text()


def test_group_takes_the_smallest_pool_and_env_configures_a_stage(llama_dir: Path, tmp_path: Path) -> None:
    rdzv = tmp_path / "rdzv"
    leader = Stage(tmp_path, 0, args(llama_dir, 0, 2, rdzv, "--num-kv-blocks", "100"))
    follower = Stage(
        tmp_path,
        1,
        ["--max-model-len", "128", "--num-kv-blocks", "64"],
        env={
            "PIPESERVE_MODEL": str(llama_dir),
            "PIPESERVE_RANK": "1",
            "PIPESERVE_WORLD_SIZE": "2",
            "PIPESERVE_RENDEZVOUS_FILE": str(rdzv),
        },
    )
    try:
        leader.wait_for("ring formed", 60)
        assert "64 KV blocks (proposed [100, 64])" in leader.text()
        assert "layers [2, 4) of 4, 64 KV blocks" in follower.text()
        time.sleep(2.5)  # idle across several heartbeats: the group stays up
        assert leader.proc.poll() is None and follower.proc.poll() is None
        leader.proc.send_signal(signal.SIGTERM)  # clean shutdown goes round the ring
        assert leader.finish(20) == 0, leader.text()
        assert follower.finish(20) == 0, follower.text()
        assert "stage 1: shutdown" in follower.text()
    finally:
        leader.finish(0.1)
        follower.finish(0.1)


@pytest.mark.slow  # waits out ring deadlines
def test_a_missing_stage_is_named_when_the_group_cannot_form(llama_dir: Path, tmp_path: Path) -> None:
    rdzv = tmp_path / "rdzv"
    extra = ("--num-kv-blocks", "32", "--connect-timeout-s", "4")
    stages = [Stage(tmp_path, r, args(llama_dir, r, 3, rdzv, *extra)) for r in (0, 1)]
    t0 = time.monotonic()
    assert [s.finish(60) for s in stages] == [ExitCode.GROUP_STOP] * 2
    assert time.monotonic() - t0 < 40
    for s in stages:
        assert "group did not form within 4s (stages not joined: [2])" in s.text(), s.text()
