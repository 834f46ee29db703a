"""No orphan stage processes: however the driving process ends, the stages it started end too.

The driver is a real Python process running the offline LLM with S=3; the test
reads the stage pids it prints and watches them after the driver exits
normally, raises, leaves a `with` block, is SIGKILLed, or fails to start.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from pipeline_support import stage_processes, wait_dead
from pipeserve import LLM
from pipeserve.errors import ConfigError, ModelLoadError
from pipeserve.local.launcher import LocalGroup

DRIVER = textwrap.dedent(
    """
    import json, sys, time
    from pipeserve import LLM, SamplingParams

    model, mode = sys.argv[1], sys.argv[2]
    llm = LLM(model, stages=3, max_model_len=128, num_kv_blocks=32, ring_timeout_s=5)
    print(json.dumps(list(llm.group.pids.values())), flush=True)
    out = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4
    if mode == "raise":
        raise RuntimeError("the caller failed")
    if mode == "with":
        with llm:
            pass
        print("left the block", flush=True)
    if mode == "sleep":
        print("ready", flush=True)
        time.sleep(120)
    """
)


def start_driver(model_dir: Path, mode: str) -> tuple[subprocess.Popen, list[int]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(model_dir), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()  # type: ignore[union-attr]
    if not line:
        proc.wait(5)
        pytest.fail(f"driver failed to start: {proc.stderr.read()}")  # type: ignore[union-attr]
    pids = json.loads(line)
    assert len(pids) == 2
    return proc, pids


@pytest.mark.parametrize(("mode", "status"), [("exit", 0), ("raise", 1), ("with", 0)])
def test_stages_end_with_their_driver(llama_dir: Path, mode: str, status: int) -> None:
    proc, pids = start_driver(llama_dir, mode)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == status, err
    assert not wait_dead(pids, 5), f"orphan stages after the driver's {mode}"
    assert err.count("shutdown") >= 2, "stages did not get a clean shutdown through the ring"


def test_stages_end_when_their_driver_is_killed(llama_dir: Path) -> None:
    proc, pids = start_driver(llama_dir, "sleep")
    assert proc.stdout.readline().strip() == "ready"  # type: ignore[union-attr]
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    assert not wait_dead(pids, 5), "stages outlived a SIGKILLed driver"


def test_a_failed_start_leaves_no_stage_process(llama_dir: Path, tmp_path: Path) -> None:
    # Only stage 0 needs the embedding: without it stage 0 fails to load while the
    # followers load and wait to join (for connect_timeout_s) unless they are stopped.
    broken = tmp_path / "no-embedding"
    shutil.copytree(llama_dir, broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.embed_tokens.weight"]
    save_file(tensors, broken / "model.safetensors")
    before = set(stage_processes(os.getpid()))
    with pytest.raises(ModelLoadError, match="embed_tokens"):
        LLM(str(broken), stages=3, max_model_len=128, num_kv_blocks=32, connect_timeout_s=120)
    assert not wait_dead(list(set(stage_processes(os.getpid())) - before), 5)


@pytest.mark.parametrize(
    ("kw", "error"),
    [({"stages": 5}, ModelLoadError), ({"stages": 2, "layer_split": "0:1,1:3"}, ConfigError)],
)
def test_an_impossible_split_fails_before_any_stage_starts(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch, kw: dict, error: type
) -> None:
    started: list[int] = []
    real_start = LocalGroup.start
    monkeypatch.setattr(LocalGroup, "start", lambda group: started.append(1) or real_start(group))
    with pytest.raises(error, match="layer"):
        LLM(str(llama_dir), max_model_len=128, num_kv_blocks=32, **kw)
    assert not started, "stage processes were started for a split that cannot work"
