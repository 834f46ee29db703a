"""A small OpenAI-shaped server with llama-server's slot prompt cache, for the side-by-side's tests.

It keeps the last `slots` prompts it served (one per slot, least recently used replaced), and each
new prompt reuses its longest common prefix with any of them — counted in words for a text prompt,
in ids for an id prompt, at most all but one (llama-server evaluates at least one prompt token). The
final chunk of a streamed /v1/completions reports what was reused the way llama-server does:
`usage.prompt_tokens_details.cached_tokens` and `timings.cache_n` (`report=False`: neither, a server
that says nothing). Its first token comes after `ttft` s, then `itl` s apart; every `fail_every`-th
request answers HTTP 500. Run it under `test_bench.Served`.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route


def _units(prompt: str | list[int]) -> list:
    return prompt.split() if isinstance(prompt, str) else list(prompt)


def _common(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def slot_app(slots: int = 16, ttft: float = 0.0, itl: float = 0.0, report: bool = True, fail_every: int = 0):
    """(app, state): state["prompts"] every prompt served, state["cache_n"] what each reused."""
    held: deque[list] = deque(maxlen=slots)
    state: dict = {"prompts": [], "cache_n": [], "count": 0}

    def event(obj: dict) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "slot-model", "object": "model"}]})

    async def completions(request: Request):
        body = await request.json()
        state["count"] += 1
        if fail_every and state["count"] % fail_every == 0:
            return JSONResponse({"error": {"message": "overloaded"}}, status_code=500)
        units = _units(body["prompt"])
        reused = min(max((_common(units, h) for h in held), default=0), len(units) - 1)
        held.append(units)
        state["prompts"].append(body["prompt"])
        state["cache_n"].append(reused)
        n_out = int(body.get("max_tokens", 16))
        if not body.get("stream"):
            return JSONResponse({"choices": [{"index": 0, "text": "t" * n_out, "finish_reason": "length"}]})

        async def gen():
            await asyncio.sleep(ttft)
            for i in range(n_out):
                if i:
                    await asyncio.sleep(itl)
                yield event({"object": "text_completion", "choices": [{"index": 0, "text": "t"}]})
            final: dict = {"object": "text_completion", "choices": []}
            final["usage"] = {"prompt_tokens": len(units), "completion_tokens": n_out}
            if report:
                final["usage"]["prompt_tokens_details"] = {"cached_tokens": reused}
                final["timings"] = {"cache_n": reused, "prompt_n": len(units) - reused}
            yield event(final)
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    routes = [Route("/v1/models", models), Route("/v1/completions", completions, methods=["POST"])]
    return Starlette(routes=routes), state
