"""Exceptions that cross module boundaries.

`InvalidRequestError` carries the offending field so the router can answer with
an OpenAI-style `{"error": {"param": ...}}` body; it subclasses ValueError so
offline callers can catch the usual type.
"""

from __future__ import annotations


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


EXIT_GROUP_STOP = 3  # exit status of every stage of a stopped group
