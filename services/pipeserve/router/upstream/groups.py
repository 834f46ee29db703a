"""What the router knows about one pipeline group (`GroupState`), and which groups are routable.

The replica set (router/upstream/replicas.py) keeps one state per group: the last Health and Load
replies, the router's own count of requests in flight to it, and whether the supervisor marked it
down. The policies (router/upstream/policy.py) pick among `candidates(...)`.

Load of a group = polled running + waiting, corrected by how many requests
the router started or finished there since that poll (`inflight -
inflight_at_poll`): the poll covers traffic from elsewhere, the router's own
count is fresher than any poll.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pipeserve.lifecycle import ProcessPhase


@dataclass
class GroupState:
    name: str
    target: str
    ready: bool = False
    status: str = "unknown"
    phase: ProcessPhase | None = None  # what stage 0's Health status names; None: unreachable or not said
    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    pending_tokens: int = 0
    seconds_since_token: float = -1.0
    max_model_len: int = 0
    vocab_size: int = 0
    inflight: int = 0  # requests the router has in flight to this group now
    inflight_at_poll: int = 0  # ... when the last Load reply arrived
    down_reason: str | None = None  # set by ReplicaSet.set_down; cleared by polls: unready, then ready
    down_at: float = 0.0
    down_seen_unready: bool = False
    polled_at: float = 0.0  # monotonic time of the last Health reply (0: never)
    slow_polls: int = 0  # polls in a row that timed out (a busy group, or a hung one)

    @property
    def routable(self) -> bool:
        return self.ready and self.down_reason is None

    @property
    def load(self) -> int:
        return max(0, self.running + self.waiting + self.inflight - self.inflight_at_poll)

    @property
    def kv_use(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def idle(self) -> bool:
        return self.load == 0


def candidates(groups: Iterable[GroupState], exclude: Iterable[str] = ()) -> list[GroupState]:
    """Routable groups not in `exclude`, in name order (a stable order for round-robin)."""
    skip = set(exclude)
    return sorted((g for g in groups if g.routable and g.name not in skip), key=lambda g: g.name)
