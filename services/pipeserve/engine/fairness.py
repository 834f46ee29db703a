"""Fair shares of a step (stage 0's scheduler): one client cannot slow the others (issue 29).

Three rules, each the scheduler's (engine/scheduler.py) and so decided on stage 0 only:

* **Step pace** (`StepPace`): a plan's cost is its tokens plus its prompt-scoring rows (a scored
  row runs lm_head, a float32 log_softmax and a top-k over the vocabulary: counted as one more
  token). Stage 0 measures what plans cost — the stages' busy seconds for each plan (the sum
  over stages: a request's step crosses every one of them) per unit of cost — and sizes each
  plan so it is predicted to take at most `target_s`. Decodes run first (one token per running
  request), at most as many rows as the pace allows once waiting prompts have kept their
  reserve (what they claim, up to PROMPT_RESERVE of the plan; never fewer than MIN_DECODE_ROWS
  rows): past that, each family gets a max-min fair share of the rows (`share_decodes`), so
  n=128 siblings decode in turns and an unrelated request still gets a token every plan, and
  its prompt the reserve. Prompts and scoring fill what is left, at least MIN_PREFILL_TOKENS a
  plan so a long prompt still progresses. A long prompt therefore never holds the batch for
  seconds, and an abort (applied between steps) takes effect within one short step.
  A scored row's true cost is not one unit (on a CPU about four tokens' worth, on a GPU less), so
  the pace measured without scoring does not predict it: a plan's scoring rows grow from
  MIN_SCORE_ROWS at most doubling the previous plan's (`score_rows`), while the pace learns their
  cost, as TCP's slow start does; 1,024 rows at a pace measured on plain tokens took 1.7 s.
* **Water-filling** (`water_fill`, `family_caps`): the prompt share of a plan is split max-min
  fairly between the families whose prompts want tokens (running prompts and the waiting
  requests with a free seat), then between each family's prompts: a short prompt gets all it
  needs, the long ones share the rest equally, and 128 siblings' prompts count as one claim.
  Where that would cut prompts into chunks under MIN_PROMPT_CHUNK, the plan takes fewer of them
  (`pooled`: round-robin by family, short claims first in each round) and the others wait a plan:
  prompts then reach their first token in turn, not all together at the end.
* **Families** (`family`, `fair_order`): the router sends a response's upstream calls as
  `<response id>-<prompt>[-<candidate>]` (router/http/handlers.py, router/upstream/fanout.py), so `n`,
  `best_of` and a list of prompts are one family. Waiting requests are admitted round-robin by
  family (fewest seats held first, then arrival), and a family holding fewer seats than the
  largest one (by two or more) may take a seat from it by preemption when every seat is held:
  n=128 x best_of=128 cannot keep an unrelated request waiting for its 256 sequences to end.

Invariant: these rules change only which tokens a plan carries, never what is computed for
them: token ids and logprobs are the same for any chunking (tests/engine/test_prompt_logprobs.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from pipeserve.engine.plan import StageReport, StepPlan

if TYPE_CHECKING:
    from pipeserve.engine.request import Request

MIN_PREFILL_TOKENS = 16  # a plan's prompt share never falls under this (a long prompt progresses)
BOOT_TOKENS = 256  # the prompt share before any plan was measured
PACE_MIN_COST = 16  # plans cheaper than this are not measured (fixed overheads dominate them)
PACE_WEIGHT = 0.3  # weight of the newest measurement in the moving average
# A plan's decode rows never fall under this: below it a plan's fixed costs dominate, and a family
# of this many siblings or fewer always decodes whole.
MIN_DECODE_ROWS = 32
# The part of a plan waiting prompts may keep from the decodes (when they claim that much).
PROMPT_RESERVE = 0.5
# A plan's scoring rows after a plan without any (they at most double from plan to plan after it).
MIN_SCORE_ROWS = 32
# A prompt chunk cut short by the plan's share holds at least this many cost units (`pooled`).
MIN_PROMPT_CHUNK = 64


def plan_cost(plan: StepPlan) -> int:
    """A plan's cost in token units: its tokens, plus one per prompt-scoring row."""
    return sum(len(c.token_ids) + c.score_rows for c in plan.chunks)


def plan_score_rows(plan: StepPlan) -> int:
    return sum(c.score_rows for c in plan.chunks)


class StepPace:
    """Seconds per unit of plan cost, measured from the stages' busy meters; the shares that keep
    a plan within `target_s` (None: no time target, the token budget alone)."""

    def __init__(self, target_s: float | None) -> None:
        self.target_s = target_s
        self.s_per_token: float | None = None
        self._busy: dict[int, float] = {}  # rank -> busy seconds at its previous report
        self._score_rows = 0  # scoring rows of the plan that came back last

    def observe(self, cost: int, reports: Sequence[StageReport], score_rows: int = 0) -> None:
        """A plan of `cost` (`score_rows` of it scoring rows) came back with these reports
        (cumulative busy seconds per stage)."""
        self._score_rows = score_rows
        spent, known = 0.0, bool(reports)
        for r in reports:
            before = self._busy.get(r.rank)
            self._busy[r.rank] = r.busy_s
            if before is None or r.busy_s < before:  # first report, or a new incarnation of the stage
                known = False
            else:
                spent += r.busy_s - before
        if not known or cost < PACE_MIN_COST or spent <= 0:
            return
        new = spent / cost
        old = self.s_per_token
        self.s_per_token = new if old is None else (1 - PACE_WEIGHT) * old + PACE_WEIGHT * new

    def prompt_share(self, decodes: int) -> int | None:
        """Prompt (and scoring) tokens a plan may add to its `decodes`; None: no time limit."""
        if self.target_s is None:
            return None
        if self.s_per_token is None:
            return BOOT_TOKENS
        return max(MIN_PREFILL_TOKENS, int(self.target_s / self.s_per_token) - decodes)

    def decode_rows(self, prompt_claim: int = 0) -> int | None:
        """Decode rows a plan may hold (the rest wait a plan); None: every row. Prompts that claim
        `prompt_claim` cost units keep up to PROMPT_RESERVE of the plan from the decodes: a fan-out's
        rows cannot leave an unrelated prompt MIN_PREFILL_TOKENS a plan (its first token seconds away)."""
        if self.target_s is None or self.s_per_token is None:
            return None
        units = int(self.target_s / self.s_per_token)
        return max(MIN_DECODE_ROWS, units - min(prompt_claim, int(PROMPT_RESERVE * units)))

    def score_rows(self) -> int | None:
        """Prompt-scoring rows a plan may hold (its slow start); None: no time limit."""
        if self.target_s is None:
            return None
        return max(MIN_SCORE_ROWS, 2 * self._score_rows)


def share_decodes(reqs: Sequence[Request], rows: int | None) -> list[Request]:
    """The decoding requests `reqs` (oldest first) a plan takes within `rows`: all of them when
    they fit; else each family at most a max-min fair share of the rows, its requests furthest
    behind first (fewest tokens: siblings stay within a token of each other). Order kept."""
    if rows is None or len(reqs) <= rows:
        return list(reqs)
    by_family: dict[str, list[int]] = {}
    for i, r in enumerate(reqs):
        by_family.setdefault(family(r.req_id), []).append(i)
    cap = water_fill([len(ix) for ix in by_family.values()], rows)
    keep: set[int] = set()
    for ix in by_family.values():
        keep.update(sorted(ix, key=lambda i: (reqs[i].num_tokens, i))[:cap])
    return [r for i, r in enumerate(reqs) if i in keep]


def family_caps(needs: Sequence[tuple[str, int]], budget: int, floor: int = 1) -> dict[str, int]:
    """Each request's cap (cost units) of a plan's prompt share `budget`, from (request id, units
    wanted), in priority order: max-min fair between families first, then between a family's
    requests, so an unrelated prompt gets all it needs beside 128 siblings' prompts (each at least
    1, and at most its need). Where a cap would cut a chunk under `floor` units (and under its
    need), only the requests `pooled` keeps share the budget; the others get 0 (they wait a plan)."""
    caps = _fair_caps(needs, budget)
    if all(caps[rid] >= min(need, floor) for rid, need in needs):
        return caps
    kept = pooled(needs, budget, floor)
    caps = _fair_caps([(rid, need) for rid, need in needs if rid in kept], budget)
    return {rid: caps.get(rid, 0) for rid, _ in needs}


def _fair_caps(needs: Sequence[tuple[str, int]], budget: int) -> dict[str, int]:
    by_family: dict[str, list[tuple[str, int]]] = {}
    for rid, need in needs:
        by_family.setdefault(family(rid), []).append((rid, need))
    share = water_fill([sum(n for _, n in m) for m in by_family.values()], budget)
    caps: dict[str, int] = {}
    for members in by_family.values():
        cap = water_fill([n for _, n in members], min(share, sum(n for _, n in members)))
        caps.update((rid, max(1, min(cap, need))) for rid, need in members)
    return caps


def pooled(needs: Sequence[tuple[str, int]], budget: int, floor: int) -> set[str]:
    """The requests of `needs` a plan takes when its share would cut prompts into chunks under
    `floor` units: round-robin by family (each family's first request, then its second...), in a
    round the smaller claims first, then `needs` order; each taken while the budget holds
    min(need, floor) for it (at least one). Split max-min, 16 long prompts get 15 tokens a plan
    each and every one reaches its first token only when all do (processor sharing), with a plan
    spread over many requests; taken in turn, the first ones finish sooner and start decoding for
    the same work, and short prompts (a probe, a chat turn) still go first (benchmarks/RESULTS.md,
    session 9)."""
    taken: Counter[str] = Counter()
    keyed = []
    for i, (rid, need) in enumerate(needs):
        keyed.append((taken[family(rid)], min(need, floor), i))
        taken[family(rid)] += 1
    kept: set[str] = set()
    room = budget
    for _, claim, i in sorted(keyed):
        if not kept or claim <= room:
            kept.add(needs[i][0])
            room -= claim
    return kept


def water_fill(needs: Iterable[int], budget: int) -> int:
    """The largest per-request cap c with sum(min(need, c)) <= budget (max-min fairness); at
    least 1, so every prompt gets a token when the budget is short."""
    ordered = sorted(n for n in needs if n > 0)
    left, count = budget, len(ordered)
    for i, need in enumerate(ordered):
        share = left // (count - i)
        if need > share:
            return max(1, share)
        left -= need
    return max(1, budget)


def family(req_id: str) -> str:
    """The response a request belongs to: `cmpl-<hex>-0-3` and `cmpl-<hex>-1` are both of
    `cmpl-<hex>` (the router's naming, module docstring); an id without two parts is its own."""
    parts = req_id.split("-", 2)
    return "-".join(parts[:2])


def fair_order(ids: Sequence[str], seats: Counter[str]) -> list[int]:
    """Indices of the waiting requests `ids` round-robin by family: the k-th waiting request of
    a family holding s seats comes at rank s + k; ties in arrival order."""
    taken: Counter[str] = Counter()
    keys = []
    for i, rid in enumerate(ids):
        f = family(rid)
        keys.append((seats[f] + taken[f], i))
        taken[f] += 1
    return [i for _, i in sorted(keys)]
