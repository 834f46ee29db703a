"""Progress people can see: weights loading reports progress, as a bar on a
terminal and as rate-limited log lines otherwise, without slowing the work down."""

from __future__ import annotations

import io
import logging
import time
from pathlib import Path
from typing import ClassVar

import pytest
from safetensors.torch import load_file

from pipeserve.model import loader
from pipeserve.model.config import ModelConfig
from pipeserve.model.stage_model import StageSpec
from pipeserve.obs.progress import Progress, human_bytes

pytestmark = pytest.mark.timeout(120)
log = logging.getLogger("pipeserve.test.progress")


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def test_log_lines_at_most_every_interval_and_none_for_a_short_task(caplog):
    caplog.set_level(logging.INFO, logger=log.name)
    clock = Clock()
    with Progress("loading", 100 << 20, log, interval_s=2.0, tty=False, clock=clock) as p:
        for _ in range(100):  # 1 MiB every 0.1 s: 10 s in all
            clock.now += 0.1
            p.update(1 << 20)
    msgs = [r.getMessage() for r in caplog.records]
    # One line per 2 s of work (at 2, 4, 6, 8, 10 s, give or take float steps), then "done".
    assert 4 <= len(msgs) - 1 <= 5, msgs
    assert msgs[0].startswith("loading: ") and "of 100.0 MiB (" in msgs[0]
    assert msgs[-1] == "loading: done, 100.0 MiB in 10.0 s"
    caplog.clear()
    with Progress("quick", 10, log, interval_s=2.0, tty=False, clock=clock) as p:
        clock.now += 1.0
        p.update(10)
    assert caplog.records == []  # shorter than the interval: silent


def test_bar_on_a_terminal_and_no_log_lines(caplog):
    caplog.set_level(logging.INFO, logger=log.name)
    stream = io.StringIO()
    with Progress("zeroing", 4096, log, stream=stream, tty=True, interval_s=0.0) as p:
        for _ in range(4):
            p.update(1024)
    assert "zeroing" in stream.getvalue() and "4.00k" in stream.getvalue()  # tqdm's bar, in bytes
    assert caplog.records == []


def test_update_is_cheap():
    p = Progress("t", 1 << 40, log, tty=False, interval_s=3600.0)
    start = time.perf_counter()
    for _ in range(100_000):
        p.update(4096)
    # Per-tensor calls on a real load are ~10^2..10^4: far below a millisecond in all.
    assert time.perf_counter() - start < 1.0
    assert human_bytes(512) == "512 B" and human_bytes(3 << 30) == "3.0 GiB"


class Recording(Progress):
    """The real Progress with a 0 s interval (a line per update), remembering its instances."""

    made: ClassVar[list[Progress]] = []

    def __init__(self, desc, total, logger, **kw) -> None:
        super().__init__(desc, total, logger, **{**kw, "interval_s": 0.0, "tty": False})
        Recording.made.append(self)


def test_weights_loading_reports_every_byte(llama_dir: Path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="pipeserve.model.loader")
    Recording.made = []
    monkeypatch.setattr(loader, "Progress", Recording)
    cfg = ModelConfig.from_dir(str(llama_dir), None)
    spec = StageSpec(0, 2, 0, cfg.num_layers // 2)
    tensors = loader.read_stage_tensors(llama_dir, cfg, spec)
    (p,) = Recording.made
    stored = {n: t.numel() * t.element_size() for n, t in load_file(llama_dir / "model.safetensors").items()}
    assert p.total == p.done == sum(stored[n] for n in tensors) > 0
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == len(tensors) + 1 and lines[-1].startswith("stage 0: loading weights: done")
