"""The stage process: `pipeserve stage` after its flags are parsed (cli.py) — one rank of a group.

`run_stage` never returns: the process ends with an ExitCode, never through
interpreter teardown (destroying a process group whose receiver thread is
blocked in a native wait aborts the process, turning a clean status into
SIGABRT). Stage 0 serves requests (stage/server.py); a stage k > 0 runs the
follower loop (ring/follower.py) under a wedge detector. Both answer on the
side port from the first moment (care/health.py).

Exit statuses: a group stop (GroupStopped) is GROUP_STOP, DIVERGED when the stages
executed different plans (errors.Diverged: a digest or result that differs, a plan a
follower cannot apply); a configuration or checkpoint this stage cannot serve is
CANNOT_START; anything else — also an exception escaping any thread of the stage —
is INTERNAL_ERROR with its traceback. A locally launched stage (PIPESERVE_PARENT_PID set) ignores SIGINT
(its parent decides when the group stops) and exits when the parent is gone.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from typing import NoReturn

from pipeserve import env as pipeserve_env
from pipeserve.care.health import SidePort, StageStatus
from pipeserve.care.wedge import WedgeDetector
from pipeserve.config import EngineConfig, StageServeConfig
from pipeserve.errors import Diverged, ExitCode, GroupStopped, ModelLoadError
from pipeserve.lifecycle import ProcessPhase
from pipeserve.local.launcher import PARENT_ENV
from pipeserve.obs.flight import DumpOnSignal
from pipeserve.obs.logs import set_identity
from pipeserve.obs.tracing import setup_tracing
from pipeserve.ring.follower import Follower
from pipeserve.ring.group import Rendezvous
from pipeserve.stage.assemble import build_stage
from pipeserve.stage.cache_metrics import stage_tier_metrics
from pipeserve.stage.engine_metrics import busy_metrics
from pipeserve.stage.server import serve_leader

log = logging.getLogger("pipeserve.stage")
TRACE_FLUSH_S = 3.0  # spans still queued at exit get this long to be exported


def run_stage(config: EngineConfig, serve: StageServeConfig, rdzv: Rendezvous) -> NoReturn:
    """Run rank `rdzv.rank` of the group until it ends; exit the process with its status."""
    set_identity(stage=rdzv.rank)  # every log line of this process names its stage (and group)
    if parent := pipeserve_env.get(PARENT_ENV):
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when the group stops
        _watch_parent(int(parent), rdzv.rank)
    threading.excepthook = _thread_died
    # Before anything is built: the follower and stage 0's server ask whether this process traces.
    traces = setup_tracing("pipeserve-stage", {"pipeserve.stage": rdzv.rank})
    try:
        code = _serve(config, serve, rdzv)
    except GroupStopped as e:
        if not e.logged:
            log.error("GROUP STOP: %s", e)
        code = ExitCode.DIVERGED if isinstance(e, Diverged) else ExitCode.GROUP_STOP
    except (ValueError, ModelLoadError) as e:  # ConfigError, a checkpoint this stage cannot serve
        log.error("stage %d cannot start: %s", rdzv.rank, e)
        code = ExitCode.CANNOT_START
    except Exception:  # a bug: a defined status and the traceback, never the interpreter's teardown
        log.exception("stage %d: unexpected error", rdzv.rank)
        code = ExitCode.INTERNAL_ERROR
    traces.shutdown(TRACE_FLUSH_S)  # os._exit runs no atexit hook: export what is queued now
    _exit_now(code)


def _serve(config: EngineConfig, serve: StageServeConfig, rdzv: Rendezvous) -> int:
    status = StageStatus(rdzv.rank, config.stages)
    if serve.health_port:
        SidePort(status, serve.host, serve.health_port).start()
    if rdzv.rank == 0:
        return serve_leader(config, serve, rdzv, status)
    status.phase = ProcessPhase.JOINING
    stage = build_stage(config, rdzv)
    if stage.runner.grammar is not None:  # the last stage: its first structured request pays no start-up
        # Beside the follower loop, not before it: stage 0's Hello waits on this stage under
        # ring_timeout_s, and reading the tokenizer takes seconds on a busy CPU (the group stopped
        # while forming); a compile meanwhile waits on the book's lock.
        threading.Thread(target=stage.runner.grammar.book.warm, name="grammar-warm", daemon=True).start()
    follower = Follower(stage)
    detector = WedgeDetector(
        f"stage {rdzv.rank}", follower.pending_work, serve.wedge_timeout_s, serve.wedge_grace_s
    )
    status.detector = detector
    status.sources.append(lambda: busy_metrics(stage.runner.meter))
    status.sources.append(lambda: stage_tier_metrics(stage.tiers))
    follower.on_frame = detector.beat
    detector.on_wedge = lambda: follower.flight.dump(f"wedge: {detector.report}")
    DumpOnSignal(follower.flight).install()  # SIGUSR1: write the flight record
    follower.on_ready = lambda: setattr(status, "phase", ProcessPhase.READY)
    detector.start()
    code = follower.run()
    status.phase = ProcessPhase.STOPPED
    if stage.tiers is not None:
        stage.tiers.close()  # pages still queued for L3 get a bounded chance to be written
    return code


def _watch_parent(pid: int, rank: int) -> None:
    """A locally launched stage exits when the process that started it is gone (no orphans)."""

    def loop() -> None:
        while os.getppid() == pid:
            time.sleep(0.5)
        log.error("GROUP STOP: stage %d: parent process %d exited", rank, pid)
        os._exit(ExitCode.GROUP_STOP)

    threading.Thread(target=loop, name="parent-watch", daemon=True).start()


def _exit_now(code: int) -> NoReturn:
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _thread_died(args: threading.ExceptHookArgs) -> None:
    """An exception escaped one of a stage's threads: the stage cannot be trusted to go on."""
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else "?"
    exc = args.exc_value if args.exc_value is not None else args.exc_type()
    log.critical("thread %s died: %s", name, exc, exc_info=(args.exc_type, exc, args.exc_traceback))
    _exit_now(ExitCode.INTERNAL_ERROR)
