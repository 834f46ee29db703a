"""LLMEngine: stage 0's loop — schedule, execute, update.

`step()` sends every plan the ring can take (up to max_inflight; one with a
single stage), then waits for the oldest plan's result and applies it,
returning the requests that finished. The engine knows only the Executor
contract (engine/executor.py): plans go in, StepOutputs come out (engine/plan.py),
and the pool's size and stage 0's busy meter come from it. The executor — the
in-process worker/local.py for one stage, or the ring of stage processes
(ring/leader.py) — is built outside the engine and handed in (stage/assemble.py
`build_leader`), so the engine imports nothing from worker/, ring/ or stage/.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from typing import NoReturn, Protocol

from pipeserve.config import EngineConfig
from pipeserve.engine.block_manager import BlockManager
from pipeserve.engine.executor import Executor
from pipeserve.engine.grammar import GrammarBook
from pipeserve.engine.host_index import HostIndex
from pipeserve.engine.l3_writes import WriteSettings
from pipeserve.engine.plan import StageReport, StepPlan
from pipeserve.engine.prefix_loads import L3Directory
from pipeserve.engine.request import FinishReason, Request
from pipeserve.engine.results import ResultMismatch
from pipeserve.engine.scheduler import Scheduler
from pipeserve.errors import Diverged, GroupStopped, InvalidRequestError
from pipeserve.model.config import ModelConfig
from pipeserve.sampling_params import SamplingParams, check_prompt

log = logging.getLogger(__name__)


class PlanObserver(Protocol):
    """Told of each plan sent into the ring and of its result coming back (on the engine's thread)."""

    def submitted(self, plan: StepPlan) -> None: ...

    def completed(self, plan: StepPlan) -> None: ...


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        max_model_len: int,
        executor: Executor,
        grammar_book: GrammarBook | None = None,
        host_slots: int = 0,
        l3: L3Directory | None = None,
    ) -> None:
        """`executor` gets plans executed (ring formed); `grammar_book` compiles structured specs
        before admission (None: not checked here). HiCache: `host_slots` L2 slots on every stage
        (0: no L2), `l3` stage 0's view of L3 (None: no L3)."""
        self.config = config
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.executor = executor
        self.grammar_book = grammar_book
        self.block_manager = BlockManager(
            executor.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            HostIndex(host_slots) if host_slots else None,
        )
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.max_model_len,
            self.model_config.eos_token_ids,
            self.executor.max_inflight,
            config.stages,
            l3,
            WriteSettings(
                config.hicache_write_policy,
                config.hicache_write_mb_s * 1e6,
                int(config.hicache_write_buffer_mb * (1 << 20)),
            ),
            config.step_target_ms / 1000 if config.step_target_ms > 0 else None,
        )
        self._ids = itertools.count()
        self._inflight: deque[StepPlan] = deque()
        # The latest report of every stage (rank order), from the last result.
        self.stage_reports: list[StageReport] = []
        self.observer: PlanObserver | None = None  # tracing (stage/request_trace.py); None: no cost

    # --- requests -----------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError naming the bad field; changes nothing."""
        params.validate()
        if params.max_tokens is None:  # "up to the context": the caller resolves it against the prompt
            raise InvalidRequestError("max_tokens", "must be resolved first (resolve_max_tokens)")
        check_prompt(prompt_token_ids, params, self.max_model_len, self.model_config.vocab_size)
        if params.structured_kind and self.grammar_book is not None:  # cached: stage/server.py
            self.grammar_book.check(params.structured_kind, params.structured, params.structured_compact)

    def add_request(
        self, prompt_token_ids: list[int], params: SamplingParams, req_id: str | None = None
    ) -> Request:
        """Validate and queue a request."""
        self.validate(prompt_token_ids, params)
        req = Request(
            req_id if req_id is not None else f"req-{next(self._ids)}",
            list(prompt_token_ids),
            params,
            arrival=time.monotonic(),
        )
        self.scheduler.add(req)
        return req

    def abort(self, req_id: str) -> Request | None:
        return self.scheduler.abort(req_id)

    def finish(self, req_id: str, reason: FinishReason) -> Request | None:
        return self.scheduler.finish(req_id, reason)

    def has_unfinished(self) -> bool:
        """Requests to run, or plans (frees included) the executors have not finished."""
        return self.scheduler.has_unfinished() or bool(self._inflight)

    # --- loop ---------------------------------------------------------------
    def step(self) -> list[Request]:
        with self.executor.lock:
            with self.executor.meter.measure():
                while self.executor.can_submit():  # transport rule 3: send what is owed first
                    plan = self.scheduler.schedule()
                    if plan.is_empty():
                        break
                    self.executor.submit(plan)
                    self._inflight.append(plan)
                    if self.observer is not None:
                        self.observer.submitted(plan)
            if not self._inflight:
                self.scheduler.wait_for_tiers()
                return []
            output = self.executor.collect()
            with self.executor.meter.measure():
                plan = self._inflight.popleft()
                if self.observer is not None:
                    self.observer.completed(plan)
                diverged = [(r.rank, r.digest) for r in output.reports if r.digest != plan.digest]
                if diverged:
                    self._diverged(
                        f"step {plan.step_id}: stages executed a different plan: "
                        f"digest {plan.digest:#x}, stages reported {diverged}"
                    )
                self.stage_reports = list(output.reports)
                try:
                    return self.scheduler.update(plan, output)
                except ResultMismatch as e:
                    self._diverged(str(e))

    def _diverged(self, reason: str) -> NoReturn:
        """The stages disagree on a plan or its result: stop the group, as a divergence."""
        try:
            self.executor.stop_group(reason)
        except GroupStopped as e:
            raise Diverged(str(e), logged=e.logged) from e
        raise Diverged(reason)  # an executor's stop_group always raises; this keeps NoReturn honest

    def stop_group(self, reason: str) -> None:
        """Stop every stage of the group (stage 0 cannot go on); never raises."""
        try:
            self.executor.stop_group(reason)
        except GroupStopped:
            pass

    def shutdown(self) -> None:
        """Stop the executors (the stage processes exit cleanly) and HiCache; idempotent."""
        self.executor.close()
        if self.scheduler.fetch.l3 is not None:
            self.scheduler.fetch.l3.close()

    @property
    def num_inflight_plans(self) -> int:
        return len(self._inflight)

    def computing(self) -> set[str]:
        """Ids of the requests running or in a plan not yet collected: an aborted request's last
        chunks are still computed, and the gauges say so until their plan is back."""
        ids = {r.req_id for r in self.scheduler.running}
        for plan in self._inflight:
            ids.update(c.req_id for c in plan.chunks)
        return ids

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free

    @property
    def num_total_blocks(self) -> int:
        return self.block_manager.num_blocks
