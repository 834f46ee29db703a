"""Exceptions that cross module boundaries.

`InvalidRequestError` carries the offending field so the router can answer with
an OpenAI-style `{"error": {"param": ...}}` body; it subclasses ValueError so
offline callers can catch the usual type.
"""

from __future__ import annotations

import enum


class InvalidRequestError(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message


class ConfigError(ValueError):
    """An engine or stage setting is invalid."""


class ModelLoadError(RuntimeError):
    """A checkpoint cannot be served: missing files/tensors or an unsupported architecture."""


class GroupStopped(RuntimeError):
    """A pipeline group stopped: a plan mismatch, a dead or silent peer, or an expired deadline.

    The message is the one line that names the cause; every stage of the group exits
    non-zero, and stage 0's caller (the LLM driver, the server) gets this exception.
    `logged` is True once a stage has written its GROUP STOP line for it (one line
    per stop, not one per frame it unwinds through).
    """

    def __init__(self, reason: str, logged: bool = False) -> None:
        super().__init__(reason)
        self.logged = logged


class Diverged(GroupStopped):
    """The group stopped because its stages did not execute the same plan (a digest or a result that
    differs, a plan a follower could not apply): the congruence law broken, counted apart from other
    stops (ExitCode.DIVERGED, `cause="diverged"` of the restart counter)."""


class ExitCode(enum.IntEnum):
    """Every exit status a pipeserve process uses; the supervisor and the operator read them."""

    OK = 0  # clean shutdown (SIGTERM drained, or the ring's clean Stop)
    INTERNAL_ERROR = 1  # an unexpected exception: a bug; logged with its traceback, never a silent teardown
    CANNOT_START = 2  # configuration or checkpoint error: restarting will not help
    GROUP_STOP = 3  # the pipeline group stopped (a peer died, hung or diverged): restart the whole group
    WEDGED = 4  # the stage's wedge detector fired (work pending, no progress)
    DIVERGED = 5  # this stage saw the group's stages execute different plans: restart the whole group
