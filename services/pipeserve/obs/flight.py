"""The flight recorder: the last plans a stage handled, kept in memory and written out when it matters.

What one record holds (all of it bytes that exist anyway on the hot path — nothing is serialized
for the recorder):
  stage 0   the Forward frame's msgpack payload as it went to stage 1 (`forward`: the plan exactly as
            the followers received it, with stage 0's report), the digest stage 0 sealed the plan
            with (`digest`; the plan in `forward` carries another one if it was altered in flight),
            a digest of the activations it produced (`act_digest`), and — once it came back — the
            Result frame's payload (`out`: every stage's report and the sampled tokens).
  stage k   the Forward payload it received (`forward`), the frame its step sent on (`out`: a
            Forward with its own report appended, or the Result on the last stage) and `act_digest`.
`act_digest` is xxh3 over the activation tensor's bytes, taken only when the tensor is on the CPU
(a device tensor is never synchronized for a log): None otherwise.

The bound: at most `max_records` records AND at most `max_bytes`, where a record costs its payload
bytes plus RECORD_OVERHEAD (the Python objects around them, measured in tests/obs/test_flight.py);
the oldest records are dropped first and counted in `dropped`. So a recorder holds at most
`max_bytes` (default 64 MiB) plus the in-flight record being built.

A dump (`dump(reason)`: a group stop, a wedge, SIGUSR1 through `DumpOnSignal`) writes a versioned
FlightDump — the records, every thread's stack, what replay needs to rebuild the stage — as msgpack
to `<dir>/flight-<group or pid>-rank<k>-<UTC time>.msgpack` and logs ONE line naming the file.
`read_dump` refuses a file of another version with FlightFormatError. Nothing is pickled.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import threading
import time
from collections import deque
from datetime import UTC, datetime
from pathlib import Path

import msgspec

from pipeserve import env as pipeserve_env
from pipeserve.obs.logs import GROUP_ENV
from pipeserve.obs.stacks import thread_stacks

log = logging.getLogger(__name__)

VERSION = 1
RECORD_OVERHEAD = 256  # bytes charged per record beyond its payloads: the struct, bytes headers, deque slot
DIR_ENV = pipeserve_env.FLIGHT_DIR  # where dumps go when the config names no directory


class FlightFormatError(ValueError):
    """The file is not a flight dump this pipeserve can read (another version, or not a dump)."""


class FlightRecord(msgspec.Struct, gc=False):
    """One plan as one stage handled it (see the module docstring for each field)."""

    step_id: int
    at: float  # wall-clock time (time.time()) the plan was sent (stage 0) or received (stage k)
    forward: bytes
    digest: int | None = None  # stage 0 only: the digest it sealed
    act_digest: int | None = None
    out: bytes | None = None

    @property
    def nbytes(self) -> int:
        return len(self.forward) + len(self.out or b"") + RECORD_OVERHEAD


class StageSetup(msgspec.Struct, frozen=True):
    """What replay needs to rebuild the group's stages offline (the recording stage's view)."""

    layer_split: str  # every stage's layers, "0:2,2:4"
    block_size: int
    num_blocks: int  # the group's pool size (block ids in plans are below it)
    max_model_len: int
    dtype: str
    seed: int
    num_threads: int  # torch intra-op threads of the recording stage (replay uses the same)
    host_slots: int  # L2 slots (0: none)
    l3: bool
    # Weight-only quantization the group served with (model/quant.py): replay loads the same weights.
    quantization: str = "none"
    quantization_group_size: int = 32
    # The KV pool's dtype ("float16", ...; kv_cache_dtype resolved); "" in dumps from before it was
    # recorded: the model's dtype.
    kv_dtype: str = ""


class FlightDump(msgspec.Struct, frozen=True):
    version: int
    rank: int
    stages: int
    group: str
    pid: int
    reason: str
    written_at: float
    setup: StageSetup
    dropped: int  # records dropped by the bound before this dump (0: the window starts at step 1)
    records: list[FlightRecord]
    stacks: str


class _Version(msgspec.Struct):
    version: int


class FlightRecorder:
    """A bounded ring buffer of FlightRecords; thread-safe (the stage's loop records, any thread dumps)."""

    def __init__(
        self,
        rank: int,
        stages: int,
        setup: StageSetup,
        max_records: int,
        max_bytes: int,
        directory: str | Path,
        group: str | None = None,
    ) -> None:
        if max_records < 0 or max_bytes < RECORD_OVERHEAD:
            raise ValueError(f"flight recorder: bad bound ({max_records} records, {max_bytes} bytes)")
        self.rank = rank
        self.stages = stages
        self.setup = setup
        self.max_records = max_records
        self.max_bytes = max_bytes
        self.directory = Path(directory)
        self.group = group if group is not None else (pipeserve_env.get(GROUP_ENV) or "")
        self.dropped = 0
        self.dumps: list[Path] = []
        self._records: deque[FlightRecord] = deque()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.max_records > 0

    @property
    def nbytes(self) -> int:
        """Bytes charged for the records held now (never above max_bytes)."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._records)

    # --- recording (the hot path: a deque append and two additions) ------------
    def record(
        self, step_id: int, forward: bytes, digest: int | None = None, act_digest: int | None = None
    ) -> FlightRecord | None:
        """Keep a plan's Forward payload; returns the record (to `complete` later), None when off."""
        if not self.enabled:
            return None
        rec = FlightRecord(step_id, time.time(), forward, digest, act_digest)
        with self._lock:
            self._records.append(rec)
            self._bytes += rec.nbytes
            self._evict()
        return rec

    def complete(self, rec: FlightRecord | None, out: bytes, act_digest: int | None = None) -> None:
        """Attach what the step produced (the Result on stage 0, the frame sent on by a follower)."""
        if rec is None:
            return
        with self._lock:
            held = any(r is rec for r in reversed(self._records))  # dropped meanwhile: nothing to charge
            if held:
                self._bytes -= rec.nbytes
            rec.out = out
            if act_digest is not None:
                rec.act_digest = act_digest
            if held:
                self._bytes += rec.nbytes
                self._evict()

    def find(self, step_id: int) -> FlightRecord | None:
        """The newest record of `step_id` (plans in flight are the newest few: a short scan)."""
        with self._lock:
            for rec in reversed(self._records):
                if rec.step_id == step_id:
                    return rec
        return None

    def _evict(self) -> None:
        while self._records and (len(self._records) > self.max_records or self._bytes > self.max_bytes):
            self._bytes -= self._records.popleft().nbytes
            self.dropped += 1

    # --- dumping ----------------------------------------------------------------
    def snapshot(self, reason: str) -> FlightDump:
        with self._lock:
            records = [msgspec.structs.replace(r) for r in self._records]  # copies: `out` may change
            dropped = self.dropped
        return FlightDump(
            VERSION,
            self.rank,
            self.stages,
            self.group,
            os.getpid(),
            reason,
            time.time(),
            self.setup,
            dropped,
            records,
            thread_stacks(),
        )

    def path_for(self, now: datetime) -> Path:
        who = re.sub(r"[^A-Za-z0-9_.-]", "_", self.group) if self.group else str(os.getpid())
        return self.directory / f"flight-{who}-rank{self.rank}-{now.strftime('%Y%m%dT%H%M%S.%fZ')}.msgpack"

    def dump(self, reason: str) -> Path | None:
        """Write the records with every thread's stack; log one line naming the file.

        Never raises: a dump that cannot be written is logged and the caller's stop goes on."""
        if not self.enabled:
            return None
        try:
            snap = self.snapshot(reason)
            data = msgspec.msgpack.encode(snap)
            path = self.path_for(datetime.now(UTC))
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".partial")
            tmp.write_bytes(data)
            tmp.replace(path)  # a reader never sees half a file
        except OSError as e:
            log.warning("flight record not written (%s): %s", reason, e)
            return None
        self.dumps.append(path)
        first_line = reason.splitlines()[0][:200] if reason else ""
        log.warning("flight record written: %s (%d plans, %s)", path, len(snap.records), first_line)
        return path


def read_dump(path: str | Path) -> FlightDump:
    """Decode a dump (msgspec, no pickle); FlightFormatError for another version or a foreign file."""
    data = Path(path).read_bytes()
    try:
        version = msgspec.msgpack.decode(data, type=_Version).version
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise FlightFormatError(f"{path}: not a pipeserve flight dump ({e})") from None
    if version != VERSION:
        raise FlightFormatError(
            f"{path}: flight dump version {version} is not supported (this pipeserve reads version {VERSION})"
        )
    try:
        return msgspec.msgpack.decode(data, type=FlightDump)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise FlightFormatError(f"{path}: damaged flight dump ({e})") from None


def default_directory() -> Path:
    """$PIPESERVE_FLIGHT_DIR, else $PIPESERVE_HOME/flight (PIPESERVE_HOME defaults to ~/.cache/pipeserve,
    as for the default model)."""
    if env := pipeserve_env.get(DIR_ENV):
        return Path(env)
    return pipeserve_env.home() / "flight"


class DumpOnSignal:
    """SIGUSR1 writes the recorder's dump. The handler only sets an Event (no I/O, no locks of the
    interrupted code); a daemon thread waits on it — with a deadline per wait — and dumps."""

    def __init__(self, recorder: FlightRecorder, signum: int = signal.SIGUSR1) -> None:
        self.recorder = recorder
        self.signum = signum
        self._wanted = threading.Event()

    def install(self) -> None:
        """From the main thread (Python's rule for signal handlers)."""
        signal.signal(self.signum, self._handler)
        threading.Thread(target=self._loop, name="flight-dump", daemon=True).start()

    def _handler(self, signum: int, frame: object) -> None:
        self._wanted.set()

    def _loop(self) -> None:
        while True:
            if self._wanted.wait(timeout=1.0):
                self._wanted.clear()
                self.recorder.dump(f"signal {signal.Signals(self.signum).name}")
