"""The bench client's one retry: only for a connection closed before any response started.

A raw asyncio HTTP/1.1 server on a free 127.0.0.1 port plays the failure exactly: it reads a
request, then either closes the socket without a byte of response (what a server closing an idle
keep-alive connection looks like to the client), or sends a status line and headers and then
closes (the response started: must not be retried), or answers a small SSE stream.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from pipeserve.bench import client
from pipeserve.bench.workloads import BenchRequest

pytestmark = pytest.mark.asyncio

EVENTS = [
    {"choices": [{"index": 0, "text": "a", "token_ids": [5]}]},
    {"choices": [{"index": 0, "text": "b", "token_ids": [6]}]},
    {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}},
]


def sse_body() -> bytes:
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in EVENTS) + b"data: [DONE]\n\n"


class Server:
    """Answers requests in order with the behaviours in `plan` ("drop", "headers", "ok")."""

    def __init__(self, plan: list[str]) -> None:
        self.plan = list(plan)
        self.requests = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                await reader.readexactly(length)
                self.requests += 1
                action = self.plan.pop(0) if self.plan else "ok"
                if action == "drop":
                    return  # closes without a response
                body = sse_body()
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    + f"content-length: {len(body)}\r\n\r\n".encode()
                )
                if action == "headers":
                    await writer.drain()
                    return  # the response started, then the connection went
                writer.write(body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()
        await asyncio.wait_for(self.server.wait_closed(), 5)


async def send(url: str):
    async with client.make_client(url, concurrency=1, timeout_s=10, api_key=None) as http:
        return await client.send_request(http, "m", BenchRequest(prompt=[1, 2, 3], output_len=2), 10)


async def test_a_connection_closed_before_the_response_is_retried_once() -> None:
    srv = Server(["drop"])
    async with srv as url:
        result = await send(url)
    assert result.success, result.error
    assert result.retried and srv.requests == 2
    assert result.token_ids == [5, 6] and result.output_len == 2


async def test_a_second_close_fails_the_request() -> None:
    srv = Server(["drop", "drop"])
    async with srv as url:
        result = await send(url)
    assert not result.success and "disconnected" in result.error.lower()
    assert srv.requests == 2  # one retry, no more


async def test_a_response_that_started_is_not_retried() -> None:
    srv = Server(["headers"])
    async with srv as url:
        result = await send(url)
    assert not result.success and not result.retried
    assert srv.requests == 1


async def test_a_healthy_server_is_sent_each_request_once() -> None:
    srv = Server([])
    async with srv as url:
        result = await send(url)
    assert result.success and not result.retried and srv.requests == 1
