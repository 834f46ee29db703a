"""The fault checker: a bounded mixed load against the router, every request's outcome recorded.

Each request is a greedy completion of a token-id prompt, either whole or streamed (SSE), with
`return_token_ids`, so its answer compares token for token with transformers. Outcomes:

    ok      200 and the token ids are transformers' greedy ids, finished once
    error   a clean OpenAI-shaped error: a non-200 with {"error": {"message", "type", ...}}, or a
            stream that ends with an error event; the tokens streamed before it are a prefix of
            transformers' (nothing wrong was said before the error)
    hung    no end within the client's deadline (the router's own deadlines must end it first)
    wrong   anything else: other ids, a malformed error, a second answer (two finish reasons for a
            choice, data after [DONE], two [DONE])

`Load.check()` fails unless every outcome is ok or error; callers assert on the counts.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx

CLIENT_DEADLINE_S = 30.0  # well past the router's FIRST_TOKEN_S + STREAM_IDLE_S: a request past it hung


@dataclass
class Case:
    prompt: list[int]
    want: list[int]  # transformers' greedy ids (max_tokens of them, or fewer up to an EOS)
    stream: bool
    max_tokens: int


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
    choices = r.json()["choices"]
    ids = choices[0].get("token_ids")
    if len(choices) != 1 or ids != case.want:
        return Outcome(i, False, "wrong", 200, f"got {ids}, want {case.want}", tokens=ids or [])
    return Outcome(i, False, "ok", 200, choices[0]["finish_reason"], tokens=ids)


def _streamed(client: httpx.Client, url: str, body: dict, case: Case, i: int) -> Outcome:
    tokens: list[int] = []
    finishes, dones, after_done, error = 0, 0, 0, None
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
                tokens += choice.get("token_ids") or []
                finishes += choice.get("finish_reason") is not None
    prefix = tokens == case.want[: len(tokens)]
    if error is not None:
        clean = error.startswith("unshaped") is False and prefix and finishes == 0 and after_done == 0
        return Outcome(i, True, "error" if clean else "wrong", 200, error, tokens=tokens)
    if tokens != case.want or finishes != 1 or dones != 1 or after_done:
        detail = f"got {tokens} want {case.want}; finishes {finishes}, [DONE] {dones}, after it {after_done}"
        return Outcome(i, True, "wrong", 200, detail, tokens=tokens)
    return Outcome(i, True, "ok", 200, tokens=tokens)


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
        body = {"model": self.model, "prompt": case.prompt, "max_tokens": case.max_tokens, "temperature": 0}
        body["return_token_ids"] = True
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
