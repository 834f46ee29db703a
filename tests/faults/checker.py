"""The fault checker: a bounded mixed load against the router, every request's outcome recorded.

Each request is a greedy completion of a token-id prompt, whole or streamed (SSE), with
`return_token_ids`, so its answer compares token for token with transformers: plain, with n > 1
(every choice is the greedy ids) or with a response_format json_schema (transformers with
xgrammar's logits processor: oracle.py). Outcomes:

    ok      200 and every choice's token ids are the oracle's, each choice finished once
    error   a clean OpenAI-shaped error: a non-200 with {"error": {"message", "type", ...}}, or a
            stream that ends with an error event; the tokens streamed before it are a prefix of
            transformers' (nothing wrong was said before the error)
    hung    no end within the client's deadline (the router's own deadlines must end it first), or
            an end after REQUEST_DEADLINE_S (a stream that trickles on past any bound)
    wrong   anything else: other ids, a malformed error, a second answer (two finish reasons for a
            choice, data after [DONE], two [DONE])

`check()` fails unless every outcome is ok or error; callers assert on the counts. A test records
its fault's row (ok / failed clean / hung, p99 latency, time to Ready after the heal) in the
Table that table.py prints (benchmarks/RESULTS.md, issue 29).
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

CLIENT_DEADLINE_S = 30.0  # well past the router's FIRST_TOKEN_S + STREAM_IDLE_S: a request past it hung
REQUEST_DEADLINE_S = 40.0  # a whole request, however its tokens trickle


@dataclass
class Case:
    prompt: list[int]
    want: list[int]  # the oracle's greedy ids (max_tokens of them, or fewer up to an EOS)
    stream: bool
    max_tokens: int
    n: int = 1  # choices, each of them `want` (greedy)
    schema: dict | None = None  # response_format json_schema (`want` from the constrained oracle)

    def body(self, model: str) -> dict:
        body = {"model": model, "prompt": self.prompt, "max_tokens": self.max_tokens, "temperature": 0}
        body["return_token_ids"] = True
        if self.n > 1:
            body["n"] = self.n
        if self.schema is not None:
            schema = {"name": "f", "schema": self.schema}
            body["response_format"] = {"type": "json_schema", "json_schema": schema}
        return body

    @property
    def kind(self) -> str:
        return "json_schema" if self.schema is not None else f"n={self.n}" if self.n > 1 else "greedy"


@dataclass
class Outcome:
    case: int
    stream: bool
    kind: str  # ok | error | hung | wrong
    status: int = 0
    detail: str = ""
    seconds: float = 0.0
    tokens: list[int] = field(default_factory=list)


def _clean_error(body: object) -> str | None:
    """The error's message when `body` is OpenAI-shaped, else None."""
    if isinstance(body, dict) and isinstance(err := body.get("error"), dict):
        if isinstance(err.get("message"), str) and isinstance(err.get("type"), str):
            return err["message"]
    return None


def _whole(client: httpx.Client, url: str, body: dict, case: Case, i: int) -> Outcome:
    r = client.post(url, json=body)
    if r.status_code != 200:
        msg = _clean_error(_json(r.text))
        kind = "error" if msg is not None else "wrong"
        return Outcome(i, False, kind, r.status_code, msg or r.text[:300])
    choices = sorted(r.json()["choices"], key=lambda c: c.get("index", -1))
    got = [c.get("token_ids") for c in choices]
    finished = all(c.get("finish_reason") for c in choices)
    indices = [c.get("index") for c in choices]
    if indices != list(range(case.n)) or got != [case.want] * case.n or not finished:
        return Outcome(i, False, "wrong", 200, f"got {got}, want {case.n} x {case.want}", tokens=got[0] or [])
    return Outcome(i, False, "ok", 200, choices[0]["finish_reason"], tokens=got[0])


def _streamed(client: httpx.Client, url: str, body: dict, case: Case, i: int) -> Outcome:
    tokens: dict[int, list[int]] = {k: [] for k in range(case.n)}
    finishes, dones, after_done, error = dict.fromkeys(range(case.n), 0), 0, 0, None
    with client.stream("POST", url, json={**body, "stream": True}) as r:
        if r.status_code != 200:
            msg = _clean_error(_json(r.read().decode(errors="replace")))
            return Outcome(i, True, "error" if msg is not None else "wrong", r.status_code, msg or "unshaped")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if dones:
                after_done += 1
            if data == "[DONE]":
                dones += 1
                continue
            event = json.loads(data)
            if (msg := _clean_error(event)) is not None or "error" in event:
                error = msg if msg is not None else f"unshaped error event {data[:200]}"
                continue
            for choice in event.get("choices", []):
                k = choice.get("index")
                if k not in tokens:
                    return Outcome(i, True, "wrong", 200, f"choice index {k!r} of n={case.n}")
                tokens[k] += choice.get("token_ids") or []
                finishes[k] += choice.get("finish_reason") is not None
    prefix = all(t == case.want[: len(t)] for t in tokens.values())
    if error is not None:  # no choice finished before the error: the request failed as a whole
        clean = not error.startswith("unshaped") and prefix and not any(finishes.values()) and not after_done
        return Outcome(i, True, "error" if clean else "wrong", 200, error, tokens=tokens[0])
    once = set(finishes.values()) == {1} and dones == 1 and not after_done
    if any(t != case.want for t in tokens.values()) or not once:
        detail = f"got {tokens} want {case.want}; finishes {finishes}, [DONE] {dones}, after it {after_done}"
        return Outcome(i, True, "wrong", 200, detail, tokens=tokens[0])
    return Outcome(i, True, "ok", 200, tokens=tokens[0])


def _json(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return None


class Load:
    """`cases` sent `concurrency` at a time, `gap_s` apart, in the background from `start()`."""

    def __init__(
        self, url: str, model: str, cases: list[Case], concurrency: int = 4, gap_s: float = 0.1
    ) -> None:
        self.url, self.model, self.cases, self.gap_s = url, model, cases, gap_s
        self.pool = ThreadPoolExecutor(concurrency)
        self.futures: list[Future[Outcome]] = []
        self._feeder = threading.Thread(target=self._feed, daemon=True)

    def start(self) -> Load:
        self._feeder.start()
        return self

    def _feed(self) -> None:
        for i in range(len(self.cases)):
            self.futures.append(self.pool.submit(self._one, i))
            time.sleep(self.gap_s)

    def _one(self, i: int) -> Outcome:
        case = self.cases[i]
        url = self.url + "/v1/completions"
        body = case.body(self.model)
        t0 = time.monotonic()
        try:
            with httpx.Client(timeout=httpx.Timeout(CLIENT_DEADLINE_S)) as client:
                fn = _streamed if case.stream else _whole
                out = fn(client, url, body, case, i)
        except httpx.TimeoutException as e:
            out = Outcome(i, case.stream, "hung", 0, f"{type(e).__name__} after {time.monotonic() - t0:.1f}s")
        except httpx.HTTPError as e:  # the router's own link is never cut: a dropped connection is wrong
            out = Outcome(i, case.stream, "wrong", 0, f"{type(e).__name__}: {e}")
        out.seconds = time.monotonic() - t0
        if out.seconds > REQUEST_DEADLINE_S and out.kind in ("ok", "error"):
            out.kind, out.detail = "hung", f"ended after {out.seconds:.1f}s: {out.detail}"
        return out

    def join(self) -> list[Outcome]:
        self._feeder.join()
        outcomes = [f.result() for f in self.futures]
        self.pool.shutdown()
        return outcomes


def summary(outcomes: list[Outcome]) -> Counter[str]:
    return Counter(o.kind for o in outcomes)


def check(outcomes: list[Outcome]) -> Counter[str]:
    """Every request ended, once, either right or with a clean error; returns the counts by kind."""
    bad = [o for o in outcomes if o.kind not in ("ok", "error")]
    assert not bad, f"{len(bad)} of {len(outcomes)} requests hung or were wrong: {bad[:3]}"
    return summary(outcomes)


def p99(outcomes: list[Outcome]) -> float:
    """The 99th percentile of the requests' latencies (nearest rank), seconds."""
    times = sorted(o.seconds for o in outcomes)
    return times[max(0, math.ceil(0.99 * len(times)) - 1)] if times else 0.0


@dataclass
class Row:
    test: str
    fault: str
    ok: int
    failed_clean: int
    hung: int
    wrong: int
    p99_s: float
    ready_s: float | None  # heal -> every stage and the router ready (None: the group never left Ready)


class Table:
    """One JSON line per fault (test) in `path`; table.py reads them."""

    def __init__(self, path: Path, test: str) -> None:
        self.path, self.test = path, test

    def record(self, fault: str, outcomes: list[Outcome], ready_s: float | None) -> Row:
        n = summary(outcomes)
        p99_s = round(p99(outcomes), 2)
        row = Row(self.test, fault, n["ok"], n["error"], n["hung"], n["wrong"], p99_s, ready_s)
        with open(self.path, "a") as f:
            f.write(json.dumps(asdict(row)) + "\n")
        return row
