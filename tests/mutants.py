"""Mutation check: break one invariant at a time and show the suite going red.

    .venv/bin/python tests/mutants.py          # all mutants
    .venv/bin/python tests/mutants.py 0 3      # by index

Each mutant replaces one snippet of the code in a temporary copy of the tree
(the files git tracks, and the untracked ones it does not ignore) and runs the
tests that guard that rule there: the checkout is never written, so a run
killed midway leaves nothing behind. The copy is imported through PYTHONPATH
(which every stage process the tests start inherits), ahead of the venv's
editable install. A mutant reported GREEN is a hole in the tests. Exit status
is the number of GREEN mutants.
"""

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

MUTANTS = [
    (
        "prefill mask ignores cached prefix",
        "kernels/reference.py",
        "    rows = torch.arange(length, device=q.device).repeat(g)[:, None] + start_pos",
        "    rows = torch.arange(length, device=q.device).repeat(g)[:, None]",
        "tests/engine/test_engine_correctness.py -k 'prefix or chunk'",
    ),
    (
        "decode group attends to its padding",
        "services/pipeserve/engine/model_runner.py",
        "                        self._tensor(lens[start:i]),",
        "                        self._tensor([lens[start]] * (i - start)),",
        "tests/engine/test_engine_correctness.py -k mixed",
    ),
    (
        "preempted request never requeued",
        "services/pipeserve/engine/scheduler.py",
        "        self.waiting.appendleft(req)",
        "        pass",
        "tests/engine/test_engine_correctness.py -k preemption",
    ),
    (
        "release leaks a block",
        "services/pipeserve/engine/block_manager.py",
        "        for bid in reversed(block_ids):",
        "        for bid in reversed(block_ids[1:]):",
        "tests/engine/test_engine_correctness.py -k mixed",
    ),
    (
        "runner skips block range check",
        "services/pipeserve/engine/model_runner.py",
        "            bad = [b for b in c.new_block_ids if not 0 <= b < self.num_blocks]",
        "            bad = []",
        "tests/engine/test_plan_congruence.py",
    ),
    (
        "rope scaling ignored",
        "services/pipeserve/model/config.py",
        "        if self.rope_scaling is None:\n            return inv",
        "        if True:\n            return inv",
        "tests/model/test_loader.py -k rope",
    ),
    (
        "seeded sampling uses batch generator",
        "services/pipeserve/engine/sampler.py",
        "self.generator if seed is None else",
        "self.generator if True else",
        "tests/engine/test_sampling.py -k seed",
    ),
    (
        "prefix hit skips token comparison and hashes ignore prefix",
        "services/pipeserve/engine/block_manager.py",
        "            prev = chain_hash(prev, toks)",
        "            prev = chain_hash(0, toks)",
        "tests/engine/test_engine_correctness.py -k prefix",
    ),
    (
        "executor tables not freed",
        "services/pipeserve/engine/model_runner.py",
        "            gone = self.reqs.pop(rid, None)",
        "            gone = self.reqs.get(rid, None)",
        "tests/engine/test_engine_correctness.py -k mixed",
    ),
    (
        "stop check ignores eos",
        "services/pipeserve/engine/scheduler.py",
        "not p.ignore_eos and token in self.eos_token_ids",
        "False",
        "tests/engine/test_engine_correctness.py -k eos",
    ),
    (
        "digest check skipped",
        "services/pipeserve/engine/model_runner.py",
        "        if digest != plan.digest:",
        "        if False:",
        "tests/engine/test_plan_congruence.py",
    ),
    # --- pipeline groups ---
    (
        "follower skips the digest check",
        "services/pipeserve/engine/model_runner.py",
        "        if digest != plan.digest:",
        "        if False:",
        "tests/ring/test_pipeline_faults.py -k digest",
    ),
    (
        "follower skips the activation row check",
        "services/pipeserve/engine/model_runner.py",
        "        if x.shape[0] != step.inputs.shape[0]:",
        "        if False:",
        "tests/ring/test_pipeline_faults.py -k rows",
    ),
    (
        "detecting follower exits without passing the stop on",
        "services/pipeserve/ring/follower.py",
        "            self.link.send(Stop(self.rank, reason, True))",
        "            pass",
        "tests/ring/test_pipeline_faults.py -k corrupted",
    ),
    (
        "stage 0 keeps one plan in the ring",
        "services/pipeserve/ring/leader.py",
        "        return len(self._inflight) < self.max_inflight",
        "        return len(self._inflight) < 1",
        "tests/ring/test_pipeline_ordering.py -k full_ring",
    ),
    (
        "idle stage 0 sends no heartbeat",
        "services/pipeserve/ring/leader.py",
        "                if self.failed or self._closing.is_set() or self._inflight or not idle:",
        "                if True:",
        "tests/ring/test_pipeline_ordering.py -k 'idle and not can-fail'",
    ),
    (
        "ring waits have no deadline",
        "services/pipeserve/ring/transport.py",
        "        self.timeout_s = NO_DEADLINE_S if faults.no_deadline else timeout_s",
        "        self.timeout_s = NO_DEADLINE_S",
        "tests/ring/test_pipeline_faults.py -k stopped",
    ),
    (
        "group takes stage 0's pool size, not the minimum",
        "services/pipeserve/ring/group.py",
        "    return min(i.kv_blocks for i in ids)",
        "    return ids[0].kv_blocks",
        "tests/ring/test_pipeline_congruence.py -k smallest",
    ),
    (
        "model fingerprints not compared",
        "services/pipeserve/ring/group.py",
        '    ("fingerprint", "model fingerprint"),',
        "",
        "tests/ring/test_pipeline_congruence.py -k checkpoints",
    ),
    (
        "stage 0 ignores the digests the stages report",
        "services/pipeserve/engine/engine.py",
        "                diverged = [(r.rank, r.digest) for r in output.reports if r.digest != plan.digest]",
        "                diverged = []",
        "tests/ring/test_pipeline_faults.py -k report_digest",
    ),
    (
        "a sampling chunk is not waited for: the next decode is scheduled before its token",
        "services/pipeserve/engine/scheduler.py",
        "            if req.num_scheduled == req.num_tokens or req.status is not RequestStatus.RUNNING:",
        "            if req.status is not RequestStatus.RUNNING:",
        "tests/engine/test_scheduler_microbatches.py tests/ring/test_pipeline_correctness.py"
        " -k 'llama and 2'",
    ),
    (
        "plan budget ignores the plans in flight (microbatches unbalanced)",
        "services/pipeserve/engine/scheduler.py",
        "        work = self._inflight_tokens + sum(r.num_tokens - r.num_scheduled for r in self.running)",
        "        work = sum(r.num_tokens - r.num_scheduled for r in self.running)",
        "tests/engine/test_scheduler_microbatches.py",
    ),
    (
        "LLM exit does not shut the ring down",
        "services/pipeserve/entrypoints/llm.py",
        "        self._finalizer = weakref.finalize(self, _shutdown, self.engine, self.group, self.redis)",
        "        self._finalizer = weakref.finalize(self, lambda: None)",
        "tests/ring/test_pipeline_lifecycle.py -k 'driver and exit'",
    ),
    # --- serving (issue 4) ---
    (
        "wedge detector counts idle time as stalled",
        "services/pipeserve/care/wedge.py",
        "            self._last_progress = now  # idle: nothing is owed, the clock starts when work arrives",
        "            pass",
        "tests/care/test_wedge.py -k idle",
    ),
    (
        "a cancelled Generate call is not aborted",
        "services/pipeserve/stage/server.py",
        "            if not final:  # cancelled: the client went away or its deadline passed\n"
        "                self.loop.abort(rid)",
        "            if not final:  # cancelled: the client went away or its deadline passed\n"
        "                pass",
        "tests/stage/test_stage_server.py -k cancel",
    ),
    (
        "draining drops the running requests",
        "services/pipeserve/stage/engine_loop.py",
        "                if self.phase is Phase.DRAINING and not self._active:",
        "                if self.phase is Phase.DRAINING:",
        "tests/stage/test_stage_server.py -k sigterm",
    ),
    (
        "stage ready before the ring is formed",
        "services/pipeserve/care/health.py",
        "        return self.phase is Phase.READY and not self.wedged",
        "        return self.phase is not Phase.LOADING and not self.wedged",
        "tests/stage/test_stage_server.py -k readyz",
    ),
    (
        "supervisor restarts a group without stopping the old incarnation",
        "services/pipeserve/supervisor/supervisor.py",
        "        codes = await asyncio.to_thread(slot.kill, self.config.kill_grace_s)",
        "        codes = {}",
        "tests/supervisor/test_up_faults.py -k killed_then",
    ),
    (
        "router retries on the group that just failed",
        "services/pipeserve/router/upstream.py",
        "                tried.append(group.name)",
        "                pass",
        "tests/router/test_router_faults.py -k 'retried or retry_avoids'",
    ),
    (
        "router never retries before the first token",
        "services/pipeserve/router/upstream.py",
        "        for attempt in range(2):",
        "        for attempt in range(1):",
        "tests/router/test_router_faults.py -k retried",
    ),
    (
        "router routes to groups that are not ready",
        "services/pipeserve/router/policy.py",
        "        return self.ready and self.down_reason is None",
        "        return self.down_reason is None",
        "tests/router/test_router_policy.py tests/router/test_router_faults.py -k 'candidates or stopped'",
    ),
    (
        "kubernetes discovery routes on endpoint presence, ignoring the group's phase",
        "services/pipeserve/router/discovery_k8s.py",
        '        if not isinstance(g, dict) or g.get("phase") != "Ready":',
        "        if not isinstance(g, dict):",
        "tests/router/test_discovery.py -k follow",
    ),
    (
        "a group removed by discovery stays in routing",
        "services/pipeserve/router/replicas.py",
        "        for name in [n for n, g in self.groups.items() if targets.get(n) != g.target]:",
        "        for name in []:",
        "tests/router/test_discovery.py -k follow",
    ),
    (
        "a deleted InferencePipeline keeps its last groups",
        "services/pipeserve/router/discovery_k8s.py",
        '                if event["type"] == "DELETED":\n                    emit({})',
        '                if event["type"] == "DELETED":\n                    pass',
        "tests/router/test_discovery.py -k deleting",
    ),
    (
        "a group scaled away is closed at once, cutting its streams",
        "services/pipeserve/router/replicas.py",
        "        while link.state.inflight > 0 and time.monotonic() < deadline:",
        "        while False:",
        "tests/router/test_discovery.py -k removed_group",
    ),
    (
        "a stop string does not cancel the upstream call",
        "services/pipeserve/router/serving.py",
        "        if self._stream is not None:\n            self._stream.close()",
        "        if self._stream is not None:\n            pass",
        "tests/router/test_router_e2e.py -k stop",
    ),
    (
        "an idle engine pass writes a log line",
        "services/pipeserve/stage/engine_loop.py",
        "                    self._wake.wait(IDLE_WAIT_S)",
        '                    log.info("idle pass")\n                    self._wake.wait(IDLE_WAIT_S)',
        "tests/care/test_wedge.py -k idle_group",
    ),
    (
        "sampler divides by a temperature below the epsilon (float32 overflow)",
        "services/pipeserve/engine/sampler.py",
        "        [min(max(s.temperature, SAMPLING_EPS), MAX_TEMPERATURE) for s in specs], device=dev",
        "        [s.temperature for s in specs], device=dev",
        "tests/stage/test_failure_isolation.py -k nan",
    ),
    (
        "a stage lets one request's failure escape (group stop instead of a failed request)",
        "services/pipeserve/engine/model_runner.py",
        '                failed.append(RequestFailure(c.req_id, f"stage {self.rank}: {reason}"))',
        "                raise RuntimeError(reason)",
        "tests/stage/test_failure_isolation.py -k 'request_failure'",
    ),
    (
        "stage 0 ignores the failures stages report",
        "services/pipeserve/engine/scheduler.py",
        "        failed = {f.req_id: f.reason for r in output.reports for f in r.failed}",
        "        failed = {}",
        "tests/stage/test_failure_isolation.py -k 'request_failure and 1'",
    ),
    (
        "router retries a request that already saw a group die",
        "services/pipeserve/router/upstream.py",
        "                if f.code not in RETRYABLE or f.group_died:",
        "                if f.code not in RETRYABLE:",
        "tests/router/test_router_poison.py -k kills",
    ),
    (
        "a client error (duplicate request id) mapped to UNAVAILABLE",
        "services/pipeserve/stage/server.py",
        "            await context.abort(grpc.StatusCode.ALREADY_EXISTS,",
        "            await context.abort(grpc.StatusCode.UNAVAILABLE,",
        "tests/stage/test_failure_isolation.py -k duplicate",
    ),
    (
        "stage 0's /readyz lags its group stop",
        "services/pipeserve/care/health.py",
        "(self.serving is None or self.serving())",
        "True",
        "tests/stage/test_failure_isolation.py -k agree",
    ),
    # --- the HTTP edge (issue 9 section 2) ---
    (
        "stop matching rescans the whole text every token (quadratic)",
        "services/pipeserve/detokenize.py",
        "self._matcher.scan(self._state, self.text, begin)",
        "self._matcher.scan(0, self.text, 0)",
        "tests/router/test_router_edge.py -k linear",
    ),
    (
        "/groups answers without the API key",
        "services/pipeserve/supervisor/up.py",
        "        app.state.router.check_auth(request)\n        routed",
        "        routed",
        "tests/router/test_router_edge.py -k pipeserve_up",
    ),
    (
        "no header deadline (slowloris connections stay open)",
        "services/pipeserve/router/http_guard.py",
        "        super().connection_made(transport)\n        self._arm()",
        "        super().connection_made(transport)",
        "tests/router/test_router_edge.py -k dribbled",
    ),
    (
        "a batch takes one concurrency slot, whatever its prompts",
        "services/pipeserve/router/handlers.py",
        "        slot = self.admission.acquire(len(req.prompts))",
        "        slot = self.admission.acquire()",
        "tests/router/test_router_edge.py -k batch",
    ),
    # --- one sampling schema, tokenization like transformers ---
    (
        "completions text encoded without the tokenizer's special tokens",
        "services/pipeserve/tokenizer.py",
        "encode_batch([text], add_special_tokens=add_special_tokens)",
        "encode_batch([text], add_special_tokens=False)",
        "tests/test_tokenization.py -k 'matches_transformers'",
    ),
    (
        "chat_template.jinja ignored (transformers 5 layout)",
        "services/pipeserve/tokenizer.py",
        "    if jinja_file.is_file():",
        "    if False:",
        "tests/test_tokenization.py -k 'template_comes_from'",
    ),
    (
        "max_tokens beyond the context silently capped",
        "services/pipeserve/sampling_params.py",
        "    if strict and params.max_tokens > room:",
        "    if False:",
        "tests/router/test_router_protocol.py -k beyond",
    ),
    (
        "the shared prompt check skips stop token ids (engine and router)",
        "services/pipeserve/sampling_params.py",
        "    bad = [t for t in params.stop_token_ids if t >= vocab_size]",
        "    bad = []",
        "tests/test_sampling_schema.py -k engine",
    ),
    (
        "no byte-length pre-check: a huge prompt is tokenized",
        "services/pipeserve/tokenizer.py",
        "        if limit is not None and size > limit:",
        "        if False:",
        "tests/test_tokenization.py -k 15mb",
    ),
    # --- GGUF checkpoints, the default model ---
    (
        "GGUF q rows left in llama.cpp's rope order",
        "services/pipeserve/model/gguf.py",
        '            w = unpermute_rows(w, config["num_attention_heads"])',
        "            w = w",
        "tests/model/test_gguf.py -k round_trip_gives_back",
    ),
    (
        "GGUF k rows un-permuted with the query head count",
        "services/pipeserve/model/gguf.py",
        'unpermute_rows(w, config["num_key_value_heads"])',
        'unpermute_rows(w, config["num_attention_heads"])',
        "tests/model/test_gguf.py -k round_trip_gives_back",
    ),
    (
        "GGUF control tokens not matched whole",
        "services/pipeserve/model/gguf_tokenizer.py",
        "            if k == CONTROL",
        "            if k == -1",
        "tests/model/test_gguf.py -k round_trip_config_and_tokenizer",
    ),
    (
        "GGUF smollm pre-tokenizer without llama.cpp's digit split",
        "services/pipeserve/model/gguf_tokenizer.py",
        '[pre_tokenizers.Split(Regex(r"\\p{N}"), behavior="isolated"), _GPT2]',
        "[_GPT2]",
        "tests/model/test_gguf.py -k tokenizer_equals_transformers",
    ),
    (
        "a failed GGUF conversion leaves its temporary directory",
        "services/pipeserve/model/gguf.py",
        "        shutil.rmtree(tmp, ignore_errors=True)\n        raise",
        "        raise",
        "tests/model/test_gguf.py -k refuses",
    ),
    # --- HiCache (issue 11) ---
    (
        "an L3 page is used without its checksum checked",
        "services/pipeserve/hicache/page.py",
        "    if xxhash.xxh3_128_digest(payload) != digest:",
        "    if False:",
        "tests/hicache/test_page_store.py",
    ),
    (
        "L3 presence counts a block that one stage lacks",
        "services/pipeserve/hicache/redis_tier.py",
        "            if not all(found[i * n : (i + 1) * n]):",
        "            if not any(found[i * n : (i + 1) * n]):",
        "tests/hicache/test_page_store.py -k all_or_nothing",
    ),
    (
        "the L3 writer blocks the stage when its queue is full",
        "services/pipeserve/hicache/writer.py",
        '            self._queue.put_nowait((block_hash, page.detach().to("cpu", copy=True), tokens))',
        '            self._queue.put((block_hash, page.detach().to("cpu", copy=True), tokens))',
        "tests/hicache/test_writer.py -k full",
    ),
    (
        "stage 0 uses an L3 prefix when one stage reported a failed load",
        "services/pipeserve/engine/prefix_loads.py",
        '            if load.acks[rank] != "ok":',
        '            if load.acks[rank] != "ok" and rank == 0:',
        "tests/hicache/test_all_or_nothing.py -k corrupt",
    ),
    (
        "a corrupt page reaches the model (no checksum check)",
        "services/pipeserve/hicache/page.py",
        "    if xxhash.xxh3_128_digest(payload) != digest:",
        "    if False:",
        "tests/hicache/test_all_or_nothing.py -k corrupt",
    ),
    (
        "the L3 load deadline is flat (not priced by size)",
        "services/pipeserve/hicache/directory.py",
        "        return int(min(self.max_ms, self.base_ms + self.per_block_ms * blocks))",
        "        return int(min(self.max_ms, self.base_ms))",
        "tests/hicache/test_tiers_exact.py -k 'l3 and 2'",
    ),
    (
        "a follower chooses its own L2 slot for a save",
        "services/pipeserve/hicache/stage_tiers.py",
        "            slots = torch.tensor([c.slot for c in plan.l2_saves])",
        "            slots = torch.tensor([(c.slot + self.layout.stage) % self.host_slots"
        " for c in plan.l2_saves])",
        "tests/hicache/test_tiers_exact.py -k 'l2 and 2'",
    ),
    # --- structure --------------------------------------------------------------------------
    (
        "the engine builds its own ring executor (engine imports ring/)",
        "services/pipeserve/engine/engine.py",
        "from pipeserve.engine.executor import Executor\n",
        "from pipeserve.engine.executor import Executor\nfrom pipeserve.ring import leader\n",
        "tests/test_import_graph.py -k engine",
    ),
    (
        "the ring reaches up into the stage process (ring/ imports care/)",
        "services/pipeserve/ring/follower.py",
        "from pipeserve.ring.leader import warm_activation\n",
        "from pipeserve.care.wedge import WedgeDetector\nfrom pipeserve.ring.leader import warm_activation\n",
        "tests/test_import_graph.py -k ring",
    ),
    (
        "pipeserve up leaves the supervisor's timings unsettable",
        "services/pipeserve/supervisor/up.py",
        "    add_config_args(u, SupervisorConfig, skip=set(), prefix=SUPERVISOR_PREFIX)\n",
        "",
        "tests/supervisor/test_up_flags.py",
    ),
    (
        "README's layout forgets a package",
        "README.md",
        "`care/` (process care:",
        "(process care:",
        "tests/test_docs_layout.py",
    ),
    (
        "supervisor/up.py imports cli back (an import cycle)",
        "services/pipeserve/supervisor/up.py",
        "from pipeserve.config import (",
        "from pipeserve.cli import main\nfrom pipeserve.config import (",
        "tests/test_import_graph.py -k 'cycle_between_modules'",
    ),
    (
        "multi-turn history drops the previous output",
        "services/pipeserve/bench/workloads.py",
        "            prompt += self.user[k] + outputs[k]",
        "            prompt += self.user[k]",
        "tests/bench/test_multiturn.py",
    ),
    (
        "multi-turn history ignores the ids the server generated",
        "services/pipeserve/bench/multiturn.py",
        "ids = res.token_ids if len(res.token_ids) == res.output_len else",
        "ids = [] if len(res.token_ids) == res.output_len else",
        "tests/bench/test_multiturn.py",
    ),
    (
        "restart decision counts stale-generation stages",
        "services/pipeserve/care/restarts.py",
        "    current = {s.rank: s for s in obs.stages if s.generation == record.generation}",
        "    current = {s.rank: s for s in obs.stages}",
        "tests/care/test_restarts.py",
    ),
    (
        "restart decision stops only the failed stage",
        "services/pipeserve/care/restarts.py",
        "    return Decision(Action.RESTART, stopped, cause, _all_ranks(obs), delay)",
        "    return Decision(Action.RESTART, stopped, cause, (), delay)",
        "tests/care/test_restarts.py",
    ),
    (
        "restart decision ignores the backoff",
        "services/pipeserve/care/restarts.py",
        "        if now < record.restart_at:",
        "        if False:",
        "tests/care/test_restarts.py",
    ),
    (
        "operator deletes only the failed pod, not its group",
        "services/pipeserve_operator/groups.py",
        "    victims = doomed(pods, decision)",
        "    victims = [p for p in doomed(pods, decision)"
        " if p['status']['containerStatuses'][0]['restartCount']]",
        "tests/k8s/test_operator.py -k whole_group",
    ),
    (
        "old-generation pods count toward a group's readiness",
        "services/pipeserve/care/restarts.py",
        "    current = {s.rank: s for s in obs.stages if s.generation == record.generation}",
        "    current = {s.rank: s for s in obs.stages}",
        "tests/k8s/test_operator.py -k stale",
    ),
    (
        "pipeserve up's parser imports the ring (torch) at module level",
        "services/pipeserve/supervisor/up.py",
        "from pipeserve.router.http_guard import RouterServer, server_config\n",
        "from pipeserve.router.http_guard import RouterServer, server_config\n"
        "from pipeserve.supervisor.group import GroupSlot  # noqa: F401\n",
        "tests/test_import_graph.py tests/k8s/test_images.py -k 'torch'",
    ),
    (
        "the package __init__ imports the offline LLM (torch) eagerly",
        "services/pipeserve/__init__.py",
        "from pipeserve.outputs import CompletionOutput, RequestOutput\n",
        "from pipeserve.entrypoints.llm import LLM  # noqa: F401\n"
        "from pipeserve.outputs import CompletionOutput, RequestOutput\n",
        "tests/test_import_graph.py -k torch",
    ),
    (
        "operator rolls every outdated group at once",
        "services/pipeserve_operator/handlers.py",
        "            may_roll = all(r.phase is Phase.READY for i, r in enumerate(records) if i != index)",
        "            may_roll = True",
        "tests/k8s/test_operator.py -k rolls",
    ),
    (
        "operator never rolls a changed spec out",
        "services/pipeserve_operator/observe.py",
        "        outdated=wanted_hash is not None and template_hash(pod) != wanted_hash,",
        "        outdated=False,",
        "tests/k8s/test_operator.py -k rolls",
    ),
    (
        "replay never compares a plan's digest",
        "services/pipeserve/ring/replay.py",
        "        if digest != plan.digest:",
        "        if False:",
        "tests/obs/test_flight.py -k corrupted",
    ),
    (
        "the router does not put the trace context into the Generate call's metadata",
        "services/pipeserve/router/upstream.py",
        "Generate(self.request, metadata=span.metadata or None)",
        "Generate(self.request, metadata=None)",
        "tests/obs/test_tracing.py -k one_trace",
    ),
    (
        "plans carry no trace context to the followers",
        "services/pipeserve/engine/scheduler.py",
        "            traces=self._traces(new_reqs),\n",
        "",
        "tests/obs/test_tracing.py -k one_trace",
    ),
    (
        "dashboard queries a misspelt metric",
        "charts/pipeserve/dashboards/pipeserve.json",
        "(rate(pipeserve:hicache_l2_evictions_total[$__rate_interval]))",
        "(rate(pipeserve:hicache_l2_eviction_total[$__rate_interval]))",
        "tests/obs/test_dashboard.py -k exported",
    ),
    (
        "a stage metric renamed without docs/metrics.md",
        "services/pipeserve/stage/engine_metrics.py",
        'P + "kv_cache_usage_perc": Metric(',
        'P + "kv_cache_usage": Metric(',
        "tests/obs/test_metrics_names.py -k documented",
    ),
    (
        "stage 0's time to first token never observed",
        "services/pipeserve/stage/request_metrics.py",
        "                self.ttft.observe(now - req.arrival)\n",
        "                pass\n",
        "tests/obs/test_metrics_names.py -k moved",
    ),
    (
        "the log rate limiter lets every repeated line through",
        "services/pipeserve/obs/ratelimit.py",
        "            if state is not None and now - state.last_emit < self.interval_s:",
        "            if False:",
        "tests/obs/test_logs.py -k rate_limiter",
    ),
    (
        "the engine loop logs every idle pass",
        "services/pipeserve/stage/engine_loop.py",
        "                    self._wake.wait(IDLE_WAIT_S)\n",
        "                    log.debug('idle pass')\n                    self._wake.wait(IDLE_WAIT_S)\n",
        "tests/obs/test_logs.py -k idle",
    ),
    (
        "a serving-path log call formats a tensor",
        "services/pipeserve/hicache/writer.py",
        'log.warning("L3 unavailable for stage %d: %s", self.layout.stage, e)',
        'log.warning("L3 unavailable for stage %d: %s (page %s)", self.layout.stage, e, page)',
        "tests/obs/test_logs.py -k serving",
    ),
    (
        "a follower's divergence exits like any group stop (no diverged cause)",
        "services/pipeserve/ring/follower.py",
        "            return ExitCode.DIVERGED",
        "            return ExitCode.GROUP_STOP",
        "tests/ring/test_pipeline_faults.py -k corrupted",
    ),
    (
        "the Triton decode kernel ignores the last partial block",
        "kernels/triton_attention.py",
        "        valid = toks < ctx\n",
        "        valid = toks < ctx // BS * BS\n",
        "tests/kernels/test_triton_kernels.py -k decode",
    ),
    (
        "CPU decode reads scattered blocks as one run of the pool",
        "kernels/cpu.py",
        "    return blocks == list(range(blocks[0], blocks[0] + len(blocks)))",
        "    return True",
        "tests/kernels/test_cpu_ops.py -k one_row",
    ),
    (
        "CPU rotary negates the wrong half of sin",
        "kernels/cpu.py",
        "torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)",
        "torch.cat((sin[:, :half], -sin[:, half:]), dim=-1)",
        "tests/kernels/test_cpu_ops.py -k rotary",
    ),
    (
        "router polls a starting group only every interval",
        "services/pipeserve/router/replicas.py",
        "            fast = not g.routable",
        "            fast = False",
        "tests/router/test_router_ready_poll.py",
    ),
    (
        "16-bit KV pages keyed as the model's dtype",
        "services/pipeserve/hicache/assemble.py",
        "    dtype = dtype or cfg.dtype",
        "    dtype = cfg.dtype",
        "tests/engine/test_kv_memory.py -k page",
    ),
    (
        "kv_cache_dtype ignored by the pool",
        "services/pipeserve/ring/worker.py",
        "config.block_size, device, pool_dtype)",
        "config.block_size, device)",
        "tests/engine/test_kv_memory.py -k tolerance",
    ),
    (
        "pipeserve up imports torch",
        "services/pipeserve/care/launcher.py",
        "if TYPE_CHECKING:  # ring.group imports torch",
        "if True:  # ring.group imports torch",
        "tests/supervisor/test_up_imports.py",
    ),
    (
        "bench --compare ratio upside down (peer over self)",
        "services/pipeserve/bench/compare.py",
        "        out[key] = a / b if a is not None and b else None",
        "        out[key] = b / a if b is not None and a else None",
        "tests/bench/test_compare.py -k stand_ins",
    ),
    (
        "bench client never retries a connection closed before the response",
        "services/pipeserve/bench/client.py",
        "            for attempt in range(2):",
        "            for attempt in range(1):",
        "tests/bench/test_bench_retry.py",
    ),
    (
        "bench client retries a response that had started",
        "services/pipeserve/bench/client.py",
        "                    if started or attempt:",
        "                    if attempt:",
        "tests/bench/test_bench_retry.py",
    ),
    (
        "CPU projections left unpacked (MKL's slow small-M path)",
        "kernels/__init__.py",
        '    return cpu_linear.pack_weight(weight) if BACKEND == "auto" else weight',
        "    return weight",
        "tests/kernels/test_cpu_linear.py",
    ),
    (
        "tied lm_head packed (the vocabulary matrix held twice)",
        "services/pipeserve/model/stage_model.py",
        "            if isinstance(module, Linear) and not (tied and module is self.lm_head):",
        "            if isinstance(module, Linear):",
        "tests/kernels/test_cpu_linear.py",
    ),
    (
        "engine loop on a thread of its own, not the one that built the engine",
        "services/pipeserve/stage/engine_loop.py",
        "        if self._executor is not None:",
        "        if False:",
        "tests/stage/test_engine_thread.py",
    ),
    (
        "oneDNN sees every row count (one cached primitive per shape, unbounded memory)",
        "kernels/cpu_linear.py",
        "        run = n if n <= EXACT_ROWS else math.ceil(n / ROW_QUANTUM) * ROW_QUANTUM",
        "        run = n",
        "tests/kernels/test_cpu_linear.py",
    ),
    (
        "int4 zero point ignored (the group minimum dropped)",
        "services/pipeserve/model/quant.py",
        "        zeros = m + 8.0 * s  # the kernel's zero: (q - 8) * s + z",
        "        zeros = 8.0 * s",
        "tests/model/test_quant.py",
    ),
    (
        "the fingerprint ignores the quantization",
        "services/pipeserve/model/loader.py",
        '        h.update(f"|q={quantization}|g={group_size}".encode())',
        "        pass",
        "tests/model/test_quant.py",
    ),
]
ROOT = pathlib.Path(__file__).resolve().parent.parent
PYTHON = ROOT / ".venv" / "bin" / "python"
# Import name -> its folder in the tree (pyproject.toml's package-dir).
PACKAGES = {
    "pipeserve": "services/pipeserve",
    "pipeserve_kernels": "kernels",
    "pipeserve_operator": "services/pipeserve_operator",
}


def copy_tree(dest: pathlib.Path) -> None:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for rel in filter(None, (f.decode() for f in listed)):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def run_mutant(path: str, old: str, new: str, tests: str) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="pipeserve-mutant-") as tmp:
        tree, imports = pathlib.Path(tmp) / "tree", pathlib.Path(tmp) / "imports"
        copy_tree(tree)
        imports.mkdir()
        for name, folder in PACKAGES.items():
            (imports / name).symlink_to(tree / folder)
        target = tree / path
        src = target.read_text()
        assert old in src, (path, old)
        target.write_text(src.replace(old, new, 1))
        return subprocess.run(
            f"{PYTHON} -m pytest -q -x -p no:cacheprovider {tests}",
            shell=True,
            cwd=tree,
            env={**os.environ, "PYTHONPATH": str(imports)},
            capture_output=True,
            text=True,
        )


if __name__ == "__main__":
    only = sys.argv[1:]
    green = 0
    for name, path, old, new, tests in [MUTANTS[int(i)] for i in only] if only else MUTANTS:
        r = run_mutant(path, old, new, tests)
        last = (r.stdout.strip().splitlines() or [r.stderr.strip()[-300:]])[-1]
        print(f"{'RED  ' if r.returncode else 'GREEN'} {name}: {last}", flush=True)
        green += r.returncode == 0
    sys.exit(green)
