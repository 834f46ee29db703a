"""Generate calls to stage 0: deadlines, error mapping, the failure notes (the retry rule: upstream.py).

* Every read of a Generate stream has a deadline: `first_token_timeout_s` for
  the first message, `stream_idle_timeout_s` for each later one (asyncio.wait_for
  around `read()`). On expiry the call is cancelled and, because a stalled group
  may be slow to notice, an Abort by request id follows in the background
  (`rpc_timeout_s` deadline).
* `RETRYABLE` and `UpstreamFailure.group_died` are what the retry rule (upstream.py) reads.
* Only UNAVAILABLE takes a group out of routing: a client's error or one
  request's failure says nothing about the group's health.
* gRPC cancellation aborts the request on stage 0 (its KV blocks are freed), so
  `GenerateStream.close()` — synchronous, safe in a `finally` that runs under
  cancellation — is all a caller needs when it stops early (stop string, client
  gone).
* Error mapping: INVALID_ARGUMENT ("param: message") and ALREADY_EXISTS -> 400
  with that param; RESOURCE_EXHAUSTED -> 429; UNAVAILABLE / DEADLINE_EXCEEDED /
  CANCELLED -> 503; INTERNAL (the request failed on a stage) and others -> 500.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from pipeserve.config import RouterConfig
from pipeserve.obs.ratelimit import RateLimitedLog
from pipeserve.router import errors
from pipeserve.router.errors import APIError
from pipeserve.router.upstream.metrics import RouterMetrics
from pipeserve.router.upstream.replicas import ReplicaSet
from pipeserve.router.upstream.trace import GenerateSpan
from pipeserve.rpc import generation_pb2 as pb
from pipeserve.rpc.metadata import ADMITTED_KEY

log = logging.getLogger("pipeserve.router")
LOG_INTERVAL_S = 30.0  # repeated failure lines of one kind: at most one per this many seconds

Code = grpc.StatusCode
RETRYABLE = frozenset({Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED, Code.RESOURCE_EXHAUSTED, Code.CANCELLED})
# Codes by which a group says it is going away: with the request admitted, it saw its group die.
GROUP_GONE = frozenset({Code.UNAVAILABLE, Code.CANCELLED})


class UpstreamFailure(Exception):
    def __init__(self, group: str, code: grpc.StatusCode, details: str, admitted: bool = False) -> None:
        super().__init__(f"group {group}: {code.name}: {details}")
        self.group = group
        self.code = code
        self.details = details
        self.admitted = admitted  # stage 0 had admitted the request when the call failed

    @property
    def group_died(self) -> bool:
        """The request was inside the group when the group failed: never carry it to another."""
        return self.admitted and self.code in GROUP_GONE


def to_api_error(f: UpstreamFailure) -> APIError:
    if f.code in (Code.INVALID_ARGUMENT, Code.ALREADY_EXISTS):
        param, sep, message = f.details.partition(": ")
        return errors.invalid(param if sep else None, message if sep else f.details)
    if f.code == Code.RESOURCE_EXHAUSTED:
        return errors.too_many_requests(f"every ready group is at capacity ({f.details})")
    if f.code in (Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED, Code.CANCELLED):
        return errors.unavailable(f"upstream group {f.group} failed: {f.code.name}: {f.details}")
    return errors.internal(f"upstream group {f.group} failed: {f.code.name}: {f.details}")


class GenerateStream:
    """One Generate call on one group; `open()` returns its first message."""

    def __init__(self, calls: Calls, group: str, request: pb.GenerateRequest) -> None:
        self.calls = calls
        self.group = group
        self.request = request
        self.finished = False  # the last message (finish_reason set) has been read
        self.retries = 0  # failed attempts on other groups before this one (Upstream.open sets it)
        self._call: grpc.aio.UnaryStreamCall | None = None
        self._acquired = False
        self._span: GenerateSpan | None = None

    async def open(self) -> pb.GenerateResponse:
        replicas = self.calls.replicas
        target = replicas.groups[self.group].target
        replicas.acquire(self.group)
        self._acquired = True
        self._span = span = GenerateSpan(self.group, target, self.request.request_id)  # a no-op untraced
        self._call = replicas.stub(self.group).Generate(self.request, metadata=span.metadata or None)
        return await self._read(self.calls.config.first_token_timeout_s, "first")

    async def next(self) -> pb.GenerateResponse | None:
        """The next message, or None once the last one has been read."""
        if self.finished:
            return None
        return await self._read(self.calls.config.stream_idle_timeout_s, "next")

    async def _read(self, timeout: float, which: str) -> pb.GenerateResponse:
        call = self._call
        if call is None:
            raise RuntimeError("read before open")
        try:
            msg = await asyncio.wait_for(call.read(), timeout)
        except TimeoutError:
            self._end_span(Code.DEADLINE_EXCEEDED, f"no {which} message within {timeout}s")
            self.close()
            self.calls.abort_later(self.group, self.request.request_id)
            raise UpstreamFailure(
                self.group, Code.DEADLINE_EXCEEDED, f"no {which} message within {timeout}s"
            ) from None
        except grpc.aio.AioRpcError as e:
            self._end_span(e.code(), e.details() or "")
            self.close()
            md = (*(e.initial_metadata() or ()), *(e.trailing_metadata() or ()))
            admitted = ADMITTED_KEY in dict(md)  # either: stage/server.py
            raise UpstreamFailure(self.group, e.code(), e.details() or "", admitted) from None
        if msg is grpc.aio.EOF:
            self._end_span(Code.UNAVAILABLE, "stream ended without a finish_reason")
            self.close()
            admitted = ADMITTED_KEY in dict(await call.initial_metadata() or ())
            raise UpstreamFailure(
                self.group, Code.UNAVAILABLE, "stream ended without a finish_reason", admitted
            )
        if msg.finish_reason:
            # The call ends by itself with the last message: release it, do not cancel it.
            self.finished = True
            self._end_span(Code.OK if msg.finish_reason != "abort" else Code.UNAVAILABLE, msg.finish_reason)
            self._release()
            if msg.finish_reason == "abort":  # not ours: we cancel, we never Abort a live stream
                raise UpstreamFailure(self.group, Code.UNAVAILABLE, "the group aborted the request")
        return msg

    def close(self) -> None:
        """Cancel the call if it is still running (stage 0 aborts the request); idempotent."""
        if self._call is not None and not self.finished and not self._call.done():
            self._call.cancel()
        self._end_span(Code.CANCELLED, "cancelled by the router")  # no-op if it ended already
        self._release()

    def _end_span(self, code: grpc.StatusCode, details: str) -> None:
        if self._span is not None:
            self._span.end(code, details)

    def _release(self) -> None:
        if self._acquired:
            self._acquired = False
            self.calls.replicas.release(self.group)


class Calls:
    """What every Generate call shares: the groups' channels and in-flight counts, the deadlines,
    the metrics, the failure log and the background Aborts (one per router, owned by Upstream)."""

    def __init__(self, replicas: ReplicaSet, config: RouterConfig, metrics: RouterMetrics) -> None:
        self.replicas = replicas
        self.config = config
        self.metrics = metrics
        self._background: set[asyncio.Task] = set()
        # Per-request failure lines: a dying group fails every request at once; one line per
        # (cause, group, code) per interval, the rest counted in the next one.
        self.rlog = RateLimitedLog(log, interval_s=LOG_INTERVAL_S)

    def failed_mid_stream(self, f: UpstreamFailure, request_id: str) -> APIError:
        self.failed(f, request_id)
        return to_api_error(f)

    def failed(self, f: UpstreamFailure, request_id: str) -> None:
        self.metrics.upstream_errors.labels(f.group, f.code.name).inc()
        if f.code == Code.UNAVAILABLE:
            # Connection refused or the group said it is not serving: stop picking it until a poll says ready.
            self.replicas.mark_unready(f.group, f"Generate failed: {f.details}")
        if f.code != Code.INVALID_ARGUMENT:
            self.rlog.warning(
                ("upstream", f.group, f.code),
                "request %s: upstream error: %s",
                request_id,
                f,
                extra={"request_id": request_id},
            )

    def abort_later(self, group: str, request_id: str) -> None:
        task = asyncio.get_running_loop().create_task(self._abort(group, request_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort(self, group: str, request_id: str) -> None:
        try:
            await self.replicas.stub(group).Abort(
                pb.AbortRequest(request_id=request_id), timeout=self.config.rpc_timeout_s
            )
        except grpc.aio.AioRpcError as e:
            self.rlog.warning(
                ("abort", group, e.code()),
                "Abort of %s on group %s failed: %s",
                request_id,
                group,
                e.code().name,
                extra={"request_id": request_id},
            )
        except KeyError:  # the replica set was closed meanwhile
            pass

    async def close(self) -> None:
        for t in list(self._background):
            t.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
