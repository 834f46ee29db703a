"""StepResults: the scheduler's other half, applying what a step returned (stage 0).

`update(plan, output)` advances each request of the plan by its chunk, appends the sampled tokens,
keeps prompt scores, hands the L3 acks and the stages' costs to their owners, and finishes the
requests that stopped; `finish` ends one decided outside the token loop. A finished request's
blocks return to the pool and the executors drop its tables with the next plan (`_freed`).
Scheduler (scheduler.py) subclasses it: the state named below is the scheduler's own.
"""

from __future__ import annotations

from collections import deque

from pipeserve.engine import prompt_logprobs
from pipeserve.engine.block_manager import BlockManager
from pipeserve.engine.fairness import StepPace, plan_cost, plan_score_rows
from pipeserve.engine.plan import StepOutput, StepPlan
from pipeserve.engine.prefix_loads import PrefixFetch
from pipeserve.engine.request import FinishReason, Request, RequestStatus


class ResultMismatch(RuntimeError):
    """A step's result contradicts its plan: a protocol failure (the group stops)."""


class StepResults:
    # The scheduler's state this half reads and changes (set by Scheduler.__init__).
    bm: BlockManager
    pace: StepPace
    fetch: PrefixFetch
    requests: dict[str, Request]
    waiting: deque[Request]
    running: list[Request]
    eos_token_ids: frozenset[int]
    max_model_len: int
    _inflight_tokens: int
    _polls: int
    _freed: list[str]

    def update(self, plan: StepPlan, output: StepOutput) -> list[Request]:
        """Apply a plan's results. Requests that failed on any stage (their reports'
        `failed`) finish with FinishReason.ERROR; a result that contradicts the plan
        (another step, a missing token) raises ResultMismatch: the group's failure."""
        if output.step_id != plan.step_id:
            raise ResultMismatch(f"output of step {output.step_id} applied to plan {plan.step_id}")
        sampled = {s.req_id: s for s in output.sampled}
        scores = {s.req_id: s for s in output.prompt_scores}
        failed = {f.req_id: f.reason for r in output.reports for f in r.failed}
        finished: list[Request] = []
        self._inflight_tokens -= plan.num_tokens
        self._polls -= plan.poll
        self.pace.observe(plan_cost(plan), output.reports, plan_score_rows(plan))
        self.fetch.note_lost(sum(r.l3_lost for r in output.reports))
        for report in output.reports:
            for ack in report.loads:
                try:
                    self.fetch.on_ack(report.rank, ack)
                except ValueError as e:
                    raise ResultMismatch(f"step {plan.step_id}: {e}") from None
        for chunk in plan.chunks:
            req = self.requests.get(chunk.req_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            req.num_inflight -= 1
            if (reason := failed.get(req.req_id)) is not None:
                req.error = reason
                self._finish(req, FinishReason.ERROR)
                finished.append(req)
                continue
            req.num_computed += len(chunk.token_ids)
            if chunk.score_rows:
                try:
                    prompt_logprobs.keep(req.prompt_scores, chunk, scores.get(req.req_id))
                except ValueError as e:
                    raise ResultMismatch(f"step {plan.step_id}: {e}") from None
            self._commit(req)
            if chunk.sample_index < 0:
                continue
            tok = sampled.get(req.req_id)
            if tok is None:
                raise ResultMismatch(f"step {plan.step_id}: no sampled token for {req.req_id}")
            req.output_token_ids.append(tok.token_id)
            if req.params.logprobs is not None:
                req.output_logprobs.append((tok.logprob, tok.top_logprobs))
            # The grammar ended: stop, whatever ignore_eos says (engine/grammar.py).
            reason = FinishReason.STOP if tok.grammar_end else self._stop_reason(req, tok.token_id)
            if reason is not None:
                self._finish(req, reason)
                finished.append(req)
        return finished

    def _commit(self, req: Request) -> None:
        """Name req's new full blocks in the prefix cache and let the L3 write policy see them: a
        block the request got from a cache tier (its admission's hit) or shares with another
        running request is already shared."""
        committed = self.bm.commit_full_blocks(req)
        if self.fetch.writes is None or not committed:
            return
        hit = req.num_cached_prompt_tokens // self.bm.block_size
        for i, bid, h in committed:
            if i >= req.l3_sighted_blocks:
                self.fetch.writes.committed(bid, h, i < hit or self.bm.blocks[bid].ref_count > 1)
        req.l3_sighted_blocks = max(req.l3_sighted_blocks, committed[-1][0] + 1)

    def _stop_reason(self, req: Request, token: int) -> FinishReason | None:
        p = req.params
        if (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids:
            return FinishReason.STOP
        # max_tokens is resolved before a request enters (LLMEngine.validate refuses None).
        out_of_room = req.num_tokens >= self.max_model_len
        if out_of_room or (p.max_tokens is not None and len(req.output_token_ids) >= p.max_tokens):
            return FinishReason.LENGTH
        return None

    def finish(self, req_id: str, reason: FinishReason) -> Request | None:
        """End a request decided outside the token loop (e.g. a stop string)."""
        req = self.requests.get(req_id)
        if req is None or req.is_finished:
            return None
        if req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        self._finish(req, reason)
        return req

    def _finish(self, req: Request, reason: FinishReason) -> None:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        self.bm.release(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self._drop_from_executors(req)
        del self.requests[req.req_id]

    def _drop_from_executors(self, req: Request) -> None:
        if req.in_executors:
            self._freed.append(req.req_id)
            req.in_executors = False
