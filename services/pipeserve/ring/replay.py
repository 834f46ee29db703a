"""`pipeserve replay`: re-execute a flight dump's plans offline and name the first one that differs.

A follower's input activations are not recorded, so replay rebuilds the whole group in this process
(every stage's layers and its own KV pool, on the CPU, with the recording stage's thread count) and
runs each recorded plan through stage 0, then each stage in order, as the ring did. Per plan, in
step order, it checks:
  digest     the plan's bytes hash to the digest it carries, and (stage 0's dump) to the digest
             stage 0 sealed — a plan altered in flight fails here;
  reports    every recorded stage report (stage 0's dump: all of them, from the Result; stage k's:
             those up to k) names that digest, and holds the requests and blocks replay's stage holds;
  output     the recording stage's activation digest equals replay's (bitwise: same plan, same
             kernels, same thread count on the CPU), and the sampled token ids equal replay's.
`stage` restricts the report and activation checks to that stage (the sampled tokens always count).

Exactness: the plans carry the token ids, so the KV state is rebuilt from the first recorded plan.
The window is exact when it starts at the engine's first plan (nothing dropped, step 1). Otherwise a
request whose history began before the window is left out (its chunks, frees and entry removed from
the plans, which are resealed): those requests are listed as skipped, and for plans that lost some,
only digests and the remaining requests' tokens are compared (the batch differs, so activations and
table sizes cannot be). A request entering the window through a prefix hit is skipped too (its cached
blocks may predate the window). Plans that move KV through HiCache (L2 copies, L3 loads) cannot be
replayed (no tiers here): replay stops there and says so.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import torch
import xxhash

from pipeserve.config import EngineConfig
from pipeserve.engine.executor import PlanMismatch
from pipeserve.engine.grammar import GrammarBook
from pipeserve.engine.plan import SampledToken, ScheduledChunk, StageReport, StepPlan, plan_digest, seal
from pipeserve.model.config import ModelConfig
from pipeserve.model.loader import load_stage_model
from pipeserve.model.stage_model import StageSpec
from pipeserve.obs.flight import FlightDump, FlightRecord, FlightRecorder, StageSetup, default_directory
from pipeserve.ring.member import RingStage
from pipeserve.ring.messages import Forward, Result, decode_frame
from pipeserve.worker.build import build_runner
from pipeserve.worker.kv_cache import kv_dtype
from pipeserve.worker.model_runner import ModelRunner


def recorder_for(stage: RingStage) -> FlightRecorder:
    """The flight recorder of a stage of a ring, bounded and placed by its EngineConfig."""
    cfg: EngineConfig = stage.config
    split = stage.split
    setup = StageSetup(
        ",".join(f"{lo}:{hi}" for lo, hi in split),
        cfg.block_size,
        stage.num_blocks,
        stage.max_model_len,
        str(stage.model_config.dtype).removeprefix("torch."),
        cfg.seed,
        torch.get_num_threads(),
        stage.host_slots,
        cfg.l3_url is not None,
        cfg.quantization,
        cfg.quantization_group_size,
        str(kv_dtype(cfg, stage.model_config)).removeprefix("torch."),
    )
    return FlightRecorder(
        stage.spec.rank,
        cfg.stages,
        setup,
        cfg.flight_records,
        int(cfg.flight_max_mib * 2**20),
        cfg.flight_dir or default_directory(),
    )


def activation_digest(t: torch.Tensor | None) -> int | None:
    """xxh3 of a CPU tensor's bytes; None for a device tensor (never synchronize for a record)."""
    if t is None or t.device.type != "cpu":
        return None
    return xxhash.xxh3_64_intdigest(t.detach().contiguous().view(torch.uint8).numpy().data)


@dataclass
class Difference:
    step_id: int
    req_ids: list[str]
    what: str


@dataclass
class ReplayReport:
    file: str
    rank: int
    plans: int = 0  # plans replayed and compared
    exact: bool = True  # the window starts at the engine's first plan
    skipped: list[str] = field(default_factory=list)  # requests whose history began before the window
    first: Difference | None = None
    cannot: str | None = None  # why replay could not go on (HiCache moves)

    @property
    def status(self) -> int:
        return 1 if self.first else 2 if self.cannot else 0

    def line(self) -> str:
        where = f"replay {self.file} (stage {self.rank}'s dump)"
        if self.first:
            d = self.first
            return f"{where}: step {d.step_id} differs (requests {', '.join(d.req_ids) or '-'}): {d.what}"
        skipped = f"; {len(self.skipped)} requests began before the window, skipped" if self.skipped else ""
        if self.cannot:
            return f"{where}: {self.plans} plans agree, then cannot replay: {self.cannot}{skipped}"
        exact = "exact window" if self.exact else "window starts mid-run"
        return f"{where}: all {self.plans} plans agree ({exact}{skipped})"

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {"status": self.status, "line": self.line()}


class _Group:
    """Every stage of the recorded group, in this process, on the CPU."""

    def __init__(self, model: str, dump: FlightDump, num_blocks: int) -> None:
        s = dump.setup
        cfg = ModelConfig.from_dir(model, s.dtype)
        cpu = torch.device("cpu")
        self.runners: list[ModelRunner] = []
        for rank, (lo, hi) in enumerate(_split(s)):
            spec = StageSpec(rank, dump.stages, lo, hi)
            stage_model = load_stage_model(
                model, cfg, spec, s.max_model_len, cpu, s.quantization, s.quantization_group_size
            )
            # Structured outputs are masked on the last stage, as in the group (worker/grammar.py).
            book = GrammarBook(model, cfg.vocab_size, cfg.eos_token_ids) if spec.is_last else None
            pool = getattr(torch, s.kv_dtype) if s.kv_dtype else None  # None: the model's dtype
            self.runners.append(
                build_runner(
                    stage_model, num_blocks, s.block_size, s.seed, cpu, kv_dtype=pool, grammar_book=book
                )
            )

    def run(self, plan: StepPlan) -> tuple[list[StageReport], list[int | None], list[SampledToken]]:
        """Reports, activation digests (None on the last stage) and sampled tokens of one plan."""
        hidden: torch.Tensor | None = None
        reports: list[StageReport] = []
        acts: list[int | None] = []
        sampled: list[SampledToken] = []
        for runner in self.runners:
            hidden, sampled, report = runner.run(plan, hidden)
            reports.append(report)
            acts.append(activation_digest(hidden))
        return reports, acts, sampled


def _split(s: StageSetup) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in (r.split(":") for r in s.layer_split.split(","))]


def _recorded(dump: FlightDump, rec: FlightRecord) -> tuple[StepPlan, list[StageReport], list | None]:
    """The plan, the stage reports and the sampled tokens (None: not in this dump) of one record."""
    fwd = decode_frame(rec.forward)
    if not isinstance(fwd, Forward):
        raise PlanMismatch(f"step {rec.step_id}: recorded a {type(fwd).__name__} frame, not a Forward")
    reports, sampled = list(fwd.reports), None
    if rec.out is not None:
        out = decode_frame(rec.out)
        if isinstance(out, Result):
            reports, sampled = list(out.output.reports), list(out.output.sampled)
        elif isinstance(out, Forward):
            reports = list(out.reports)
    return fwd.plan, reports, sampled


def _keep_only(plan: StepPlan, freed: list[str], live: set[str]) -> StepPlan:
    return seal(
        msgspec.structs.replace(
            plan,
            freed=freed,
            new_requests=[n for n in plan.new_requests if n.req_id in live],
            chunks=[c for c in plan.chunks if c.req_id in live],
        )
    )


def replay(path: str | Path, model: str, stage: int | None, dump: FlightDump) -> ReplayReport:
    """Replay `dump` (read from `path`) against the checkpoint `model`; see the module docstring."""
    report = ReplayReport(str(path), dump.rank)
    records = sorted(dump.records, key=lambda r: r.step_id)
    if not records:
        return report
    if stage is not None and not 0 <= stage < dump.stages:
        raise ValueError(f"--stage: {stage} is not a stage of this {dump.stages}-stage group")
    report.exact = dump.dropped == 0 and records[0].step_id == 1
    decoded = [(rec, *_recorded(dump, rec)) for rec in records]
    ids = [b for _, plan, _, _ in decoded for c in plan.chunks for b in c.new_block_ids]
    group = _Group(model, dump, min(dump.setup.num_blocks, max(ids, default=0) + 1))
    torch.set_num_threads(dump.setup.num_threads)
    ranks = range(dump.stages) if stage is None else [stage]
    live: set[str] = set()
    for rec, plan, reports, sampled in decoded:
        req_ids = sorted({c.req_id for c in plan.chunks})
        digest = plan_digest(plan)
        what = None
        if digest != plan.digest:
            what = (
                f"digest: the plan's bytes hash to {digest:#x}, it carries {plan.digest:#x} "
                "(altered in flight)"
            )
        elif rec.digest is not None and rec.digest != plan.digest:
            what = f"digest: stage 0 sealed {rec.digest:#x}, the plan it sent carries {plan.digest:#x}"
        if what is None and (plan.l2_saves or plan.l2_loads or plan.l3_loads):
            report.cannot = (
                f"step {plan.step_id} moves KV blocks through HiCache (L2/L3): replay has no tiers"
            )
            return report
        if what is None:
            what = _execute(group, plan, digest, reports, sampled, ranks, rec, dump, report, live)
        if what is not None:
            report.first = Difference(plan.step_id, req_ids, what)
            return report
        report.plans += 1
    return report


def _execute(
    group: _Group,
    plan: StepPlan,
    digest: int,
    reports: list[StageReport],
    sampled: list | None,
    ranks: range | list[int],
    rec: FlightRecord,
    dump: FlightDump,
    report: ReplayReport,
    live: set[str],
) -> str | None:
    """Run one recorded plan on every stage; what differs from the record, or None."""
    freed = [r for r in plan.freed if r in live]  # frees apply before the plan's new requests
    live.difference_update(plan.freed)
    first_chunk: dict[str, ScheduledChunk] = {}
    for c in plan.chunks:
        first_chunk.setdefault(c.req_id, c)
    for new in plan.new_requests:
        chunk = first_chunk.get(new.req_id)
        if report.exact or (chunk is not None and chunk.start_pos == 0):
            live.add(new.req_id)
        elif new.req_id not in report.skipped:
            report.skipped.append(new.req_id)
    for c in plan.chunks:
        if c.req_id not in live and c.req_id not in report.skipped:
            report.skipped.append(c.req_id)
    run = plan if report.exact else _keep_only(plan, freed, live)
    whole = run.digest == plan.digest  # nothing left out: the batch is the live one
    try:
        mine, acts, tokens = group.run(run)
    except PlanMismatch as e:
        return f"replay refused the plan: {e}"
    for r in reports:
        if r.rank not in ranks:
            continue
        if r.digest != digest:
            return f"stage {r.rank} reported digest {r.digest:#x}, the plan's digest is {digest:#x}"
        ours = mine[r.rank]
        if whole and (r.num_reqs, r.blocks_held) != (ours.num_reqs, ours.blocks_held):
            return (
                f"stage {r.rank} held {r.num_reqs} requests / {r.blocks_held} blocks, "
                f"replay {ours.num_reqs} / {ours.blocks_held}"
            )
    if whole and dump.rank in ranks and rec.act_digest is not None and acts[dump.rank] is not None:
        if rec.act_digest != acts[dump.rank]:
            return (
                f"stage {dump.rank} activations differ (xxh3 {rec.act_digest:#x} recorded, "
                f"{acts[dump.rank]:#x} replayed)"
            )
    if sampled is not None:
        want = {t.req_id: t.token_id for t in sampled if t.req_id in live or report.exact}
        got = {t.req_id: t.token_id for t in tokens if t.req_id in want}
        if want != got:
            bad = sorted(r for r in want.keys() | got.keys() if want.get(r) != got.get(r))
            return f"sampled tokens differ for {', '.join(bad)}: recorded {want}, replayed {got}"
    return None
