"""EngineLoop: stage 0's engine on its own thread, fed by the request server.

The engine (scheduler, executors, ring) is single-threaded by design: only
this loop's thread touches it. Request handlers talk to it through two
thread-safe calls — `submit()` and `abort()` — which queue commands; each
pass of the loop applies the queued commands, runs one engine step, and
pushes every request's new tokens to its `Sink`. A Sink is how a handler
receives its request's deltas; `push` is called on the loop's thread and
must not block (the gRPC server's sink hands the delta to its asyncio loop).

Invariants:
- Every submitted request gets exactly one final delta: finished (stop,
  length, abort) or an error whose `ErrorKind` says whose failure it is:
  GROUP (the group stopped, the server is shutting down), INVALID (the
  request did not validate when applied), FAILED (the request failed on some
  stage: sampling, or an exception while publishing its tokens — the group
  goes on). A handler therefore never waits on a request the loop forgot.
- Request ids are unique among unfinished requests: a second submit of a
  live id raises DuplicateRequest at once.
- Aborting a request frees its blocks on every stage: the scheduler puts it
  in the next plan's `freed` list, which every follower applies.
- `stats` is replaced (never mutated) after each pass, so other threads read
  a consistent snapshot without locks.
- Progress for the wedge detector is a step that returned or a command
  applied; pending work is queued commands or unfinished requests.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from pipeserve.engine.engine import LLMEngine
from pipeserve.engine.request import FinishReason, Request
from pipeserve.errors import Diverged, GroupStopped, InvalidRequestError
from pipeserve.lifecycle import ProcessPhase
from pipeserve.obs import tracing
from pipeserve.sampling_params import SamplingParams
from pipeserve.stage.request_metrics import RequestTimer, RequestTimes
from pipeserve.stage.request_trace import RequestTrace, StageTraces

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05  # an idle loop wakes this often to see new commands (submit() also wakes it)


class Overloaded(RuntimeError):
    """Stage 0's admission queue is full."""


class NotServing(RuntimeError):
    """The loop is starting, draining or stopped; the message says which."""


class DuplicateRequest(ValueError):
    """A request with this id is still running."""


class ErrorKind(enum.Enum):
    GROUP = "group"  # the group stopped or shut down: not the request's fault
    INVALID = "invalid"  # the request was refused when applied (client error)
    FAILED = "failed"  # the request itself failed on some stage; the group keeps serving


@dataclass(frozen=True)
class Delta:
    token_ids: list[int]
    logprobs: list[tuple[float | None, list[tuple[int, float]] | None]] | None
    finish_reason: str | None = None  # set on the last delta of a request
    error: str | None = None  # the request ended without finishing: why
    error_kind: ErrorKind = ErrorKind.GROUP
    prompt_tokens: int = 0
    cached_tokens: int = 0
    # prompt_logprobs asked: (logprob, rank, top k) of prompt positions 1.., on the first delta
    prompt_logprobs: list[tuple[float, int, list[tuple[int, float]]]] | None = None

    @property
    def final(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class Sink(Protocol):
    def push(self, delta: Delta) -> None: ...


@dataclass(frozen=True)
class LoopStats:
    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    pending_tokens: int = 0
    last_token_at: float | None = None  # monotonic time of the last token produced
    tokens_generated: int = 0
    requests_finished: dict[str, int] = field(default_factory=dict)


@dataclass
class _Active:
    req: Request
    sink: Sink
    sent: int = 0
    traced: bool = False  # sampled for tracing: StageTraces follows it (checked per delta, no lookup)
    times: RequestTimes = field(default_factory=RequestTimes)  # stage 0's request timing


@dataclass(frozen=True)
class _Submit:
    req_id: str
    prompt: list[int]
    params: SamplingParams
    sink: Sink
    trace: RequestTrace | None = None


@dataclass(frozen=True)
class _Abort:
    req_id: str


def engine_thread() -> ThreadPoolExecutor:
    """The thread that builds the engine (submit build_engine to it) and then runs its EngineLoop."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-loop")


class EngineLoop:
    def __init__(self, engine: LLMEngine, max_waiting: int, thread: ThreadPoolExecutor | None = None) -> None:
        """thread: the one-thread executor that built `engine` (engine_thread()); the loop runs there.

        Why the same thread: torch's OpenMP pools are per calling thread, and a decode step run
        from a thread other than the one that loaded and packed the weights measured ~25 % slower
        (benchmarks/RESULTS.md). Without one, the loop gets a thread of its own.
        """
        self.engine = engine
        self._executor = thread
        self.max_waiting = max_waiting
        self.phase = ProcessPhase.JOINING  # the engine (and its ring) exists; the loop does not serve yet
        self.stop_reason: str | None = None
        self.failed = False  # the loop ended on an error (the group stopped), not a shutdown
        self.diverged = False  # ... and that stop was a divergence (errors.Diverged)
        self.stats = LoopStats(kv_blocks_total=engine.num_total_blocks)
        self._commands: queue.SimpleQueue[_Submit | _Abort] = queue.SimpleQueue()
        self._queued = 0  # submits not yet applied (admission counts them as waiting)
        self._lock = threading.Lock()  # guards _queued and the phase checks of submit()
        self._wake = threading.Event()
        self._active: dict[str, _Active] = {}
        self._live: set[str] = set()  # ids submitted and not yet given their final delta (under _lock)
        self._tokens = 0
        self._finished: dict[str, int] = {}
        self._last_token_at: float | None = None
        self._thread: threading.Thread | None = None
        self.timer = RequestTimer()  # request-timing histograms (stage/request_metrics.py)
        self.on_progress = lambda: None  # the wedge detector's beat
        # Tracing (stage/request_trace.py): only when this process exports traces; else no cost at all.
        self.traces: StageTraces | None = StageTraces() if tracing.enabled() else None
        engine.observer = self.traces
        self.done = threading.Event()  # set when the loop has ended (drained or stopped)

    # --- called from request handlers (any thread) -----------------------------
    def submit(
        self,
        req_id: str,
        prompt: list[int],
        params: SamplingParams,
        sink: Sink,
        trace: RequestTrace | None = None,
    ) -> None:
        """Queue a request (`trace`: its spans when sampled); raises InvalidRequestError, Overloaded or
        NotServing at once."""
        self.engine.validate(prompt, params)  # reads only the model's limits
        with self._lock:
            if self.phase is not ProcessPhase.READY:
                raise NotServing(self.status)
            if self.stats.waiting + self._queued >= self.max_waiting:
                raise Overloaded(f"admission queue full ({self.max_waiting} waiting)")
            if req_id in self._live:
                raise DuplicateRequest(f"request id {req_id!r} is already running")
            self._live.add(req_id)
            self._queued += 1
            self._commands.put(_Submit(req_id, list(prompt), params, sink, trace))
        self._wake.set()

    def abort(self, req_id: str) -> bool:
        """Abort a request (a client went away); True if it is still running."""
        found = req_id in self._active
        self._commands.put(_Abort(req_id))
        self._wake.set()
        return found

    @property
    def status(self) -> str:
        if self.phase is ProcessPhase.STOPPED:
            return f"stopped: {self.stop_reason}"
        return self.phase.value

    def pending_work(self) -> str | None:
        """What is owed, for the wedge detector; None when idle."""
        queued = self._commands.qsize()
        unfinished = self.engine.has_unfinished()
        if not queued and not unfinished:
            return None
        s = self.stats
        return (
            f"{queued} queued commands, {s.running} running, {s.waiting} waiting, "
            f"{self.engine.num_inflight_plans} plans in the ring"
        )

    # --- lifecycle -------------------------------------------------------------
    def start(self) -> None:
        self.phase = ProcessPhase.READY
        if self._executor is not None:
            self._executor.submit(self._run)
            return
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def drain(self) -> None:
        """Refuse new requests; the loop ends when the running ones have finished."""
        with self._lock:
            if self.phase is ProcessPhase.READY:
                self.phase = ProcessPhase.DRAINING
        self._wake.set()

    def end(self, reason: str) -> None:
        """Stop now: running requests end with `reason` as their error."""
        with self._lock:
            if self.phase is not ProcessPhase.STOPPED:
                self.stop_reason = reason
                self.phase = ProcessPhase.STOPPED
        self._wake.set()

    def join(self, timeout_s: float) -> bool:
        return self.done.wait(timeout_s)

    # --- the loop (its own thread) ---------------------------------------------
    def _run(self) -> None:
        try:
            while self.phase is not ProcessPhase.STOPPED:
                self._apply_commands()
                if self.phase is ProcessPhase.DRAINING and not self._active:
                    break
                if self.engine.has_unfinished():
                    self.timer.step_started()
                    self.engine.step()
                    self.on_progress()
                    self._publish()
                else:
                    self._wake.wait(IDLE_WAIT_S)
                    self._wake.clear()
        except GroupStopped as e:
            self.failed = True
            self.diverged = isinstance(e, Diverged)
            self.end(str(e))
        except Exception as e:  # a bug on stage 0: the group cannot go on; tell the followers at once
            log.exception("engine loop failed")
            reason = f"stage 0: engine loop failed: {type(e).__name__}: {e}"
            self.failed = True
            self.end(reason)
            self.engine.stop_group(reason)
        finally:
            self._fail_all(self.stop_reason or "server shutting down")
            if self.phase is not ProcessPhase.STOPPED:
                self.phase = ProcessPhase.STOPPED
                self.stop_reason = self.stop_reason or "shut down"
            self.done.set()

    def _apply_commands(self) -> None:
        applied = False
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            applied = True
            self.on_progress()
            if isinstance(cmd, _Abort):
                if (active := self._active.get(cmd.req_id)) is not None:
                    self.engine.abort(cmd.req_id)
                    self._send(cmd.req_id, active)
                continue
            with self._lock:
                self._queued -= 1
            try:
                req = self.engine.add_request(cmd.prompt, cmd.params, cmd.req_id)
            except InvalidRequestError as e:  # validated at submit; a race with nothing else
                self._final(cmd.req_id, cmd.sink, Delta([], None, error=str(e), error_kind=ErrorKind.INVALID))
                continue
            self._active[cmd.req_id] = active = _Active(req, cmd.sink)
            if cmd.trace is not None and self.traces is not None:
                self.traces.admitted(req, cmd.trace)
                active.traced = True
        if applied:  # the gauges show what was just admitted or aborted before the next plan runs
            self._update_stats()

    def _publish(self) -> None:
        for req_id, active in list(self._active.items()):
            self.timer.seen(active.times, active.req)
            if len(active.req.output_token_ids) > active.sent or active.req.is_finished:
                try:
                    self._send(req_id, active)
                except Exception as e:  # one request's failure, not the group's
                    log.exception(
                        "request %s: publishing its tokens failed", req_id, extra={"request_id": req_id}
                    )
                    self.engine.abort(req_id)  # its blocks go back on every stage with the next plan
                    self._active.pop(req_id, None)
                    why = f"request failed on stage 0: {type(e).__name__}: {e}"
                    self._final(req_id, active.sink, Delta([], None, error=why, error_kind=ErrorKind.FAILED))
        self._update_stats()

    def _final(self, req_id: str, sink: Sink, delta: Delta) -> None:
        """The request's last delta: its id may be submitted again from now on."""
        with self._lock:
            self._live.discard(req_id)
        if self.traces is not None:
            self.traces.finished(req_id, delta.finish_reason, delta.error)
        sink.push(delta)

    def _send(self, req_id: str, active: _Active) -> None:
        req = active.req
        new = req.output_token_ids[active.sent :]
        logprobs = req.output_logprobs[active.sent :] if req.params.logprobs is not None else None
        if new:
            self._tokens += len(new)
            self._last_token_at = time.monotonic()
        finish = req.finish_reason.value if req.is_finished and req.finish_reason else None
        first = active.sent == 0
        self.timer.delta(active.times, req, len(new), finish is not None)
        active.sent += len(new)
        if active.traced and new and self.traces is not None:
            self.traces.published(req_id, active.sent)
        if finish is not None:
            del self._active[req_id]
            self._finished[finish] = self._finished.get(finish, 0) + 1
        if req.finish_reason is FinishReason.ERROR:
            why = req.error or "the request failed"
            self._final(req_id, active.sink, Delta([], None, error=why, error_kind=ErrorKind.FAILED))
            return
        delta = Delta(
            list(new),
            list(logprobs) if logprobs is not None else None,
            finish,
            prompt_tokens=len(req.prompt_token_ids) if first or finish else 0,
            cached_tokens=req.num_cached_prompt_tokens if first or finish else 0,
            prompt_logprobs=list(req.prompt_scores)
            if first and req.params.prompt_logprobs is not None
            else None,
        )
        if finish is not None:
            self._final(req_id, active.sink, delta)
        else:
            active.sink.push(delta)

    def _fail_all(self, reason: str) -> None:
        """Every request still owed a final delta gets one (queued submits included)."""
        for req_id, active in self._active.items():
            self._final(req_id, active.sink, Delta([], None, error=reason))
        self._active.clear()
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Submit):
                self._final(cmd.req_id, cmd.sink, Delta([], None, error=reason))
        with self._lock:
            self._queued = 0

    def _update_stats(self) -> None:
        sched = self.engine.scheduler
        pending = 0
        for a in self._active.values():
            r = a.req
            pending += len(r.prompt_token_ids) + (r.params.max_tokens or 0) - len(r.output_token_ids)
        total = self.engine.num_total_blocks
        self.stats = LoopStats(
            running=len(self.engine.computing()),  # aborted requests' plans still in the ring count
            waiting=len(sched.waiting),
            kv_blocks_used=total - self.engine.num_free_blocks,
            kv_blocks_total=total,
            pending_tokens=pending,
            last_token_at=self._last_token_at,
            tokens_generated=self._tokens,
            requests_finished=dict(self._finished),
        )
