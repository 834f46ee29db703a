"""Quiet logs: idle passes log nothing, repeated lines are rolled up, JSON lines carry the process's
identity, and no serving-path log call formats a tensor.

The engine here is the real one (stage/assemble.build_engine over the demo checkpoint, one stage,
in-process) driven by the real EngineLoop; log records are caught by a handler on the root logger
at DEBUG that formats every record (so every log call's arguments are formatted, as a shipper
at DEBUG would).
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import sys
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import httpx
import pytest
import torch

from pipeserve.cli import build_parser
from pipeserve.config import EngineConfig
from pipeserve.errors import ConfigError
from pipeserve.local.launcher import LocalGroup
from pipeserve.local.ports import free_port
from pipeserve.obs import logs
from pipeserve.obs.logs import JsonFormatter, configure_logging, request_context, set_identity
from pipeserve.obs.ratelimit import RateLimitedLog
from pipeserve.ring.faults import ENV as FAULTS_ENV
from pipeserve.sampling_params import SamplingParams
from pipeserve.stage import engine_loop
from pipeserve.stage.assemble import build_engine
from pipeserve.stage.engine_loop import Delta, EngineLoop
from serving_support import running_up

pytestmark = pytest.mark.timeout(180)

IDLE_PASSES = 10_000


class Capture(logging.Handler):
    """Formats every record it gets (JSON, as a shipper would) and keeps the records."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.lines: list[str] = []
        self.setFormatter(JsonFormatter())

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        try:
            self.lines.append(self.format(record))
        except Exception:  # noqa: BLE001 - as logging's own handlers do: the caller never sees it
            self.handleError(record)


@pytest.fixture
def capture() -> Iterator[Capture]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    handler = Capture()
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


@pytest.fixture
def root_restored() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        for h in root.handlers:
            if h not in handlers:
                h.close()
        root.handlers[:] = handlers
        root.setLevel(level)


class Collect:
    """An EngineLoop sink: every delta of one request; `done` once the final one arrived."""

    def __init__(self) -> None:
        self.deltas: list[Delta] = []
        self.done = threading.Event()

    def push(self, delta: Delta) -> None:
        self.deltas.append(delta)
        if delta.final:
            self.done.set()

    @property
    def tokens(self) -> list[int]:
        return [t for d in self.deltas for t in d.token_ids]


def demo_engine(model_dir: Path, **config: object):
    return build_engine(
        EngineConfig(model=str(model_dir), num_threads=1, num_kv_blocks=256, max_num_seqs=4, **config)  # type: ignore[arg-type]
    )


# --- (a) idle passes log nothing ----------------------------------------------------------------


def test_ten_thousand_idle_passes_log_o1_lines(llama_dir, capture, monkeypatch):
    engine = demo_engine(llama_dir)
    monkeypatch.setattr(engine_loop, "IDLE_WAIT_S", 0.0)  # the idle loop spins instead of sleeping
    passes = 0
    has_unfinished = engine.has_unfinished

    def counted() -> bool:  # the real check, counted: one call per pass of the loop
        nonlocal passes
        passes += 1
        return has_unfinished()

    engine.has_unfinished = counted  # type: ignore[method-assign]
    loop = EngineLoop(engine, max_waiting=8)
    try:
        before = len(capture.records)
        loop.start()
        deadline = time.monotonic() + 60
        while passes < IDLE_PASSES:
            assert time.monotonic() < deadline, f"only {passes} idle passes in 60 s"
            time.sleep(0.01)
        idle_loop_lines = len(capture.records) - before
        # The engine's own step with nothing to do (what a busy loop calls between requests).
        before = len(capture.records)
        for _ in range(IDLE_PASSES):
            assert engine.step() == []
        idle_step_lines = len(capture.records) - before
    finally:
        loop.end("test over")
        assert loop.join(10)
        engine.shutdown()
    assert passes >= IDLE_PASSES
    assert idle_loop_lines <= 2, capture.lines[-5:]
    assert idle_step_lines == 0, capture.lines[-5:]


# --- (b) the rate limiter's roll-up --------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_rate_limiter_rolls_up_exactly_what_it_suppressed(capture):
    clock = Clock()
    log = logging.getLogger("pipeserve.test.ratelimit")
    rlog = RateLimitedLog(log, interval_s=60.0, clock=clock)
    assert rlog.warning("probe", "probe of %s failed", "g0")  # the first goes through at once
    for _ in range(37):
        clock.now += 1.0  # all within the interval
        assert not rlog.warning("probe", "probe of %s failed", "g0")
    assert rlog.info("other", "another key is independent")
    assert rlog.suppressed("probe") == 37
    lines = [r.getMessage() for r in capture.records if r.name == log.name]
    assert lines == ["probe of g0 failed", "another key is independent"]
    clock.now += 30.0  # 67 s after the first line: the next one goes through with the count
    assert rlog.warning("probe", "probe of %s failed", "g1")
    last = capture.records[-1]
    assert last.getMessage() == "probe of g1 failed (37 more suppressed in 67 s)"
    assert (
        last.levelno == logging.WARNING
        and last.funcName == "test_rate_limiter_rolls_up_exactly_what_it_suppressed"
    )
    assert rlog.suppressed("probe") == 0
    for _ in range(5):
        rlog.warning("probe", "probe of %s failed", "g1")
    clock.now += 10
    assert rlog.flush() == 5  # flush says what is still pending, once
    assert capture.records[-1].getMessage() == "probe: 5 more suppressed in 10 s"
    assert rlog.flush() == 0


def test_rate_limiter_skips_disabled_levels_and_bounds_its_keys(capture):
    clock = Clock()
    log = logging.getLogger("pipeserve.test.ratelimit2")
    log.setLevel(logging.INFO)
    try:
        rlog = RateLimitedLog(log, interval_s=10.0, clock=clock, max_keys=3)
        assert not rlog.debug("k", "below the level: neither logged nor counted")
        assert rlog.suppressed("k") == 0
        for k in range(5):
            assert rlog.info(k, "key %d", k)
        assert len(rlog._keys) == 3  # the oldest keys forgotten
        assert rlog.info(0, "key %d again", 0)  # forgotten: goes through again
        with pytest.raises(ValueError):
            RateLimitedLog(log, interval_s=-1)
    finally:
        log.setLevel(logging.NOTSET)


# --- (c) JSON lines ------------------------------------------------------------------------------


def test_json_lines_parse_and_carry_the_fields(root_restored, monkeypatch):
    monkeypatch.delenv(logs.GROUP_ENV, raising=False)
    out = io.StringIO()
    configure_logging("json", "debug", group="g0", stage=1, stream=out, export=False)
    log = logging.getLogger("pipeserve.test.json")
    log.info("plain %d", 1)
    with request_context("cmpl-1"):
        log.warning("inside a request\nsecond line")
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            log.exception("failed")
    log.debug("explicit", extra={"request_id": "r-2"})
    set_identity(stage=2)
    log.info("after set_identity")
    docs = [json.loads(line) for line in out.getvalue().splitlines()]
    # Root logs at debug here: a thread an earlier test left (an HTTP client's pool) may log too.
    docs = [d for d in docs if d["logger"].startswith("pipeserve.")]
    assert len(docs) == 5  # one line per record: newlines inside are escaped
    for d in docs:
        assert set(d) >= {"time", "level", "logger", "message", "group", "stage", "request_id"}
        t = datetime.fromisoformat(d["time"])
        assert d["time"].endswith("Z") and t.utcoffset().total_seconds() == 0
        assert abs(t.timestamp() - time.time()) < 60
        assert d["logger"] == "pipeserve.test.json" and d["group"] == "g0"
    assert [d["message"] for d in docs] == [
        "plain 1",
        "inside a request\nsecond line",
        "failed",
        "explicit",
        "after set_identity",
    ]
    assert [d["level"] for d in docs] == ["INFO", "WARNING", "ERROR", "DEBUG", "INFO"]
    assert [d["request_id"] for d in docs] == [None, "cmpl-1", "cmpl-1", "r-2", None]
    assert [d["stage"] for d in docs] == [1, 1, 1, 1, 2]
    assert "RuntimeError: boom" in docs[2]["exc_info"] and "exc_info" not in docs[0]


def test_text_format_and_bad_settings(root_restored, monkeypatch):
    out = io.StringIO()
    monkeypatch.setenv(logs.FORMAT_ENV, "text")
    monkeypatch.setenv(logs.LEVEL_ENV, "warning")
    configure_logging(group="g3", stage=0, stream=out, export=False)
    log = logging.getLogger("pipeserve.test.text")
    log.info("below WARNING: dropped")
    with request_context("r9"):
        log.warning("kept")
    assert out.getvalue().count("\n") == 1
    assert "WARNING pipeserve.test.text: [group g3 stage 0 request r9] kept" in out.getvalue()
    with pytest.raises(ConfigError, match="log format 'xml'"):
        configure_logging("xml", stream=out, export=False)
    monkeypatch.setenv(logs.LEVEL_ENV, "chatty")
    with pytest.raises(ConfigError, match="log level 'chatty'"):
        configure_logging(stream=out, export=False)


def test_log_format_reaches_spawned_stage_processes(root_restored, monkeypatch, tmp_path):
    """`pipeserve --log-format json up` exports the format; the stages LocalGroup starts inherit it
    and name their group and stage. The stage here fails at once (no checkpoint), logging one line."""
    monkeypatch.setenv(logs.FORMAT_ENV, "text")  # restored afterwards: configure_logging exports
    monkeypatch.setenv(logs.LEVEL_ENV, "INFO")
    configure_logging("json", "INFO", stream=io.StringIO())
    empty = tmp_path / "no-model"
    empty.mkdir()
    group = LocalGroup(EngineConfig(model=str(empty), stages=2, num_threads=1, log_dir=str(tmp_path)))
    group.start(range(1, 2), group="g7")
    deadline = time.monotonic() + 60
    while not group.exited():
        assert time.monotonic() < deadline, "the stage did not exit"
        time.sleep(0.1)
    group.stop()
    lines = (tmp_path / "stage-1.log").read_text().splitlines()
    docs = [json.loads(line) for line in lines if line.startswith("{")]
    assert docs, lines
    assert all(d["group"] == "g7" and d["stage"] == 1 for d in docs), docs
    assert any(d["level"] in ("ERROR", "CRITICAL") for d in docs), docs


# --- (d) the tripwire: no log call formats a tensor ----------------------------------------------

TRIPPED_METHODS = ("__repr__", "__str__", "__format__", "item", "tolist")


def _inside_logging(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_filename == logging.__file__:
            return True
        frame = frame.f_back
    return False


@pytest.fixture
def tripwire(monkeypatch) -> list[str]:
    """torch.Tensor's formatting methods raise when called from inside the logging module (and say
    so in the returned list: logging swallows exceptions raised while formatting)."""
    trips: list[str] = []
    for name in TRIPPED_METHODS:
        original = getattr(torch.Tensor, name)

        def tripped(self, *args, _name=name, _original=original):
            if _inside_logging(sys._getframe(1)):
                trips.append(_name)
                raise AssertionError(f"a log call formats a tensor (Tensor.{_name})")
            return _original(self, *args)

        monkeypatch.setattr(torch.Tensor, name, tripped)
    monkeypatch.setattr(logging, "raiseExceptions", False)  # no "--- Logging error ---" noise
    return trips


def test_tripwire_catches_a_tensor_formatted_by_a_log_call(capture, tripwire):
    log = logging.getLogger("pipeserve.test.tripwire")
    t = torch.arange(3)
    assert t.tolist() == [0, 1, 2] and "tensor" in repr(t)  # outside logging: untouched
    log.debug("a tensor: %s", t)
    log.debug("its repr: %r", t)
    # Every handler that formats the record trips (pytest's own capture handlers too).
    assert set(tripwire) == {"__str__", "__repr__"}


POISON = 99  # a request holding this token fails on stage 0 (the fail_token fault)


def test_serving_with_tensors_tripwired_formats_none_in_logs(llama_dir, capture, tripwire, monkeypatch):
    """Serving with the paths that log exercised: a request that fails (fault), L3 configured but
    down (its unavailable/backoff lines), prefix hits, logprobs, an abort."""
    monkeypatch.setenv(FAULTS_ENV, json.dumps({"fail_token": POISON, "fail_rank": 0}))
    engine = demo_engine(llama_dir, hicache_url=f"redis://127.0.0.1:{free_port()}")  # nothing listens
    loop = EngineLoop(engine, max_waiting=16)
    loop.start()
    sinks: dict[str, Collect] = {}
    try:
        cases = [
            ("greedy", [5, 6, 7, 8, 9], SamplingParams(max_tokens=8, temperature=0.0)),
            (
                "sampled",
                list(range(10, 40)),
                SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=3),
            ),
            ("logprobs", [11, 12, 13], SamplingParams(max_tokens=5, temperature=0.0, logprobs=3)),
            ("long", list(range(100, 217)), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)),
            ("aborted", [7, 8, 9], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)),
            ("poison", [5, 6, POISON, 8], SamplingParams(max_tokens=4, temperature=0.0)),
            ("same-prompt", list(range(100, 217)), SamplingParams(max_tokens=3, temperature=0.0)),
        ]
        for rid, prompt, params in cases:
            sinks[rid] = Collect()
            loop.submit(rid, prompt, params, sinks[rid])
        loop.abort("aborted")
        for rid, sink in sinks.items():
            assert sink.done.wait(60), f"{rid} did not finish"
    finally:
        loop.end("test over")
        assert loop.join(10)
        engine.shutdown()
    assert sinks["poison"].deltas[-1].error  # failed, alone
    del sinks["poison"]
    for rid, sink in sinks.items():
        final = sink.deltas[-1]
        assert final.error is None, (rid, final.error)
        if rid != "aborted":
            assert sink.tokens and final.finish_reason in ("stop", "length"), (rid, final)
    assert sinks["logprobs"].deltas[0].logprobs
    serving = [r for r in capture.records if r.name.startswith("pipeserve.") and r.levelno >= logging.WARNING]
    assert serving, "the failing request and L3 down should have logged"
    assert tripwire == [], capture.lines[-5:]


@pytest.mark.slow
def test_pipeserve_up_log_format_json_reaches_every_process(llama_dir, tmp_path):
    """`pipeserve up --log-format json`: the supervisor/router's lines and every stage's log file are
    JSON lines, each stage's naming its group and rank."""
    args = ("--model", str(llama_dir), "--stages", "2", "--num-kv-blocks", "1024", "--log-format", "json")
    with running_up(*args, log_dir=tmp_path) as server:
        body = {"model": str(llama_dir), "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        (group,) = [g["name"] for g in server.groups()]
    up_docs = [json.loads(line) for line in server.log().splitlines() if line.strip()]
    assert any(d["logger"].startswith("pipeserve.supervisor") for d in up_docs), up_docs[:5]
    for rank in range(2):
        lines = (tmp_path / f"{group}-stage-{rank}.log").read_text().splitlines()
        docs = [json.loads(line) for line in lines if line.strip()]  # every line: one JSON object
        assert docs and all(d["group"] == group and d["stage"] == rank for d in docs), docs[:5]


def test_every_subcommand_takes_the_log_flags_before_or_after_it():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = [name for name, p in sub.choices.items() if "--log-format" not in p._option_string_actions]
    assert not missing, missing
    before = parser.parse_args(["--log-format", "json", "--log-level", "debug", "demo-model", "d"])
    after = parser.parse_args(["demo-model", "d", "--log-format", "json"])
    neither = parser.parse_args(["demo-model", "d"])
    assert (before.log_format, before.log_level, after.log_format) == ("json", "DEBUG", "json")
    assert not hasattr(neither, "log_format")  # the environment decides (configure_from_args)
