"""Stage 0's grammar compilers (engine/grammar_pool.py): real worker processes, killed when they must.

An enum of 20k entries is the grammar bomb: seconds of CPU to compile (the issue's probe: 2.2 s),
while a small schema takes milliseconds. Each rule is shown on one pool of one worker:
* a compile past its budget is refused (400 "did not compile") and its worker is killed: it burns
  no CPU after the answer, and a fresh worker takes the next spec;
* the budget is compile time: a spec queued behind a bomb for longer than the budget compiles;
* a spec that finds no free worker within the queue deadline is CompileBusy (a 429), not a 400;
  one sent while no worker has started yet waits for the first (start-up is not load);
* a caller cancelled while its spec compiles (client gone) kills that worker too;
* what a worker compiled lands in the book (sent as xgrammar's JSON, or compiled again here when
  big), so admission's check finds it without compiling.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest

from pipeserve.engine import grammar_pool
from pipeserve.engine.grammar import GrammarBook
from pipeserve.engine.grammar_pool import CompileBusy, GrammarPool, _cpu_s
from pipeserve.errors import InvalidRequestError
from pipeserve.model.config import ModelConfig

pytestmark = pytest.mark.slow

SMALL = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})


def bomb(tag: str, n: int = 20000) -> str:
    """A JSON schema whose one property is an enum of `n` distinct strings (distinct per tag)."""
    values = [f"{tag}-{i}" for i in range(n)]  # under the 256 KiB a structured spec may have
    return json.dumps({"type": "object", "properties": {"x": {"enum": values}}, "required": ["x"]})


class LoopThread:
    """One event loop in a thread for the module: the pool lives on it, tests submit coroutines."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout_s: float = 120) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def submit(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def pool(llama_dir: Path) -> Iterator[tuple[LoopThread, GrammarPool]]:
    cfg = ModelConfig.from_dir(llama_dir)
    book = GrammarBook(llama_dir, cfg.vocab_size, cfg.eos_token_ids)
    book.holds_matchers = True  # as on a one-stage group: stage 0 samples, the grammar must land here
    lt = LoopThread()
    p = GrammarPool(book, workers=1, compile_deadline_s=60.0, queue_deadline_s=60.0)
    lt.run(p.start(), 180)  # the workers start in the background: _one_worker waits for them
    try:
        yield lt, p
    finally:
        lt.run(p.close())
        lt.stop()


def _one_worker(p: GrammarPool, timeout_s: float = 120) -> int:
    """The pid of the pool's one worker, once it is alive and idle (a replacement starts in seconds)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if len(p.pids()) == 1 and p._idle.qsize() == 1:
            return p.pids()[0]
        time.sleep(0.05)
    raise AssertionError(f"no idle worker within {timeout_s}s: {p.pids()}")


def _gone(pid: int, timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            return True  # reaped
        if state in (b"Z", b"X"):
            return True
        time.sleep(0.05)
    return False


def test_a_compile_past_its_budget_is_refused_and_its_worker_killed(pool) -> None:
    lt, p = pool
    pid = _one_worker(p)
    p.compile_deadline_s = 0.3
    try:
        t0 = time.monotonic()
        with pytest.raises(InvalidRequestError) as e:
            lt.run(p.compile("json", bomb("budget"), False))
        answered_s = time.monotonic() - t0
    finally:
        p.compile_deadline_s = 60.0
    assert e.value.param == "structured" and "did not compile within 0.3 s" in e.value.message
    assert answered_s < 0.3 * 4 + 1.0, answered_s  # within the wall cap (WALL_FACTOR x the budget)
    assert _gone(pid), "the worker still runs after the answer"
    new = _one_worker(p)
    assert new != pid
    lt.run(p.compile("json", SMALL, False))  # the replacement serves the next spec
    assert p.book.has("json", SMALL, False)


def test_the_budget_is_compile_time_not_time_queued(pool, monkeypatch: pytest.MonkeyPatch) -> None:
    lt, p = pool
    pid = _one_worker(p)
    first, second = bomb("q1"), bomb("q2")
    cpu0 = _cpu_s(pid)
    lt.run(p.compile("json", bomb("q0"), False))
    one_cpu = _cpu_s(pid) - cpu0  # what one bomb costs the worker (its compile and reply)
    # A budget one compile fits in, but not two, nor the worker's start-up (imports: seconds of CPU):
    # the second spec waits a whole compile in the queue and must still compile.
    monkeypatch.setattr(grammar_pool, "WALL_FACTOR", 1000.0)  # a busy machine slows the wall clock
    budget = p.compile_deadline_s = max(one_cpu, 0.2) * 1.5
    try:
        a = lt.submit(p.compile("json", first, False))
        b = lt.submit(p.compile("json", second, False))
        a.result(120)
        b.result(120)
    finally:
        p.compile_deadline_s = 60.0
    assert p.book.has("json", first, False) and p.book.has("json", second, False)
    assert _cpu_s(pid) > budget * 1.5, "the worker's own start-up fits the budget: no test"


def test_no_free_worker_within_the_queue_deadline_is_busy_not_a_bad_spec(pool) -> None:
    lt, p = pool
    _one_worker(p)
    p.queue_deadline_s = 0.2
    try:
        busy = lt.submit(p.compile("json", bomb("busy"), False))
        while p.running == 0:
            time.sleep(0.01)
        with pytest.raises(CompileBusy, match=r"no grammar compiler was free within 0\.2 s"):
            lt.run(p.compile("json", SMALL.replace("a", "b"), False))
        busy.result(120)  # the bomb itself compiles
    finally:
        p.queue_deadline_s = 60.0
    p.max_queued = 0
    try:
        with pytest.raises(CompileBusy, match="waiting"):
            lt.run(p.compile("json", SMALL.replace("a", "c"), False))
    finally:
        p.max_queued = 64


def test_a_spec_sent_before_any_worker_is_up_waits_for_the_first(llama_dir: Path) -> None:
    cfg = ModelConfig.from_dir(llama_dir)
    book = GrammarBook(llama_dir, cfg.vocab_size, cfg.eos_token_ids)
    lt = LoopThread()
    p = GrammarPool(book, workers=1, queue_deadline_s=0.2)
    try:
        lt.run(p.start(), 180)
        [pid] = p.pids()
        os.kill(pid, signal.SIGSTOP)  # importing torch beside two busy loops, niced: seconds
        assert p.warm() == 0, "the worker was up before it could be held: no test"
        fut = lt.submit(p.compile("json", SMALL, False))
        time.sleep(1.0)  # five queue deadlines
        assert not fut.done(), fut.exception()
        os.kill(pid, signal.SIGCONT)
        fut.result(120)
        assert p.book.has("json", SMALL, False)
    finally:
        for held in p.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(held, signal.SIGCONT)
        lt.run(p.close())
        lt.stop()


def test_a_cancelled_compile_kills_its_worker(pool) -> None:
    lt, p = pool
    pid = _one_worker(p)
    fut = lt.submit(p.compile("json", bomb("cancel"), False))
    while p.running == 0:
        time.sleep(0.01)
    fut.cancel()
    assert _gone(pid), "the cancelled compile's worker still runs"
    assert _one_worker(p) != pid


def test_what_a_worker_compiled_is_found_by_admission_without_compiling(pool) -> None:
    lt, p = pool
    _one_worker(p)
    spec = json.dumps({"type": "object", "properties": {"d": {"type": "string"}}})
    before = p.book.compiles
    lt.run(p.compile("json", spec, True))
    assert p.book.compiles == before  # small: sent back as JSON, not compiled again here
    p.book.check("json", spec, True)
    assert p.book.compiles == before
    with pytest.raises(InvalidRequestError, match="does not compile: Regex parsing error"):
        lt.run(p.compile("regex", "(", False))  # the parser's words, without xgrammar's source path
