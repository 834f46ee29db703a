"""The load generator: streamed `/v1/completions` requests over one httpx AsyncClient.

Each request is timed from just before it is sent (after it has won a concurrency slot,
as in SGLang, so client-side queueing is not charged to the server) to the end of its
stream. Arrival times come from `workloads.arrival_offsets`; an asyncio semaphore keeps at
most `concurrency` requests in flight. A failed request (HTTP status, an error event in
the stream, a stream cut short, a timeout) is recorded, never raised: one failure must not
end a run.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Sequence

import httpx
from tqdm import tqdm  # type: ignore[import-untyped]  # no stubs shipped

from pipeserve.bench.metrics import RequestResult
from pipeserve.bench.workloads import BenchRequest


class SSEParser:
    """Server-sent events -> `data` payloads, one per event (multi-line data joined by \\n)."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        if not line:  # a blank line ends an event
            return self.flush()
        if line.startswith(":"):  # comment / keep-alive
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value.removeprefix(" "))
        return None

    def flush(self) -> str | None:
        if not self._data:
            return None
        data, self._data = "\n".join(self._data), []
        return data


def make_client(url: str, concurrency: int, timeout_s: float, api_key: str | None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    # trust_env=False: a proxy from the environment would be measured along with the server.
    return httpx.AsyncClient(
        base_url=url.rstrip("/"), headers=headers, limits=limits, timeout=timeout_s, trust_env=False
    )


async def fetch_model(client: httpx.AsyncClient) -> str:
    resp = await client.get("/v1/models")
    resp.raise_for_status()
    models = resp.json().get("data") or []
    if not models:
        raise ValueError("GET /v1/models listed no models; pass --model")
    return str(models[0]["id"])


def completion_body(model: str, req: BenchRequest) -> dict:
    return {
        "model": model,
        "prompt": req.prompt if req.text is None else req.text,
        "max_tokens": req.output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _chunk_tokens(chunk: dict) -> int:
    """Tokens a chunk carries: its token_ids when the server sends them, else 1 if it has text."""
    choices = chunk.get("choices") or []
    if not choices:
        return 0
    choice = choices[0]
    if choice.get("token_ids"):
        return len(choice["token_ids"])
    return 1 if choice.get("text") else 0


async def _read_stream(resp: httpx.Response, result: RequestResult, start: float) -> None:
    parser = SSEParser()
    last = start
    counted = 0
    usage_tokens: int | None = None
    done = False

    def handle(data: str) -> bool:
        nonlocal last, counted, usage_tokens
        if data.strip() == "[DONE]":
            return True
        chunk = json.loads(data)
        if "error" in chunk:  # an OpenAI-shaped error event: the request failed mid-stream
            err = chunk["error"]
            raise RuntimeError(f"stream error: {err.get('message', err) if isinstance(err, dict) else err}")
        if usage := chunk.get("usage"):
            usage_tokens = usage.get("completion_tokens", usage_tokens)
            result.prompt_len = usage.get("prompt_tokens") or result.prompt_len
            details = usage.get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:
                result.cached_tokens = int(details["cached_tokens"])
        # llama.cpp's server reports per response how many prompt tokens its slot reused.
        if isinstance(timings := chunk.get("timings"), dict) and timings.get("cache_n") is not None:
            result.cache_n = max(result.cache_n or 0, int(timings["cache_n"]))
        for choice in chunk.get("choices") or []:
            result.token_ids += choice.get("token_ids") or []
        if n := _chunk_tokens(chunk):
            now = time.perf_counter()
            if counted == 0:
                result.ttft = now - start
            else:
                result.itl.append(now - last)
            last = now
            counted += n
        return False

    async for line in resp.aiter_lines():
        # After [DONE] keep reading to the end of the body, so the connection goes back to
        # the pool instead of being closed (a reconnect would be charged to the next request).
        if not done and (data := parser.feed(line)) is not None:
            done = handle(data)
    if not done and (data := parser.flush()) is not None:
        done = handle(data)
    if not done:
        raise RuntimeError("stream ended without [DONE]")
    if counted == 0:
        raise RuntimeError("stream carried no tokens")
    result.output_len = usage_tokens if usage_tokens is not None else counted


async def send_request(
    client: httpx.AsyncClient, model: str, req: BenchRequest, timeout_s: float, extra: dict | None = None
) -> RequestResult:
    """One streamed completion; `extra` adds fields to the body (e.g. return_token_ids).

    A server may close an idle keep-alive connection just as the client reuses it; the request
    then fails with "Server disconnected without sending a response" although the server never
    saw it. Such a failure (no response started) is retried once on a fresh connection; the time
    lost stays charged to the request. A failure after the response started is never retried.
    """
    result = RequestResult(prompt_len=req.prompt_len)
    start = result.start = time.perf_counter()
    body = completion_body(model, req) | (extra or {})
    try:
        # asyncio.timeout bounds the whole request; httpx's timeout only bounds each read.
        async with asyncio.timeout(timeout_s):
            for attempt in range(2):
                started = False
                try:
                    async with client.stream("POST", "/v1/completions", json=body) as resp:
                        started = True
                        if resp.status_code != 200:
                            text = (await resp.aread()).decode(errors="replace")[:200]
                            raise RuntimeError(f"HTTP {resp.status_code}: {text}")
                        await _read_stream(resp, result, start)
                    break
                except httpx.RemoteProtocolError:
                    if started or attempt:
                        raise
                    result.retried = True
        result.latency = time.perf_counter() - start
        result.success = True
    except Exception as e:  # noqa: BLE001 - any failure is this request's result, not the run's end
        result.error = str(e) or type(e).__name__
    return result


async def run_requests(
    client: httpx.AsyncClient,
    model: str,
    requests: Sequence[BenchRequest],
    arrivals: Sequence[float],
    concurrency: int,
    timeout_s: float,
    progress: bool = False,
) -> tuple[list[RequestResult], float]:
    """Sends every request at its arrival offset, at most `concurrency` at once; `progress`: a tqdm
    bar of completed requests on stderr (failures counted in its postfix).

    Returns the results in request order and the duration (first send to last finish).
    """
    if concurrency < 1:
        raise ValueError(f"--concurrency must be >= 1, got {concurrency}")
    sem = asyncio.Semaphore(concurrency)
    failed = 0

    with tqdm(total=len(requests), desc="requests", unit="req", file=sys.stderr, disable=not progress) as bar:

        async def one(req: BenchRequest) -> RequestResult:
            nonlocal failed
            async with sem:
                result = await send_request(client, model, req, timeout_s)
            bar.update(1)
            if not result.success:
                failed += 1
                bar.set_postfix(failed=failed, refresh=False)
            return result

        tasks: list[asyncio.Task[RequestResult]] = []
        start = time.perf_counter()
        for req, offset in zip(requests, arrivals, strict=True):
            if (wait := start + offset - time.perf_counter()) > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(one(req)))
        results = list(await asyncio.gather(*tasks))
    return results, time.perf_counter() - start
