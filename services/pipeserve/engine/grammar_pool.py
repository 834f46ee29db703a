"""Stage 0's structured-output compiles, in a bounded pool of worker processes it can kill.

Why processes: an xgrammar compile cannot be cancelled, and one schema can take seconds (a
20k-entry enum: ~2 s alone). Compiled on threads, 16 such schemas at once queued behind each other
(13 of 16 were refused "did not compile within 10 s") and kept burning CPU for 20-30 s after
their answers. Here:
* at most `workers` compiles run at once, each in its own process (niced, one thread), started
  before the tokenizer's grammar info is built, so their imports overlap it (`start`: the info is
  built once, in stage 0's GrammarBook, before the stage says ready, and handed to each worker as
  xgrammar's JSON in the background);
* a spec waits for a free worker at most `queue_deadline_s` (once the first worker is up), and at
  most `max_queued` specs wait:
  past either it is `CompileBusy` (RESOURCE_EXHAUSTED: the router answers 429 or tries another
  group), a refusal of load, not of the spec;
* the compile budget (`compile_deadline_s`) counts from when a worker takes the spec, not the time
  queued: past it the worker is killed (SIGKILL: nothing keeps computing after the answer) and the
  spec is refused, InvalidRequestError("structured", "did not compile within 10 s"); a caller
  cancelled while its spec compiles (client gone, deadline) kills its worker too. A killed worker
  is replaced in the background.
* What comes back lands in the book (engine/grammar.py), where admission (LLMEngine.validate) finds
  it: where this process holds no matcher (stage 0 of several stages) "it compiles" is all
  admission needs (`mark_valid`); where it does (one stage: stage 0 samples), the worker sends the
  compiled grammar as xgrammar's JSON when it is small, else stage 0 compiles it on its own one
  grammar thread: a big grammar costs more to serialize and load (63 MB and ~7 s for the 20k
  enum) than to compile again, and this compile was just shown to end within the budget (that
  thread is waited for within the queue deadline too).
Frames on a worker's stdin/stdout are a 4-byte big-endian length and UTF-8 JSON: no pickle
crosses the process boundary. A worker dies with its parent (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import struct
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO

from pipeserve.engine.grammar import COMPILE_DEADLINE_S, GrammarBook, compile_spec, new_compiler
from pipeserve.errors import InvalidRequestError

log = logging.getLogger(__name__)

WORKERS = 2  # compiles at once; niced, so a compile storm yields the cores to the engine first
# Each wait (for a worker, then for stage 0's own grammar thread) ends within this: with the
# budget's wall cap, a structured request is answered well within the router's 120 s to its first message.
QUEUE_DEADLINE_S = 20.0
MAX_QUEUED = 64
START_DEADLINE_S = 120.0  # a worker imports xgrammar (torch): seconds on a busy machine
# A spec sent before any worker is up waits this long for the first (start-up, not load: not the
# queue deadline), within the router's 120 s to a first message.
START_WAIT_S = 90.0
RESPAWN_BACKOFF_S = 5.0  # after a worker that did not start
SHIP_MAX_BYTES = 4 * 2**20  # a compiled grammar larger than this is compiled again here, not sent
WORKER_NICE = 10
BUDGET_POLL_S = 0.05
WALL_FACTOR = 4.0  # a starved worker is stopped after this many budgets of wall time
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_HEADER = struct.Struct(">I")
MAX_FRAME = 512 * 2**20


def _cpu_s(pid: int) -> float | None:
    """A process's CPU seconds (user + system) from /proc, or None where there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime: fields 14 and 15 of stat


class CompileBusy(Exception):
    """No worker took the spec within the queue deadline, or the queue is full: load, not the spec."""


class _Worker:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    async def call(self, msg: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        data = json.dumps(msg).encode("utf-8", "surrogatepass")
        self.proc.stdin.write(_HEADER.pack(len(data)) + data)
        await self.proc.stdin.drain()
        (n,) = _HEADER.unpack(await self.proc.stdout.readexactly(_HEADER.size))
        if n > MAX_FRAME:
            raise ValueError(f"a frame of {n} bytes")
        reply = json.loads(await self.proc.stdout.readexactly(n))
        if not isinstance(reply, dict):
            raise ValueError("a reply that is not an object")
        return reply


class GrammarPool:
    def __init__(
        self,
        book: GrammarBook,
        workers: int = WORKERS,
        compile_deadline_s: float = COMPILE_DEADLINE_S,
        queue_deadline_s: float = QUEUE_DEADLINE_S,
        max_queued: int = MAX_QUEUED,
    ) -> None:
        self.book = book
        self.workers = workers
        self.compile_deadline_s = compile_deadline_s
        self.queue_deadline_s = queue_deadline_s
        self.max_queued = max_queued
        self.queued = 0  # specs waiting for a worker
        self.running = 0  # specs a worker compiles now
        self.killed = 0  # workers killed (past the budget, cancelled, failed)
        self._warm: set[_Worker] = set()  # live workers that said ready
        self._started = asyncio.Event()  # set once the first worker said ready
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        self._live: set[_Worker] = set()
        self._tasks: set[asyncio.Task] = set()
        self._info_json = ""
        self._closed = False
        # Stage 0's own compiles (a grammar too big to send): one thread, each proven to end in budget.
        self._local_slot = asyncio.Semaphore(1)
        self._local = ThreadPoolExecutor(1, thread_name_prefix="grammar-local", initializer=_nice_thread)

    async def start(self) -> None:
        """Start the workers, then build the tokenizer's grammar info (here, before the stage says
        ready) and hand it to them in the background. Each worker imports xgrammar, and with it
        torch, as soon as it starts (2-30 s of a busy machine's CPU, niced): that overlaps the info
        build, and a group's restart does not wait for it (its time to Ready). A spec sent before
        the first worker is up waits for it (at most START_WAIT_S: under two busy loops a niced
        import took longer than the queue deadline, and the first structured request got a 429),
        then within the queue deadline, as behind a busy one."""
        launched = [await self._launch() for _ in range(self.workers)]
        self._info_json = await asyncio.to_thread(self.book.tokenizer_info_json)
        for worker in launched:
            task = asyncio.ensure_future(self._handshake(worker))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._live]

    def warm(self) -> int:
        """Workers started and ready to compile."""
        return len(self._warm)

    async def _launch(self) -> _Worker:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "pipeserve.engine.grammar_pool",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        worker = _Worker(proc)
        self._live.add(worker)
        return worker

    async def _spawn(self) -> bool:
        if self._closed:
            return False
        return await self._handshake(await self._launch())

    async def _handshake(self, worker: _Worker) -> bool:
        """Send the tokenizer's info; the worker is idle once it answers ready (it has imported
        xgrammar and built its compiler)."""
        proc = worker.proc
        try:
            reply = await asyncio.wait_for(worker.call({"tokenizer_info": self._info_json}), START_DEADLINE_S)
            if reply.get("ready") is not True:
                raise ValueError(reply.get("error", "no ready reply"))
        except (TimeoutError, OSError, ValueError, asyncio.IncompleteReadError) as e:
            log.error("grammar worker %d did not start: %s; retrying in %gs", proc.pid, e, RESPAWN_BACKOFF_S)
            self._retire(worker, respawn_after_s=RESPAWN_BACKOFF_S)
            return False
        if self._closed:
            self._retire(worker, respawn_after_s=None)
            return False
        self._warm.add(worker)
        self._started.set()
        self._idle.put_nowait(worker)
        log.debug("grammar worker %d ready (%d of %d)", proc.pid, len(self._warm), self.workers)
        return True

    def _retire(self, worker: _Worker, respawn_after_s: float | None = 0.0) -> None:
        """Kill a worker (what it computes is abandoned) and start its replacement in the background."""
        self._live.discard(worker)
        self._warm.discard(worker)
        self.killed += 1
        with contextlib.suppress(ProcessLookupError):
            worker.proc.kill()

        async def reap_and_replace() -> None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(worker.proc.wait(), 10.0)
            if respawn_after_s is not None and not self._closed:
                await asyncio.sleep(respawn_after_s)
                await self._spawn()

        task = asyncio.ensure_future(reap_and_replace())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _take_worker(self) -> _Worker:
        """An idle worker, within the queue deadline once the first worker is up (until then at most
        START_WAIT_S: niced workers import torch beside a busy engine); CompileBusy past either."""
        if not self._started.is_set():
            try:
                await asyncio.wait_for(self._started.wait(), START_WAIT_S)
            except TimeoutError:
                raise CompileBusy(f"no grammar compiler started within {START_WAIT_S:g} s") from None
        try:
            return await asyncio.wait_for(self._idle.get(), self.queue_deadline_s)
        except TimeoutError:
            raise CompileBusy(f"no grammar compiler was free within {self.queue_deadline_s:g} s") from None

    async def compile(self, kind: str, text: str, compact: bool) -> None:
        """Return once the spec is known to compile (and, where needed, is compiled here); raise
        InvalidRequestError("structured", why) for a spec that does not, CompileBusy under load."""
        if self.book.has(kind, text, compact):
            return
        if self.queued >= self.max_queued:
            raise CompileBusy(f"{self.queued} structured-output specs are waiting to compile")
        self.queued += 1
        try:
            worker = await self._take_worker()
        finally:
            self.queued -= 1
        if self.book.has(kind, text, compact):  # the same spec compiled while this one waited
            self._idle.put_nowait(worker)
            return
        ship = self.book.holds_matchers
        msg = {"kind": kind, "text": text, "compact": compact, "ship": ship}
        self.running += 1
        try:
            reply = await self._within_budget(worker, msg)
        except TimeoutError:
            self._retire(worker)
            raise InvalidRequestError(
                "structured", f"did not compile within {self.compile_deadline_s:g} s"
            ) from None
        except asyncio.CancelledError:
            self._retire(worker)
            raise
        except (OSError, ValueError, asyncio.IncompleteReadError) as e:
            log.error("grammar worker %d failed on a %s spec: %s", worker.proc.pid, kind, e)
            self._retire(worker)
            raise InvalidRequestError("structured", "the grammar compiler failed on it") from None
        finally:
            self.running -= 1
        self._idle.put_nowait(worker)
        if "error" in reply:
            raise InvalidRequestError("structured", str(reply["error"]))
        if not ship:
            self.book.mark_valid(kind, text, compact)
            return
        # Stage 0's own thread, one spec at a time, waited for within the queue deadline too.
        try:
            await asyncio.wait_for(self._local_slot.acquire(), self.queue_deadline_s)
        except TimeoutError:
            raise CompileBusy(
                f"stage 0's grammar thread was not free within {self.queue_deadline_s:g} s"
            ) from None
        try:
            loop = asyncio.get_running_loop()
            grammar = reply.get("grammar")
            if isinstance(grammar, str):
                await loop.run_in_executor(self._local, self.book.put_json, kind, text, compact, grammar)
            else:
                await loop.run_in_executor(self._local, self.book.compile, kind, text, compact)
        finally:
            self._local_slot.release()

    async def _within_budget(self, worker: _Worker, msg: dict[str, Any]) -> dict[str, Any]:
        """The worker's reply, or TimeoutError once it has computed `compile_deadline_s` seconds of
        CPU on it: compile time, whatever else runs on the machine (the worker is niced, so a busy
        engine or neighbour slows its wall clock, not its budget); WALL_FACTOR x the budget of wall
        time at most."""
        call = asyncio.ensure_future(worker.call(msg))
        cpu0 = _cpu_s(worker.proc.pid)
        loop = asyncio.get_running_loop()
        start = loop.time()
        try:
            while True:
                done, _ = await asyncio.wait({call}, timeout=BUDGET_POLL_S)
                if done:
                    return call.result()
                wall = loop.time() - start
                cpu = _cpu_s(worker.proc.pid)
                spent = cpu - cpu0 if cpu is not None and cpu0 is not None else wall  # no /proc: wall
                if spent >= self.compile_deadline_s or wall >= self.compile_deadline_s * WALL_FACTOR:
                    raise TimeoutError
        finally:
            if not call.done():
                call.cancel()

    async def close(self) -> None:
        self._closed = True
        for worker in list(self._live):
            self._retire(worker, respawn_after_s=None)
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=15.0)
        self._local.shutdown(wait=False)


def _nice_thread() -> None:
    """Linux threads have their own nice value: stage 0's own compiles yield to its engine thread."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WORKER_NICE)


# --- the worker process -------------------------------------------------------------------------


def _read(stream: BinaryIO) -> dict[str, Any] | None:
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None  # stage 0 closed the pipe: exit
    (n,) = _HEADER.unpack(head)
    msg = json.loads(stream.read(n))
    return msg if isinstance(msg, dict) else None


def _write(stream: BinaryIO, msg: dict[str, Any]) -> None:
    data = json.dumps(msg).encode("utf-8", "surrogatepass")
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def worker_main() -> None:
    _die_with_parent()
    with contextlib.suppress(OSError):
        os.nice(WORKER_NICE)
    frames_in = sys.stdin.buffer
    frames_out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # a stray print must not corrupt a frame
    try:
        import xgrammar as xgr  # before the first frame: the import overlaps stage 0's info build
    except Exception as e:  # noqa: BLE001 - told to stage 0 once it asks, which logs it and retries later
        failed: str | None = f"{type(e).__name__}: {e}"
    else:
        failed = None
    first = _read(frames_in)
    if first is None:
        return
    try:
        if failed is not None:
            raise RuntimeError(failed)
        compiler = new_compiler(xgr.TokenizerInfo.deserialize_json(first["tokenizer_info"]))
    except Exception as e:  # noqa: BLE001 - told to stage 0, which logs it and retries later
        _write(frames_out, {"error": f"{type(e).__name__}: {e}"})
        return
    _write(frames_out, {"ready": True})
    while (msg := _read(frames_in)) is not None:
        try:
            compiled = compile_spec(compiler, msg["kind"], msg["text"], bool(msg["compact"]))
        except InvalidRequestError as e:
            _write(frames_out, {"error": e.message})
            continue
        small = msg.get("ship") and compiled.memory_size_bytes <= SHIP_MAX_BYTES
        _write(frames_out, {"grammar": compiled.serialize_json() if small else None})


if __name__ == "__main__":
    worker_main()
