"""ProcessPhase: the one lifecycle vocabulary of a stage process, stage 0's engine loop, and a group as the
router sees it (from stage 0's Health status line).

    LOADING -> JOINING -> READY -> DRAINING -> STOPPED
                            \\________________/^   (a group stop goes straight to STOPPED)

A StrEnum, so it reads and serializes as the words the side port and Health have always used.
Not a group's restart phase (Pending, Starting, Ready, ...): that is care.restarts.GroupPhase.
"""

from __future__ import annotations

import enum


class ProcessPhase(enum.StrEnum):
    LOADING = "loading"  # the process is up; weights and KV pool being made
    JOINING = "joining"  # loaded; forming the ring (stage 0: its request server not serving yet)
    READY = "ready"  # the whole ring is formed and warm; stage 0 accepts requests
    DRAINING = "draining"  # SIGTERM: no new requests, running ones finish
    STOPPED = "stopped"  # shut down, or the group stopped (Health: "stopped: <cause>")

    @classmethod
    def of_status(cls, status: str) -> ProcessPhase | None:
        """The phase a status line names ("stopped: ring broken" -> STOPPED); None for other text."""
        word = status.partition(":")[0].strip()
        return cls(word) if word in cls._value2member_map_ else None
