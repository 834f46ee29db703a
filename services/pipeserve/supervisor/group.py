"""GroupSlot: one pipeline group of `pipeserve up` — its ports, its processes, its life.

A slot owns fixed ports (stage 0's gRPC port, one side port per stage) so the
router's target for the group never changes across restarts. Each
incarnation is a fresh LocalGroup (a new rendezvous file, new processes);
a group is never repaired stage by stage: the communicator of a group that
lost a stage is broken, so the whole group is stopped and started again.

Its life is a `GroupRecord` (care/restarts.py): generation, phase, restarts,
backoff — the supervisor replaces it with each decision. `stopped` is set by
shutdown only (the decision function knows no shutdown).
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeserve.care.restarts import GroupRecord, StageObservation, StageState
from pipeserve.config import EngineConfig, StageServeConfig, config_argv
from pipeserve.local.launcher import LocalGroup
from pipeserve.local.ports import PortBook

log = logging.getLogger(__name__)


@dataclass
class GroupSlot:
    name: str
    config: EngineConfig
    serve: StageServeConfig
    grpc_port: int = 0
    health_ports: list[int] = field(default_factory=list)
    record: GroupRecord = field(default_factory=GroupRecord)
    stopped: bool = False  # shut down (no more decisions)
    group: LocalGroup | None = None
    started_at: float = 0.0  # when this incarnation's processes were started (monotonic)
    probe_failures: dict[int, int] = field(default_factory=dict)  # rank -> unanswered /livez in a row
    generation: int = 0  # the generation of the running incarnation (0: none)
    ports: PortBook = field(default_factory=PortBook)  # shared by the slots of one `up` (and its Redis)

    def __post_init__(self) -> None:
        host = self.serve.host
        if not self.grpc_port:
            self.grpc_port = self.ports.take(host)
        if not self.health_ports:
            self.health_ports = [self.ports.take(host) for _ in range(self.config.stages)]

    @property
    def grpc_target(self) -> str:
        return f"{self.serve.host}:{self.grpc_port}"

    def health_url(self, rank: int) -> str:
        return f"http://{self.serve.host}:{self.health_ports[rank]}"

    @property
    def restarts(self) -> int:
        return self.record.restarts

    @property
    def last_failure(self) -> str:
        return self.record.last_failure

    @property
    def state(self) -> str:
        return "stopped" if self.stopped else self.record.phase.name.lower()

    @property
    def pids(self) -> dict[int, int]:
        return self.group.pids if self.group else {}

    def start(self) -> None:
        group = LocalGroup(self.config)

        def argv(rank: int) -> list[str]:
            serve = dataclasses.replace(
                self.serve, health_port=self.health_ports[rank], grpc_port=self.grpc_port if rank == 0 else 0
            )
            return config_argv(serve, skip=set())

        group.start(range(self.config.stages), argv, log_name=self.log_name, group=self.name)
        self.group = group
        self.generation = self.record.generation  # stamped on this incarnation's processes
        self.started_at = time.monotonic()
        self.probe_failures = {}

    def log_name(self, rank: int) -> str:
        return f"{self.name}-stage-{rank}.log"

    def log_file(self, rank: int) -> Path | None:
        """Where stage `rank` logs: a file of --log-dir, or None (the supervisor's own stderr)."""
        return Path(self.config.log_dir) / self.log_name(rank) if self.config.log_dir else None

    def exited(self) -> dict[int, int]:
        """rank -> exit status of this incarnation's stages that have exited."""
        return self.group.exited() if self.group else {}

    def group_exited(self) -> bool:
        """A stage of this incarnation has exited (no need to probe the others: the decision is made)."""
        return bool(self.exited())

    def observe(self, ready: dict[int, bool], wedged: dict[int, str]) -> tuple[StageObservation, ...]:
        """This incarnation's stages as the decision function sees them (probe results from the caller)."""
        if self.group is None:
            return ()
        exited = self.group.exited()
        return tuple(
            StageObservation(
                rank=rank,
                generation=self.generation,
                state=StageState.EXITED if rank in exited else StageState.RUNNING,
                ready=ready.get(rank, False),
                wedged=wedged.get(rank, ""),
                exit_code=exited.get(rank),
            )
            for rank in self.group.procs
        )

    def kill(self, grace_s: float) -> dict[int, int]:
        """Stop a failed incarnation: every stage at once (SIGTERM, then SIGKILL after grace_s)."""
        if self.group is None:
            return {}
        for p in self.group.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        codes = self.group.stop(grace_s=grace_s)
        self.group = None
        return codes

    def shutdown(self, drain_s: float) -> dict[int, int]:
        """Clean stop: stage 0 drains and sends the Stop round the ring; stragglers are killed."""
        self.stopped = True
        if self.group is None:
            return {}
        stage0 = self.group.procs.get(0)
        if stage0 is not None and stage0.poll() is None:
            stage0.send_signal(signal.SIGTERM)
        codes = self.group.stop(grace_s=drain_s + 5.0)
        self.group = None
        self.stopped = True
        return codes

    def snapshot(self) -> dict:
        return {
            "name": self.name,
            "state": self.state,
            "generation": self.record.generation,
            "restarts": self.restarts,
            "last_failure": self.last_failure,
            "grpc": self.grpc_target,
            "health": [self.health_url(r) for r in range(self.config.stages)],
            "pids": {str(r): pid for r, pid in self.pids.items()},
        }
