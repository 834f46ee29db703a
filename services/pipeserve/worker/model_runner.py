"""ModelRunner: executes StepPlans on one stage's model slice and KV pool.

It decides nothing. Its request tables (block table, sampling spec) change
only as a plan says (`freed`, `new_requests`, `new_block_ids`). A plan that
does not fit its state — an unknown or duplicate request, a block id outside
the pool, positions that skip or rewind, inputs whose row count differs from
the plan's tokens — raises PlanMismatch naming the mismatch; on a follower
that is a group stop, never a local repair.

A failure attributable to one request (its sampling, or `request_check` — a
test hook that fails or crashes on chosen requests) is not a mismatch: the
stage still computes every row of the plan, and reports the request in its
StageReport's `failed` list for stage 0 to finish with an error.

HiCache's block moves (L2 copies, L3 loads and stores) run through `tiers`
(hicache/stage_tiers.py), after the plan's tables are applied and before its
chunks; their answers to L3 load orders go into the report.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import torch

from pipeserve.engine.executor import BusyMeter, PlanMismatch
from pipeserve.engine.plan import (
    LoadAck,
    PromptScores,
    RequestFailure,
    SampledToken,
    SamplingSpec,
    ScheduledChunk,
    StageReport,
    StepOutput,
    StepPlan,
    plan_digest,
)
from pipeserve.model.layers import AttentionBatch, DecodeGroup, PrefillSpan
from pipeserve.model.stage_model import StageModel
from pipeserve.worker import prompt_logprobs
from pipeserve.worker.cache_moves import CacheMoves, no_tiers
from pipeserve.worker.grammar import GrammarRows
from pipeserve.worker.penalties import TokenHistories
from pipeserve.worker.sampler import Sampler

log = logging.getLogger(__name__)
MIN_DECODE_GROUP = 8


@dataclass
class _ReqState:
    sampling: SamplingSpec
    block_ids: list[int]
    num_tokens: int = 0  # tokens with KV written on this stage


@dataclass
class PreparedStep:
    """A plan turned into tensors; rows ordered decode-first."""

    inputs: torch.Tensor  # [T] token ids (first stage)
    batch: AttentionBatch
    sample_rows: torch.Tensor  # [R] row of each sampled request's last token
    sample_req_ids: list[str]
    sample_indices: list[int]
    scored: list[tuple[int, ScheduledChunk]] = field(default_factory=list)  # (first row, chunk) to score


class ModelRunner:
    def __init__(
        self,
        model: StageModel,
        kv_pool: torch.Tensor,
        block_size: int,
        seed: int,
        rank: int = 0,
        *,
        grammar: GrammarRows | None = None,
        tiers: CacheMoves | None = None,
        request_check: Callable[[ScheduledChunk], str | None] | None = None,
    ) -> None:
        """Everything a runner uses is given here (worker/build.py `build_runner` assembles it):
        `grammar` the last stage's structured-output matchers (None elsewhere), `tiers` its
        HiCache block moves (None: no HiCache), `request_check` a per-chunk reason to fail the
        chunk's request, or None (ring/faults.py; a test hook)."""
        self.model = model
        self.kv_pool = kv_pool
        self.block_size = block_size
        self.num_blocks = kv_pool.shape[2]
        self.device = kv_pool.device
        self.rank = rank
        self.grammar = grammar
        self.tiers = tiers
        self.request_check = request_check
        self.sampler = Sampler(self.device, seed)
        self.histories = TokenHistories()  # penalties' token histories; filled on the last stage only
        self.reqs: dict[str, _ReqState] = {}
        # block id -> number of request tables holding it (prefix hits share blocks)
        self.block_refs: dict[int, int] = {}
        self.meter = BusyMeter()
        self._workspace: torch.Tensor | None = None
        self.prompt_scores: list[PromptScores] = []  # the last run's (last stage; StepOutput carries them)

    # --- plan -> state ------------------------------------------------------
    def apply(self, plan: StepPlan) -> int:
        """Update request tables from the plan, validating it against them; returns its digest."""
        digest = plan_digest(plan)
        if digest != plan.digest:
            raise PlanMismatch(f"step {plan.step_id}: digest {digest:#x} != plan's {plan.digest:#x}")
        for rid in plan.freed:
            if self.grammar is not None:
                self.grammar.drop(rid)
            gone = self.reqs.pop(rid, None)
            if gone is None:
                raise PlanMismatch(f"step {plan.step_id}: freed unknown request {rid!r}")
            self.histories.free(rid)
            for b in gone.block_ids:
                if self.block_refs[b] == 1:
                    del self.block_refs[b]
                else:
                    self.block_refs[b] -= 1
        for new in plan.new_requests:
            if new.req_id in self.reqs:
                raise PlanMismatch(f"step {plan.step_id}: new request {new.req_id!r} already known")
            self.reqs[new.req_id] = _ReqState(new.sampling, [])
            sp = new.sampling
            if sp.structured_kind and self.grammar is not None:  # rebuilt at every admission
                self.grammar.admit(
                    new.req_id, sp.structured_kind, sp.structured, sp.structured_compact, new.replay
                )
            if self.model.stage.is_last:
                self.histories.admit(new.req_id, new.sampling, new.history)
        for c in plan.chunks:
            st = self.reqs.get(c.req_id)
            if st is None:
                raise PlanMismatch(f"step {plan.step_id}: chunk for unknown request {c.req_id!r}")
            bad = [b for b in c.new_block_ids if not 0 <= b < self.num_blocks]
            if bad:
                raise PlanMismatch(
                    f"step {plan.step_id}: {c.req_id!r} block ids {bad} outside pool of {self.num_blocks}"
                )
            if c.start_pos != st.num_tokens and not (c.new_block_ids and not st.block_ids):
                raise PlanMismatch(
                    f"step {plan.step_id}: {c.req_id!r} chunk starts at {c.start_pos}, "
                    f"stage holds {st.num_tokens} tokens"
                )
            if (why := self.histories.extend(c.req_id, c.start_pos, c.token_ids)) is not None:
                raise PlanMismatch(f"step {plan.step_id}: {why}")
            st.block_ids += c.new_block_ids
            for b in c.new_block_ids:
                self.block_refs[b] = self.block_refs.get(b, 0) + 1
            st.num_tokens = c.start_pos + len(c.token_ids)
            if len(st.block_ids) * self.block_size < st.num_tokens:
                raise PlanMismatch(
                    f"step {plan.step_id}: {c.req_id!r} has {len(st.block_ids)} blocks "
                    f"for {st.num_tokens} tokens"
                )
        return digest

    def prepare(self, plan: StepPlan) -> PreparedStep:
        bs = self.block_size
        # Decode rows first, longest context first (so DecodeGroups pad little), then prefills.
        chunks = sorted(
            plan.chunks,
            key=lambda c: (len(c.token_ids) != 1, -c.start_pos if len(c.token_ids) == 1 else 0),
        )
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        dec_tables: list[list[int]] = []
        dec_lens: list[int] = []
        prefills: list[PrefillSpan] = []
        sample_rows: list[int] = []
        sample_req_ids: list[str] = []
        sample_indices: list[int] = []
        scored: list[tuple[int, ScheduledChunk]] = []
        for c in chunks:
            table = self.reqs[c.req_id].block_ids
            row = len(ids)
            n = len(c.token_ids)
            end = c.start_pos + n
            ids += c.token_ids
            pos = range(c.start_pos, end)
            positions += pos
            slots += [table[p // bs] * bs + p % bs for p in pos]
            if n == 1:
                dec_tables.append(table[: -(-end // bs)])
                dec_lens.append(end)
            else:
                prefills.append(PrefillSpan(row, n, c.start_pos, self._tensor(table[: -(-end // bs)])))
            if c.score_rows:
                scored.append((row, c))
            if c.sample_index >= 0:
                sample_rows.append(row + n - 1)
                sample_req_ids.append(c.req_id)
                sample_indices.append(c.sample_index)
        pos_t = self._tensor(positions)
        cos, sin = self.model.rotary.gather(pos_t)
        batch = AttentionBatch(
            positions=pos_t,
            slot_mapping=self._tensor(slots),
            cos=cos,
            sin=sin,
            num_decode=len(dec_tables),
            decodes=(decodes := self._decode_groups(dec_tables, dec_lens)),
            prefills=prefills,
            workspace=self._decode_workspace(max((g.block_tables.numel() for g in decodes), default=0)),
        )
        return PreparedStep(
            self._tensor(ids), batch, self._tensor(sample_rows), sample_req_ids, sample_indices, scored
        )

    def _decode_groups(self, tables: list[list[int]], lens: list[int]) -> list[DecodeGroup]:
        """Split decode rows (sorted by context length, descending) into groups.

        A group closes when the next row's context is under 3/4 of the group's
        longest and the group has MIN_DECODE_GROUP rows: padding stays under
        ~25% while small groups do not multiply kernel calls.
        """
        groups: list[DecodeGroup] = []
        start = 0
        for i in range(1, len(lens) + 1):
            if i == len(lens) or (4 * lens[i] < 3 * lens[start] and i - start >= MIN_DECODE_GROUP):
                width = len(tables[start])
                padded = [t + [0] * (width - len(t)) for t in tables[start:i]]
                groups.append(
                    DecodeGroup(
                        start,
                        i - start,
                        self._tensor(padded).view(i - start, width),
                        self._tensor(lens[start:i]),
                    )
                )
                start = i
        return groups

    def _decode_workspace(self, blocks: int) -> torch.Tensor | None:
        """Scratch for `blocks` gathered K and V blocks; grows by doubling up to the pool size."""
        if blocks == 0:
            return None
        if self._workspace is None or self._workspace.shape[1] < blocks:
            _, _, _, bs, kvh, d = self.kv_pool.shape
            doubled = 0 if self._workspace is None else 2 * self._workspace.shape[1]
            size = max(blocks, min(doubled, self.num_blocks))
            self._workspace = self.kv_pool.new_empty((2, size, bs, kvh, d))
        return self._workspace

    def _tensor(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    # --- execution ------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, step: PreparedStep, inputs: torch.Tensor | None = None) -> torch.Tensor:
        """Run this stage's layers; inputs are hidden states [T, hidden] on followers."""
        x = step.inputs if inputs is None else inputs
        if x.shape[0] != step.inputs.shape[0]:
            raise PlanMismatch(
                f"received {x.shape[0]} activation rows for a {step.inputs.shape[0]}-token plan"
            )
        return self.model(x, step.batch, self.kv_pool)

    @torch.inference_mode()
    def sample(
        self, step: PreparedStep, hidden: torch.Tensor, failed: set[str]
    ) -> tuple[list[SampledToken], list[RequestFailure]]:
        """Sample every row of `step` whose request has not failed on this stage already."""
        rows = [i for i, r in enumerate(step.sample_req_ids) if r not in failed]
        if not rows:
            return [], []
        logits = self.model.compute_logits(hidden[step.sample_rows[rows]])
        req_ids = [step.sample_req_ids[i] for i in rows]
        indices = [step.sample_indices[i] for i in rows]
        if self.grammar is None or not self.grammar.rows:  # no constrained request: no mask, no copy
            return self._sample_rows(logits, req_ids, indices)
        # --- structured outputs (worker/grammar.py): mask constrained rows, advance their matchers
        bad = self.grammar.mask(logits, req_ids, indices)
        keep = [j for j, r in enumerate(req_ids) if r not in bad]
        req_ids = [req_ids[j] for j in keep]
        tokens, failures = self._sample_rows(logits[keep], req_ids, [indices[j] for j in keep])
        failures += [RequestFailure(r, why) for r, why in bad.items()]
        out = []
        for tok in tokens:
            ended, why = self.grammar.advance(tok.req_id, tok.token_id)
            if why is not None:
                failures.append(RequestFailure(tok.req_id, why))
            else:
                out.append(msgspec.structs.replace(tok, grammar_end=True) if ended else tok)
        return out, failures

    def _sample_rows(
        self, logits: torch.Tensor, req_ids: list[str], indices: list[int]
    ) -> tuple[list[SampledToken], list[RequestFailure]]:
        """The sampler over these rows, with the token histories penalties read (worker/penalties.py)."""
        specs = [self.reqs[r].sampling for r in req_ids]
        histories = [self.histories.get(r) for r in req_ids] if len(self.histories) else None
        tokens, failures = self.sampler(logits, req_ids, specs, indices, histories)
        for t in tokens:
            self.histories.sampled(t.req_id, t.token_id)
        return tokens, failures

    def _score(
        self, step: PreparedStep, hidden: torch.Tensor, failed: set[str]
    ) -> tuple[list[PromptScores], list[RequestFailure]]:
        """prompt_logprobs of the chunks that ask (worker/prompt_logprobs.py); a failure is the request's."""
        out: list[PromptScores] = []
        failures: list[RequestFailure] = []
        for row, c in step.scored:
            if c.req_id in failed:
                continue
            try:
                k = self.reqs[c.req_id].sampling.prompt_logprobs or 0
                out.append(prompt_logprobs.score(self.model.compute_logits, hidden, row, c, k))
            except Exception as e:
                log.exception("request %s: prompt logprobs failed", c.req_id)
                failures.append(RequestFailure(c.req_id, f"prompt logprobs failed: {type(e).__name__}: {e}"))
        return out, failures

    def _check_requests(self, plan: StepPlan) -> list[RequestFailure]:
        if self.request_check is None:
            return []
        failed = []
        for c in plan.chunks:
            if (reason := self.request_check(c)) is not None:
                failed.append(RequestFailure(c.req_id, f"stage {self.rank}: {reason}"))
        return failed

    def run(
        self, plan: StepPlan, inputs: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, list[SampledToken], StageReport]:
        """Execute this stage's part of a plan.

        Returns (hidden states [T, hidden] for the next stage, or None on the
        last stage; the sampled tokens, last stage only; this stage's report).
        inputs: activations from the previous stage; None on the first.
        """
        with self.meter.measure():
            digest = self.apply(plan)
            acks = self.tiers.execute(plan, self.kv_pool) if self.tiers is not None else no_tiers(plan)
            hidden = None
            sampled: list[SampledToken] = []
            self.prompt_scores = []
            failed = self._check_requests(plan)
            if plan.chunks:
                step = self.prepare(plan)
                hidden = self.forward(step, inputs)
                if self.model.stage.is_last:
                    sampled, sample_failures = self.sample(step, hidden, {f.req_id for f in failed})
                    failed += sample_failures
                    self.prompt_scores, score_failures = self._score(step, hidden, {f.req_id for f in failed})
                    failed += score_failures
                    hidden = None
        return hidden, sampled, self.report(digest, failed, acks)

    def report(
        self, digest: int, failed: list[RequestFailure] | None = None, acks: list[LoadAck] | None = None
    ) -> StageReport:
        return StageReport(
            self.rank,
            digest,
            len(self.reqs),
            len(self.block_refs),
            self.meter.busy_s,
            self.meter.wall_s,
            failed or [],
            acks or [],
            self.tiers.lost_pages if self.tiers is not None else 0,
        )

    def execute(self, plan: StepPlan) -> StepOutput:
        """Single-stage execution: the whole model, then sampling."""
        _, sampled, report = self.run(plan)
        return StepOutput(plan.step_id, sampled, [report], self.prompt_scores)
