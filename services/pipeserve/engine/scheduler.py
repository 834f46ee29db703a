"""Scheduler: the only place where decisions are made (stage 0).

Two calls, vLLM v1 style:
  schedule() -> StepPlan        what every executor runs next
  update(plan, output) -> list[Request]  apply the results, return requests
                                          that finished in this step

Policy per step, under a token budget (`max_num_batched_tokens`; with
several microbatches in a pipeline's ring, an equal share of the work in
sight, see `_plan_budget`):
1. running requests, oldest first: the rest of their prompt (chunked to the
   budget) or one decode token. If the pool is short, the newest running
   request is preempted (blocks freed, recomputed later), repeatedly.
2. if nothing was preempted this step, waiting requests in arrival order, while
   the budget, `max_num_seqs` and the pool allow; each starts after its longest
   cached prefix.
In a pipeline several plans are in the ring at once. A request whose token
is still being computed (its last chunk samples) is not scheduled again until
the result is back; a request still prefilling may have consecutive prompt
chunks in several plans (`Request.num_scheduled`), so a long prompt is spread
over the microbatches instead of making one of them heavy.
"""

from __future__ import annotations

import time
from collections import Counter, deque

import msgspec
from msgspec import UNSET, UnsetType

from pipeserve.engine import fairness, prompt_logprobs
from pipeserve.engine.block_manager import BlockManager, chain_hashes
from pipeserve.engine.fairness import StepPace, fair_order, family, family_caps, share_decodes
from pipeserve.engine.l3_writes import WriteSettings
from pipeserve.engine.plan import (
    BlockCopy,
    LoadOrder,
    NewRequest,
    ScheduledChunk,
    StepPlan,
    needs_history,
    seal,
)
from pipeserve.engine.prefix_loads import L3Directory, PrefixFetch
from pipeserve.engine.request import Fetch, FinishReason, Request, RequestStatus, sampling_spec
from pipeserve.engine.results import StepResults

POLL_S = 0.005  # while L3 loads await answers and nothing else moves, one poll plan per this (a faster
# poll takes the GIL from the stage's own loader thread: a 2k-token load took twice as long at 1 ms)
PROBE_WAIT_S = 0.005  # longest wait for the L3 probes of newly seen requests before planning without them
STORE_WAIT_S = 0.01  # longest idle wait for the L3 write pacing (new requests are looked at after it)


class Scheduler(StepResults):
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: tuple[int, ...],
        max_inflight: int = 1,
        num_stages: int = 1,
        l3: L3Directory | None = None,
        writes: WriteSettings | None = None,
        step_target_s: float | None = None,
    ) -> None:
        """`step_target_s`: the step pace's target (engine/fairness.py); None: the token budget alone."""
        self.bm = block_manager
        self.pace = StepPace(step_target_s)
        self.fetch = PrefixFetch(block_manager, num_stages, l3, writes)
        if self.fetch.writes is not None:  # a block ordered stored but not sent yet goes before reuse
            block_manager.reuse_hook = self.fetch.writes.reused
        self._polls = 0  # poll plans in flight (at most one)
        self._last_poll = 0.0
        self.max_inflight = max_inflight
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._inflight_tokens = 0  # tokens of the plans not yet updated
        self._freed: list[str] = []  # executor tables to drop with the next plan
        self._step_id = 0
        self.num_preemptions = 0

    # --- intake -------------------------------------------------------------
    def add(self, req: Request) -> None:
        if req.req_id in self.requests:
            raise ValueError(f"duplicate request id {req.req_id!r}")
        self.requests[req.req_id] = req
        self.waiting.append(req)

    def abort(self, req_id: str) -> Request | None:
        return self.finish(req_id, FinishReason.ABORT)

    def has_unfinished(self) -> bool:
        stores = self.fetch.writes is not None and self.fetch.writes.backlog > 0
        return bool(self.waiting or self.running or self._freed or stores or self.fetch.pending)

    # --- schedule -----------------------------------------------------------
    def schedule(self) -> StepPlan:
        budget = self._plan_budget()
        chunks: list[ScheduledChunk] = []
        new_reqs: list[NewRequest] = []
        l2_loads: list[BlockCopy] = []
        l3_loads: list[LoadOrder] = []
        self.fetch.take_probe_answers(self.requests)
        self._rebalance_seats()
        # Decodes first (one token each; past the pace's rows, a fair share per family; waiting
        # prompts keep their reserve of the plan), then the prompt share (engine/fairness.py): the
        # step pace's limit, split max-min fairly between the families of the running prompts and
        # of the admissible waiting, then within each family; where that cuts prompts under a floor,
        # fewer take the share (fairness.pooled; cap 0: waits a plan). Smallest shares go first.
        prompts, needs = self._prompt_needs()
        rows = self.pace.decode_rows(sum(n for _, n in needs))
        budget, preempted = self._schedule_running(
            share_decodes([r for r in self.running if self._wants(r) == 1], rows), budget, chunks
        )
        if preempted:  # a victim left the running prompts (or the decodes) for the waiting: claims changed
            prompts, needs = self._prompt_needs()
        share = self.pace.prompt_share(len(chunks))
        prompt = budget if share is None else min(budget, share)
        cap = family_caps(needs, prompt, fairness.MIN_PROMPT_CHUNK)
        prompts = sorted((r for r in prompts if cap.get(r.req_id, 1)), key=lambda r: cap.get(r.req_id, 1))
        left, preempted_now = self._schedule_running(prompts, prompt, chunks, cap)
        if not (preempted or preempted_now):
            probes = self.fetch.stats.probes
            spent = left - self._admit_waiting(left, cap, chunks, new_reqs, l2_loads, l3_loads)
            # A probe is answered within a Redis round trip: wait for those just asked (bounded)
            # rather than leave their requests a whole step behind.
            asked = self.fetch.stats.probes > probes
            if asked and left > spent and self.fetch.await_probes(self.requests, PROBE_WAIT_S):
                self._admit_waiting(left - spent, cap, chunks, new_reqs, l2_loads, l3_loads)

        now = time.monotonic()
        plan = StepPlan(
            self._step_id + 1,
            self._freed,
            new_reqs,
            chunks,
            l2_saves=self.bm.take_plan_saves(),
            l2_loads=l2_loads,
            # after the admissions: a block they reused leaves its store in this plan
            l3_stores=self.fetch.writes.take(now) if self.fetch.writes is not None else [],
            l3_loads=l3_loads,
            traces=self._traces(new_reqs),
        )
        if plan.is_empty() and self.fetch.pending and not self._polls and now - self._last_poll >= POLL_S:
            plan = msgspec.structs.replace(plan, poll=True)  # carries the stages' load answers back
        if plan.is_empty():
            return plan  # not sent: step ids stay consecutive over the plans executors see
        self._step_id += 1
        self._freed = []
        self._polls += plan.poll
        self._last_poll = now if plan.poll else self._last_poll
        self._inflight_tokens += plan.num_tokens
        return seal(plan)

    def _prompt_needs(self) -> tuple[list[Request], list[tuple[str, int]]]:
        """The running prompts, and the cost units wanted by them and by the waiting requests
        that could be admitted now (those with a seat; at least one), by request id."""
        prompts = [r for r in self.running if self._wants(r) > 1]
        seats = max(1, self.max_num_seqs - len(self.running))
        admissible = [r for r in self.waiting if r.fetch not in (Fetch.PROBING, Fetch.LOADING)]
        wanted = [(r, self._wants(r)) for r in prompts] + [(r, r.num_tokens) for r in admissible[:seats]]
        # Scoring rows within the pace's slow start (engine/fairness.py), split between the scorers.
        rows, scoring = self.pace.score_rows(), sum(_scores(r) for r, _ in wanted)
        most = None if rows is None or not scoring else 2 * max(1, rows // scoring)
        return prompts, [(r.req_id, _cost(r, n, most)) for r, n in wanted]

    def _schedule_running(
        self,
        reqs: list[Request],
        budget: int,
        chunks: list[ScheduledChunk],
        cap: dict[str, int] | None = None,
    ) -> tuple[int, bool]:
        """A chunk for each of `reqs` (in order) within `budget` and, per request, its `cap` cost
        units (engine/fairness.py family_caps); when the pool is short the newest running request
        is preempted, repeatedly. Returns (budget left, whether a request was preempted)."""
        preempted = False
        for req in reqs:
            if budget <= 0:
                break
            if req.status is not RequestStatus.RUNNING or not self._wants(req):
                continue  # preempted in this step, or its next token is being computed
            n = _tokens_for(req, self._wants(req), min(budget, cap.get(req.req_id, 1) if cap else budget))
            need = self.bm.blocks_needed(req.num_scheduled + n) - len(req.block_ids)
            while not self.bm.can_allocate(need):
                victim = self._preemptable_victim()
                if victim is None:
                    break
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING or not self.bm.can_allocate(need):
                continue
            new_blocks = self.bm.allocate(need)
            req.block_ids += new_blocks
            chunks.append(chunk := self._chunk(req, n, new_blocks))
            budget -= len(chunk.token_ids) + chunk.score_rows
        return budget, preempted

    def _wants(self, req: Request) -> int:
        """Tokens `req` could be scheduled now (0: its next token is being computed)."""
        return req.num_tokens - req.num_scheduled

    def _admit_waiting(
        self,
        budget: int,
        cap: dict[str, int],
        chunks: list[ScheduledChunk],
        new_reqs: list[NewRequest],
        l2_loads: list[BlockCopy],
        l3_loads: list[LoadOrder],
    ) -> int:
        """Admit waiting requests round-robin by family (engine/fairness.py), each after its longest
        prefix in L1, then L2, its first chunk at most its `cap` cost units; a request L3 may hold
        more of is probed and loaded first (it waits, the others go on). Returns the budget left."""
        bs = self.bm.block_size
        seats = Counter(family(r.req_id) for r in self.running)
        queue = list(self.waiting)
        for i in fair_order([r.req_id for r in queue], seats):
            req = queue[i]
            if budget <= 0:
                break
            if req.fetch in (Fetch.PROBING, Fetch.LOADING):
                continue
            if len(self.running) >= self.max_num_seqs:
                break
            tokens = req.all_token_ids
            hits, prev = self.bm.match_prefix(tokens)
            l2 = self.bm.match_host(tokens, len(hits), prev)
            if req.params.prompt_logprobs is not None:  # every prompt position is computed: no hit
                hits, l2, req.fetch = [], [], Fetch.DONE
            k = len(hits) + len(l2)
            if self.fetch.l3 is not None and req.fetch is Fetch.NONE:
                limit = self.bm.max_prefix_blocks(len(tokens))
                req.fetch = Fetch.DONE
                if k < limit:
                    self.fetch.probe(req, k, chain_hashes(tokens, bs, k, limit, l2[-1][1] if l2 else prev))
                    continue
            if req.fetch is Fetch.PROBED:
                req.fetch = Fetch.DONE
                if k < req.l3_end:
                    if not self.fetch.order_load(req, hits, l2, prev, l2_loads, l3_loads):
                        return budget  # no room: later requests wait too
                    continue
            if not cap.get(req.req_id, 1):
                continue  # its prompt waits a plan (cap 0, fairness.pooled); its L3 probe and load went ahead
            start = k * bs
            n = _tokens_for(req, len(tokens) - start, min(budget, cap.get(req.req_id, 1)))
            need = self.bm.blocks_needed(start + n) - len(hits)
            if not self.bm.can_allocate(need, hits):
                return budget
            seats[family(req.req_id)] += 1
            new_reqs.append(self._admit(req, hits, l2, need, l2_loads))
            chunks.append(chunk := self._chunk(req, n, list(req.block_ids)))
            budget -= len(chunk.token_ids) + chunk.score_rows
        return budget

    def _admit(
        self, req: Request, hits: list[int], l2: list[tuple[int, int]], need: int, l2_loads: list[BlockCopy]
    ) -> NewRequest:
        """Move `req` from waiting to running after its prefix (`hits` in L1, `l2` copied from L2
        into `need` new blocks): its tables and what the executors learn of it."""
        bs, tokens = self.bm.block_size, req.all_token_ids
        start = (len(hits) + len(l2)) * bs
        self.waiting.remove(req)
        self.bm.take_cached(hits)
        new = self.bm.allocate(need)
        self.fetch.load_from_host(tokens, len(hits), new, l2, l2_loads)
        req.block_ids = hits + new
        self.bm.record_query(len(tokens), start)
        tiers = [req.fetched.get(j, "l1") for j in range(len(hits))] + ["l2"] * len(l2)
        req.cached_by_tier = {t: tiers.count(t) * bs for t in ("l1", "l2", "l3")}
        self.fetch.stats.hit_tokens.update(req.cached_by_tier)
        req.num_computed = req.num_scheduled = req.num_cached_prompt_tokens = start
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        req.in_executors = True
        spec = sampling_spec(req, self.eos_token_ids)
        # A constrained request's matcher is rebuilt from its outputs (engine/grammar.py).
        replay = list(req.output_token_ids) if req.params.structured_kind else []
        history = tokens[:start] if needs_history(spec) else []
        return NewRequest(req.req_id, spec, replay, history)

    def _rebalance_seats(self) -> None:
        """When every seat (max_num_seqs) is held, free one for each waiting request whose family
        holds two seats fewer than the largest, by preempting that family's newest request
        (engine/fairness.py). Runs before a plan takes its decodes, while no running request of
        a one-stage group is in flight."""
        if len(self.running) < self.max_num_seqs or not self.waiting:
            return
        seats = Counter(family(r.req_id) for r in self.running)
        for req in list(self.waiting):
            mine, top = seats[family(req.req_id)], max(seats.values())
            if req.fetch in (Fetch.PROBING, Fetch.LOADING) or top < mine + 2:
                continue
            victim = next(
                (v for v in reversed(self.running) if seats[family(v.req_id)] == top and not v.num_inflight),
                None,
            )
            if victim is None:
                return
            self._preempt(victim)
            seats[family(victim.req_id)] -= 1
            seats[family(req.req_id)] += 1  # the seat it frees is this request's (fair order)

    def _traces(self, new_reqs: list[NewRequest]) -> dict[str, str] | UnsetType:
        """Trace context of the sampled requests entering the executors (UNSET: none, bytes unchanged)."""
        traces = {n.req_id: tp for n in new_reqs if (tp := self.requests[n.req_id].traceparent)}
        return traces or UNSET

    def wait_for_tiers(self) -> None:
        """Nothing to send and nothing in flight: wait briefly for a probe answer, a poll's turn, or
        the L3 write pacing to let the next store go."""
        if self.fetch.l3 is None:
            return
        if self.fetch.pending or any(r.fetch is Fetch.PROBING for r in self.waiting):
            self.fetch.l3.wait(POLL_S)
        elif self.fetch.writes is not None and (wait := self.fetch.writes.wait_s(time.monotonic())) > 0:
            time.sleep(min(wait, STORE_WAIT_S))

    def _plan_budget(self) -> int:
        """Tokens for the next plan: the full budget with one stage; in a pipeline,
        the work of the current round — plans in the ring, tokens ready to
        schedule, waiting prompts — split evenly over the ring's microbatches.

        The ring runs at the pace of its largest microbatch: a plan that takes a
        whole prompt while the next holds a few decodes leaves every stage idle
        for the difference. Equal token counts keep the stages busy.
        """
        if self.max_inflight == 1:
            return self.max_num_batched_tokens
        cap = self.max_num_batched_tokens * self.max_inflight
        work = self._inflight_tokens + sum(r.num_tokens - r.num_scheduled for r in self.running)
        for req in self.waiting:
            if work >= cap:
                break
            work += req.num_tokens
        return min(self.max_num_batched_tokens, max(1, -(-work // self.max_inflight)))

    def _chunk(self, req: Request, n: int, new_blocks: list[int]) -> ScheduledChunk:
        start = req.num_scheduled
        req.num_scheduled += n
        req.num_inflight += 1
        ends_known = start + n == req.num_tokens
        rows, after = 0, -1
        if req.params.prompt_logprobs is not None:
            rows, after = prompt_logprobs.chunk_scoring(req.prompt_token_ids, start, n)
        return ScheduledChunk(
            req.req_id,
            req.token_slice(start, start + n),
            start,
            new_blocks,
            len(req.output_token_ids) if ends_known else -1,
            rows,
            after,
        )

    def _preemptable_victim(self) -> Request | None:
        for req in reversed(self.running):
            if req.num_inflight == 0:
                return req
        return None

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.bm.release(req)
        req.num_computed = req.num_scheduled = 0
        req.status = RequestStatus.WAITING
        req.fetch, req.fetched, req.cached_by_tier = Fetch.NONE, {}, {}  # L3 may hold its prefix now
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._drop_from_executors(req)
        self.waiting.appendleft(req)


def _scores(req: Request) -> bool:
    """Whether req's next chunk scores prompt positions."""
    return req.params.prompt_logprobs is not None and req.num_scheduled < len(req.prompt_token_ids)


def _tokens_for(req: Request, wants: int, allowance: int) -> int:
    """Tokens of req's next chunk within `allowance` cost units (a scored prompt token costs 2)."""
    return max(1, min(wants, allowance // (2 if _scores(req) else 1)))


def _cost(req: Request, tokens: int, most: int | None = None) -> int:
    """Cost units of `tokens` more of req: each prompt token it scores counts twice, and its
    scoring claims at most `most` units (None: no limit)."""
    if not _scores(req):
        return tokens
    return 2 * tokens if most is None else min(most, 2 * tokens)
