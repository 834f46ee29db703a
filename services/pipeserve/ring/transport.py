"""RingLink: one stage's two links in the ring — out to (rank+1) % S, in from (rank-1) % S.

Point-to-point sends over torch.distributed are rendezvous: a send completes
only once the peer has posted the matching receive (gloo behaves so even for a
few bytes; NCCL's first send on a pair also waits for the peer). A ring of
stages that each block on a send before receiving deadlocks as soon as every
stage holds a frame. The ordering rules below make that impossible; each is
pinned by a live-process test (tests/ring/test_pipeline_ordering.py) with a
variant that breaks it (ring/faults.py) and is caught by its deadline.

1. Receives are posted ahead. A receiver thread keeps a receive posted on the
   inbound link at all times and queues whole frames, so a predecessor's send
   completes whatever this stage is doing (computing, or sending itself).
2. Sends never block the loop. A frame is posted with asynchronous sends; the
   loop waits for a send to complete only when more than `max_pending` frames
   are outstanding on the link (never with the in-flight bound of stage 0).
3. Stage 0 sends what it owes before it waits. Each pass sends every plan it
   can schedule (up to max_inflight in the ring) before it blocks on the
   return link; it never holds a computed plan while waiting for a result.
4. Every wait has a deadline (ring_timeout_s): the receiver's wait for the
   next frame, the loop's wait on its inbox, a send's completion. Expiry is a
   group stop whose one log line names what was awaited from which stage. An
   idle ring stays inside its deadlines because stage 0 sends a heartbeat
   round the ring every heartbeat_s.
5. Links are warm before ready. A Hello goes round the whole ring with a
   one-row activation on the data link before any stage reports ready.
6. A stage blocks only on its predecessor (its inbox) and on its own sends,
   never on a reply from a successor.

Frames are typed (messages.py); activations travel as raw bytes of the
group's dtype on the data process group — NCCL when every stage has its own
GPU, else gloo (CPU stages; CUDA stages sharing a GPU stage through host
memory) — and metadata on the gloo group. A peer that dies closes its sockets, which fails the
pending receive at once; a peer that hangs is caught by the deadline.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from pipeserve.errors import GroupStopped
from pipeserve.ring.faults import Faults
from pipeserve.ring.group import CommGroup
from pipeserve.ring.messages import Frame, Stop, decode_frame, encode_frame

log = logging.getLogger(__name__)

TAG = 0
NO_DEADLINE_S = 3600.0  # what the no_deadline fault uses instead of ring_timeout_s


@dataclass(frozen=True)
class _LinkFailure:
    reason: str


@dataclass
class _PendingSend:
    works: list
    keep: list[torch.Tensor]  # buffers must outlive their sends
    what: str


class RingLink:
    def __init__(
        self,
        rank: int,
        world_size: int,
        meta_pg: CommGroup,
        data_pg: CommGroup,
        act_dtype: torch.dtype,
        device: torch.device,
        timeout_s: float,
        faults: Faults,
        max_pending: int = 4,
    ) -> None:
        self.rank = rank
        self.next = (rank + 1) % world_size
        self.prev = (rank - 1) % world_size
        self.meta_pg = meta_pg
        self.data_pg = data_pg
        self.act_dtype = act_dtype
        self.device = device
        self.timeout_s = NO_DEADLINE_S if faults.no_deadline else timeout_s
        self.blocking_io = faults.blocking_io
        self.max_pending = max_pending
        # Activations go through host memory when the data group is gloo (CPU, or
        # CUDA stages sharing one GPU, which NCCL cannot pair).
        self.via_host = data_pg is meta_pg and device.type != "cpu"
        self._pending: deque[_PendingSend] = deque()
        self._inbox: queue.Queue[tuple[Frame, torch.Tensor | None, bytes] | _LinkFailure] = queue.Queue()
        # The msgpack payload of the frame recv() returned last (the flight recorder keeps it).
        self.last_payload = b""
        self._receiver: threading.Thread | None = None
        self._closed = False

    # --- receiving ------------------------------------------------------------
    def start(self) -> None:
        """Post the standing receive (rule 1); the naive blocking_io transport has none."""
        if not self.blocking_io and self._receiver is None:
            self._receiver = threading.Thread(
                target=self._receive_loop, name=f"ring-recv-from-{self.prev}", daemon=True
            )
            self._receiver.start()

    def _receive_loop(self) -> None:
        while True:
            try:
                item = self._receive_frame()
            except GroupStopped as e:
                self._inbox.put(_LinkFailure(str(e)))
                return
            self._inbox.put(item)
            if isinstance(item[0], Stop):
                return  # the link is done: nothing follows a Stop

    def _receive_frame(self) -> tuple[Frame, torch.Tensor | None, bytes]:
        header = torch.empty(4, dtype=torch.int64)
        self._wait(self.meta_pg.recv([header], self.prev, TAG), f"no frame from stage {self.prev}")
        nbytes, rows, cols, _ = header.tolist()
        payload = torch.empty(nbytes, dtype=torch.uint8)
        self._wait(self.meta_pg.recv([payload], self.prev, TAG), f"frame body from stage {self.prev}")
        data = payload.numpy().tobytes()
        try:
            frame = decode_frame(data)
        except ValueError as e:  # msgspec.DecodeError / ValidationError
            raise GroupStopped(f"stage {self.rank}: undecodable frame from stage {self.prev}: {e}") from e
        acts = None
        if rows:
            on = torch.device("cpu") if self.via_host else self.device
            raw = torch.empty((rows, cols), dtype=torch.uint8, device=on)
            self._wait(self.data_pg.recv([raw], self.prev, TAG), f"activations from stage {self.prev}")
            if on.type == "cuda":
                torch.cuda.current_stream(on).synchronize()
            acts = raw.view(self.act_dtype).to(self.device)
        return frame, acts, data

    def recv(self) -> tuple[Frame, torch.Tensor | None]:
        """The next frame from the predecessor, within the deadline, or GroupStopped."""
        if self.blocking_io:
            item = self._receive_frame()
        else:
            item = self._next_item()
        frame, acts, self.last_payload = item
        return frame, acts

    def _next_item(self) -> tuple[Frame, torch.Tensor | None, bytes]:
        try:
            item = self._inbox.get(timeout=self.timeout_s + 1.0)
        except queue.Empty:
            raise GroupStopped(
                f"stage {self.rank}: deadline: no frame from stage {self.prev} within {self.timeout_s:g}s"
            ) from None
        if isinstance(item, _LinkFailure):
            raise GroupStopped(item.reason)
        return item

    @property
    def backlog(self) -> int:
        """Frames received from the predecessor and not yet taken by the loop (pending work)."""
        return self._inbox.qsize()

    def poll_stop(self, wait_s: float) -> Stop | None:
        """A Stop already queued (or arriving within wait_s), to name why a link broke."""
        deadline = time.monotonic() + wait_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                item = self._inbox.get(timeout=left)
            except queue.Empty:
                return None
            if not isinstance(item, _LinkFailure) and isinstance(item[0], Stop):
                return item[0]
        return None

    # --- sending --------------------------------------------------------------
    def send(self, frame: Frame, acts: torch.Tensor | None = None) -> bytes:
        """Post a frame to the successor without waiting for it (rule 2); returns its msgpack payload."""
        payload = encode_frame(frame)
        rows, cols = 0, 0
        keep: list[torch.Tensor] = []
        if acts is not None:
            raw = (acts.cpu() if self.via_host else acts).contiguous().view(torch.uint8)
            rows, cols = raw.shape
            keep.append(raw)
        header = torch.tensor([len(payload), rows, cols, 0], dtype=torch.int64)
        body = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        keep += [header, body]
        what = f"{type(frame).__name__.lower()} to stage {self.next}"
        try:
            works = [self.meta_pg.send([header], self.next, TAG), self.meta_pg.send([body], self.next, TAG)]
            if rows:
                works.append(self.data_pg.send([keep[0]], self.next, TAG))
        except RuntimeError as e:
            raise GroupStopped(f"stage {self.rank}: link to stage {self.next} failed: {e}") from e
        self._pending.append(_PendingSend(works, keep, what))
        limit = 0 if self.blocking_io else self.max_pending
        self._reap(limit)
        return payload

    def _reap(self, limit: int) -> None:
        while self._pending and (
            len(self._pending) > limit or all(w.is_completed() for w in self._pending[0].works)
        ):
            sent = self._pending.popleft()
            for w in sent.works:
                self._wait(w, f"send of {sent.what} not completed")

    def flush(self) -> None:
        """Wait until every posted frame has been received by the successor."""
        self._reap(0)

    def _wait(self, work: dist.Work, what: str) -> None:
        try:
            work.wait(timedelta(seconds=self.timeout_s))
        except RuntimeError as e:
            if "Timed out" in str(e):
                raise GroupStopped(
                    f"stage {self.rank}: deadline: {what} within {self.timeout_s:g}s"
                ) from None
            raise GroupStopped(f"stage {self.rank}: ring link broken ({what}): {_first_line(e)}") from None


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0][:300]
