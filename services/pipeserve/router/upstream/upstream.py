"""Picking a group for a Generate call, and the retry rule (the pick step of the router's way).

`Upstream.open` picks a group (the policy over the routable groups, or the `prefer`red one) and
opens the Generate call there (router/upstream/generate.py: deadlines, error mapping); it retries
as below before handing the stream on, so the stream never comes back to the pick.

* Retry rule: a call that fails before its first message with UNAVAILABLE,
  DEADLINE_EXCEEDED (our deadline included), RESOURCE_EXHAUSTED, CANCELLED (by
  the server) or a broken connection is retried once, on another routable
  group — unless the request saw its group die: stage 0 had admitted it (the
  call carries the ADMITTED_KEY initial metadata) and the call then failed
  UNAVAILABLE or CANCELLED. Such a request may be what killed the group;
  carrying it to another group could kill that one too (DESIGN §2.5), so it
  fails here. Other codes (INVALID_ARGUMENT, ALREADY_EXISTS, INTERNAL: the
  request failed on a stage) are never retried. Once a message has arrived
  nothing is retried: the caller turns the failure into an error event or an
  HTTP error.
* `probe` (GET /health/generate): a 1-token greedy request to one group.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import grpc

from pipeserve.config import RouterConfig
from pipeserve.router import errors
from pipeserve.router.upstream.generate import (
    RETRYABLE,
    Calls,
    GenerateStream,
    UpstreamFailure,
    to_api_error,
)
from pipeserve.router.upstream.groups import GroupState
from pipeserve.router.upstream.metrics import RouterMetrics
from pipeserve.router.upstream.replicas import ReplicaSet
from pipeserve.rpc import generation_pb2 as pb

__all__ = ["Calls", "GenerateStream", "Upstream", "UpstreamFailure", "to_api_error"]


class Upstream:
    def __init__(self, replicas: ReplicaSet, config: RouterConfig, metrics: RouterMetrics) -> None:
        self.replicas = replicas
        self.config = config
        self.metrics = metrics
        self.calls = Calls(replicas, config, metrics)
        self.rlog = self.calls.rlog

    async def open(
        self,
        prompt_ids: Sequence[int],
        sampling: pb.SamplingParams,
        request_id: str,
        prefer: str | None = None,
    ) -> tuple[GenerateStream, pb.GenerateResponse]:
        """A stream that has produced its first message, after at most one retry on another group.

        `prefer`: the group to try first while it is routable, whatever the policy (an n > 1
        sibling goes where its prompt's blocks are cached); the retry rule is unchanged."""
        request = pb.GenerateRequest(request_id=request_id, prompt_token_ids=prompt_ids, sampling=sampling)
        tried: list[str] = []
        last: UpstreamFailure | None = None
        for attempt in range(2):
            group = self._preferred(prefer) if attempt == 0 else None
            group = group or self.replicas.pick(prompt_ids, exclude=tried)
            if group is None:
                break
            stream = GenerateStream(self.calls, group.name, request)
            try:
                first = await stream.open()
            except UpstreamFailure as f:  # the stream closed itself
                last = f
                self.calls.failed(f, request_id)
                if f.code not in RETRYABLE or f.group_died:
                    raise to_api_error(f) from None
                tried.append(group.name)
                if attempt == 0 and self.replicas.ready_groups(exclude=tried):
                    self.metrics.retries.inc()
                    self.rlog.warning(
                        ("retry", f.group, f.code),
                        "request %s: %s before its first token; retrying on another group",
                        request_id,
                        f,
                        extra={"request_id": request_id},
                    )
            except BaseException:  # cancelled (client gone) while waiting for the first message
                stream.close()
                raise
            else:
                stream.retries = attempt
                return stream, first
        if last is None:
            raise errors.unavailable("no pipeline group is ready")
        raise to_api_error(last)

    def _preferred(self, name: str | None) -> GroupState | None:
        if name is None:
            return None
        return next((g for g in self.replicas.ready_groups() if g.name == name), None)

    async def probe(self, group: str, prompt_ids: Sequence[int]) -> str | None:
        """Send a 1-token greedy request to `group`; None if it produced a token, else why not."""
        request = pb.GenerateRequest(
            request_id=f"probe-{uuid.uuid4().hex}",
            prompt_token_ids=prompt_ids,
            sampling=pb.SamplingParams(max_tokens=1, temperature=0.0, top_p=1.0, top_k=-1, ignore_eos=True),
        )
        self.replicas.acquire(group)
        call = self.replicas.stub(group).Generate(request, timeout=self.config.probe_timeout_s)
        try:
            async for msg in call:
                if msg.token_ids:
                    return None
            return "the probe finished without a token"
        except grpc.aio.AioRpcError as e:
            return f"{e.code().name}: {e.details()}"
        finally:
            call.cancel()
            self.replicas.release(group)

    async def close(self) -> None:
        """The background Aborts end (cancelled)."""
        await self.calls.close()
