"""The picking policies, as pure functions of the groups' state (router/upstream/groups.py).

The `pick_*` functions take a list
of states (and, where needed, a turn counter or a prompt) and return one
state or None; they never mutate and never do I/O, so they are tested
directly.

prefix_affinity: the key is a hash of the prompt's first AFFINITY_TOKENS token
ids; among the candidate groups the one with the highest xxhash of (group
name, key) wins (rendezvous hashing: when a group leaves, only the keys it
held move). If that group's load exceeds the least loaded group's by more than
`overload`, the pick falls back to least_load.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import xxhash

from pipeserve.router.upstream.groups import GroupState

AFFINITY_TOKENS = 16  # one KV block of the default block size: the prefix a group may have cached


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
