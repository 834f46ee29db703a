"""A storm of streaming clients that reset their connections logs a bounded number of lines (slow).

The probe saw 135 lines of `WARNING asyncio: socket.send() raised exception.` when streaming
clients disconnected: asyncio logs one per write after a failed one, until the protocol hears of
the loss on the loop's next turn, and a stream's opening chunks (one per choice) are written in
one burst. Here 2 x 40 clients each ask for a streamed chat of n=64 choices, read one byte of the
answer and reset the connection (SO_LINGER 0): 195 such lines in a run before router/http/http_guard.py's
_WriteGuard, none now. The router then still serves.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from serving_support import UpProcess, running_up, wait_until

pytestmark = pytest.mark.slow

CLIENTS = 40
ROUNDS = 2
FLOOD = "socket.send() raised exception"


@pytest.fixture(scope="module")
def up(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    with running_up("--model", str(llama_dir), log_dir=tmp_path_factory.mktemp("storm")) as server:
        yield server


def _reset_after_first_byte(port: int, body: dict) -> None:
    raw = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(raw) + raw
        )
        s.recv(1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = reset


def test_a_disconnect_storm_logs_a_bounded_number_of_lines(up: UpProcess) -> None:
    body = {
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "n": 64,
        "max_tokens": 64,
        "ignore_eos": True,
        "stream": True,
    }
    before = up.log().count(FLOOD)
    for _ in range(ROUNDS):
        threads = [
            threading.Thread(target=_reset_after_first_byte, args=(up.port, body)) for _ in range(CLIENTS)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    time.sleep(2.0)  # what the router writes after the resets is in the log by now
    flood = up.log().count(FLOOD) - before
    print(f"{flood} lines of {FLOOD!r} for {CLIENTS * ROUNDS} resets")
    assert flood <= 5, f"{flood} lines of {FLOOD!r} for {CLIENTS * ROUNDS} resets"
    # Served again once the reset streams have let go of their admission slots and upstream calls.
    ok = {"prompt": "Hi", "max_tokens": 2}
    wait_until(
        lambda: httpx.post(up.url + "/v1/completions", json=ok, timeout=60).status_code == 200,
        60,
        "an ordinary request after the storm",
        interval_s=0.5,
    )
