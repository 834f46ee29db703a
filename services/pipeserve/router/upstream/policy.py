"""Replica state and the picking policies, as pure functions of that state.

`GroupState` is what the router knows about one pipeline group: the last
Health and Load replies, the router's own count of requests in flight to it,
and whether the supervisor marked it down. The `pick_*` functions take a list
of states (and, where needed, a turn counter or a prompt) and return one
state or None; they never mutate and never do I/O, so they are tested
directly.

Load of a group = polled running + waiting, corrected by how many requests
the router started or finished there since that poll (`inflight -
inflight_at_poll`): the poll covers traffic from elsewhere, the router's own
count is fresher than any poll.

prefix_affinity: the key is a hash of the prompt's first AFFINITY_TOKENS token
ids; among the candidate groups the one with the highest xxhash of (group
name, key) wins (rendezvous hashing: when a group leaves, only the keys it
held move). If that group's load exceeds the least loaded group's by more than
`overload`, the pick falls back to least_load.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import xxhash

from pipeserve.lifecycle import ProcessPhase

AFFINITY_TOKENS = 16  # one KV block of the default block size: the prefix a group may have cached


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


def pick_round_robin(groups: Sequence[GroupState], turn: int) -> GroupState | None:
    return groups[turn % len(groups)] if groups else None


def pick_least_load(groups: Sequence[GroupState], turn: int = 0) -> GroupState | None:
    """Fewest running + waiting; ties by KV use, then by rotation from `turn` (spreads idle groups)."""
    if not groups:
        return None
    n = len(groups)
    best = min(range(n), key=lambda i: (groups[i].load, groups[i].kv_use, (i - turn) % n))
    return groups[best]


def affinity_key(prompt_ids: Sequence[int], tokens: int = AFFINITY_TOKENS) -> bytes:
    return xxhash.xxh64_digest(array("I", prompt_ids[:tokens]).tobytes())


def rendezvous(groups: Sequence[GroupState], key: bytes) -> GroupState | None:
    if not groups:
        return None
    return max(groups, key=lambda g: (xxhash.xxh64_intdigest(g.name.encode() + b"\0" + key), g.name))


def pick_prefix_affinity(
    groups: Sequence[GroupState], prompt_ids: Sequence[int], overload: int, turn: int = 0
) -> GroupState | None:
    chosen = rendezvous(groups, affinity_key(prompt_ids))
    if chosen is None:
        return None
    least = min(g.load for g in groups)
    if chosen.load - least > overload:
        return pick_least_load(groups, turn)
    return chosen


def pick(
    policy: str,
    groups: Sequence[GroupState],
    prompt_ids: Sequence[int],
    turn: int,
    overload: int,
) -> GroupState | None:
    """One of `groups` (already filtered by `candidates`) for this prompt under `policy`."""
    if policy == "round_robin":
        return pick_round_robin(groups, turn)
    if policy == "least_load":
        return pick_least_load(groups, turn)
    if policy == "prefix_affinity":
        return pick_prefix_affinity(groups, prompt_ids, overload, turn)
    raise ValueError(f"unknown policy {policy!r}")
