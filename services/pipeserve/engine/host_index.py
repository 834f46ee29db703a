"""HostIndex: stage 0's index of L2, the host-memory tier (DESIGN.md section 5).

Every stage has a host pool of the same number of slots for its own layers;
only stage 0 decides which block lives in which slot, here, as its block
manager decides L1. Entries are LRU-ordered: a save into a full pool evicts
the least recently used entry, except a slot that a load in the plan being
built reads (`pinned` until `end_plan`): executors write saves before they
read loads, so evicting it would hand the load the new content.
A hit also compares the block's tokens, so a hash collision cannot alias.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class HostStats:
    saves: int = 0  # blocks copied L1 -> L2
    hits: int = 0  # blocks found in L2 by a prefix lookup
    evictions: int = 0  # entries dropped to make room
    skipped: int = 0  # saves not made: every slot pinned by this plan's loads


class HostIndex:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots: must be >= 1 (got {num_slots})")
        self.num_slots = num_slots
        self.entries: OrderedDict[int, tuple[int, tuple[int, ...]]] = OrderedDict()  # hash -> slot, tokens
        self._free = list(range(num_slots - 1, -1, -1))
        self.pinned: set[int] = set()
        self.stats = HostStats()

    def lookup(self, block_hash: int, tokens: tuple[int, ...]) -> int | None:
        """The slot holding this block, pinned for the plan being built; None on a miss."""
        entry = self.entries.get(block_hash)
        if entry is None or entry[1] != tokens:
            return None
        self.entries.move_to_end(block_hash)
        self.pinned.add(entry[0])
        self.stats.hits += 1
        return entry[0]

    def save(self, block_hash: int, tokens: tuple[int, ...]) -> int | None:
        """The slot to copy an evicted L1 block into, or None (already in L2, or no slot free)."""
        if block_hash in self.entries:
            self.entries.move_to_end(block_hash)
            return None
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((h for h, (s, _) in self.entries.items() if s not in self.pinned), None)
            if victim is None:
                self.stats.skipped += 1
                return None
            slot, _ = self.entries.pop(victim)
            self.stats.evictions += 1
        self.entries[block_hash] = (slot, tokens)
        self.stats.saves += 1
        return slot

    def end_plan(self) -> None:
        self.pinned.clear()

    @property
    def used(self) -> int:
        return len(self.entries)
