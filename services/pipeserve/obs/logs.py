"""Logging set-up shared by every pipeserve process: text or JSON lines, with the process's identity.

    pipeserve [--log-format text|json] [--log-level LEVEL] COMMAND ...   (or after COMMAND)
    PIPESERVE_LOG_FORMAT=json PIPESERVE_LOG_LEVEL=DEBUG pipeserve up ...

`configure_logging` installs one handler on the root logger (sys.stderr) and exports the chosen format
and level into the environment, so every process `pipeserve up` or `LLM(stages=S)` spawns (they
inherit the parent's environment: local/launcher.py) logs the same way. A stage process then names
itself with `set_identity(group, stage)`; a request handler binds the request id for the code it
calls with `request_context(req_id)` (a contextvar: it follows asyncio tasks and is per thread), or a
log call passes `extra={"request_id": ...}` itself (the engine loop serves many requests on one
thread).

JSON lines (`--log-format json`, for log shippers): one object per line with the keys
  time (RFC 3339, UTC, milliseconds, "Z"), level, logger, message, group, stage, request_id
  (null when unknown), and exc_info (the formatted traceback) when the record has one.
The text format is the classic `time LEVEL logger: message`, with `[group g0 stage 1 request r]`
before the message for the parts that are known.

Nothing here imports torch: building the CLI parser must stay light (cli.py's import contract).
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import json
import logging
import os
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import IO

from pipeserve import env as pipeserve_env
from pipeserve.errors import ConfigError

FORMAT_ENV = pipeserve_env.LOG_FORMAT
LEVEL_ENV = pipeserve_env.LOG_LEVEL
GROUP_ENV = pipeserve_env.GROUP  # the group a stage process belongs to (set by its launcher)
FORMATS = ("text", "json")
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(where)s%(message)s"

# The request the current code serves. A ContextVar (not mutable module state): every thread and
# asyncio task sees its own value, and `request_context` restores the previous one on exit.
_REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("pipeserve_request_id", default=None)


@contextlib.contextmanager
def request_context(request_id: str | None) -> Iterator[None]:
    """Log records emitted inside this block (this thread / task) carry `request_id`."""
    token = _REQUEST_ID.set(request_id)
    try:
        yield
    finally:
        _REQUEST_ID.reset(token)


class ContextFilter(logging.Filter):
    """Stamps each record with `group`, `stage` and `request_id` (an `extra=` value wins, then the
    request context, then the process identity); never drops a record."""

    def __init__(self, group: str | None = None, stage: int | None = None) -> None:
        super().__init__()
        self.group = group
        self.stage = stage

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = _REQUEST_ID.get()
        if getattr(record, "group", None) is None:
            record.group = self.group
        if getattr(record, "stage", None) is None:
            record.stage = self.stage
        return True


def rfc3339(created: float) -> str:
    """A record's time as RFC 3339 in UTC with milliseconds: 2026-12-03T17:21:04.123Z."""
    return datetime.fromtimestamp(created, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (newlines in messages and tracebacks are escaped)."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, object] = {
            "time": rfc3339(record.created),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "group": getattr(record, "group", None),
            "stage": getattr(record, "stage", None),
            "request_id": getattr(record, "request_id", None),
        }
        if record.exc_info:
            doc["exc_info"] = self.formatException(record.exc_info)
        elif record.exc_text:
            doc["exc_info"] = record.exc_text
        if record.stack_info:
            doc["stack_info"] = self.formatStack(record.stack_info)
        return json.dumps(doc, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    """`time LEVEL logger: [group g stage k request r] message`, the brackets only when known."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        parts = []
        for key, label in (("group", "group"), ("stage", "stage"), ("request_id", "request")):
            if (value := getattr(record, key, None)) is not None:
                parts.append(f"{label} {value}")
        record.where = f"[{' '.join(parts)}] " if parts else ""
        return super().format(record)


def check_format(value: str) -> str:
    if value not in FORMATS:
        raise ConfigError(f"log format {value!r}: must be one of {', '.join(FORMATS)} ({FORMAT_ENV})")
    return value


def check_level(value: str) -> str:
    level = value.strip().upper()
    if level not in LEVELS:
        raise ConfigError(f"log level {value!r}: must be one of {', '.join(LEVELS)} ({LEVEL_ENV})")
    return level


def add_log_args(parser: argparse.ArgumentParser) -> None:
    """--log-format and --log-level, on the top-level parser and on every subcommand's. No default
    (argparse.SUPPRESS): the attribute exists only when given, so a subcommand's copy never
    overwrites what was given before the subcommand; the environment supplies the rest."""
    g = parser.add_argument_group("logging")
    g.add_argument(
        "--log-format",
        choices=FORMATS,
        default=argparse.SUPPRESS,
        help=f"text (default) or json: one JSON object per line, for log shippers; also {FORMAT_ENV}",
    )
    g.add_argument(
        "--log-level",
        type=str.upper,
        choices=LEVELS,
        default=argparse.SUPPRESS,
        help=f"default INFO; also {LEVEL_ENV}",
    )


def configure_from_args(args: argparse.Namespace) -> logging.Handler:
    """configure_logging with the flags add_log_args parsed (the environment for those not given)."""
    return configure_logging(getattr(args, "log_format", None), getattr(args, "log_level", None))


def configure_logging(
    fmt: str | None = None,
    level: str | None = None,
    *,
    group: str | None = None,
    stage: int | None = None,
    stream: IO[str] | None = None,
    export: bool = True,
) -> logging.Handler:
    """Install the process's log handler on the root logger (replacing one installed before).

    `fmt`/`level` None: from PIPESERVE_LOG_FORMAT / PIPESERVE_LOG_LEVEL, else text / INFO; `group`
    None: from PIPESERVE_GROUP. Raises ConfigError for an unknown format or level. `export`: write
    the chosen format and level into os.environ, so child processes inherit them.
    """
    fmt = check_format(fmt or pipeserve_env.get(FORMAT_ENV) or "text")
    level = check_level(level or pipeserve_env.get(LEVEL_ENV) or "INFO")
    if group is None:
        group = pipeserve_env.get(GROUP_ENV)
    handler = logging.StreamHandler(stream) if stream is not None else _StderrHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(ContextFilter(group, stage))
    root = logging.getLogger()
    for old in [h for h in root.handlers if _is_ours(h)]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(level)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request (probes, bench) otherwise
    logging.getLogger("httpcore").setLevel(logging.WARNING)
    if export:
        os.environ[FORMAT_ENV] = fmt
        os.environ[LEVEL_ENV] = level
    return handler


def set_identity(group: str | None = None, stage: int | None = None) -> None:
    """Name this process's group and stage on every record from now on (a stage process, once it
    knows its rank). `group` None keeps what configure_logging found."""
    for h in logging.getLogger().handlers:
        for f in h.filters:
            if isinstance(f, ContextFilter):
                f.group = group if group is not None else f.group
                f.stage = stage


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a record is emitted (as logging's lastResort does), so a
    later redirect of sys.stderr (a test's capture, a daemon's log file) is followed."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)

    @property
    def stream(self) -> IO[str]:
        return sys.stderr


def _is_ours(handler: logging.Handler) -> bool:
    return any(isinstance(f, ContextFilter) for f in handler.filters)
