"""The ports `pipeserve up` hands its processes: each different, each outside the ephemeral range.

Under make test-stress, two groups of one `up` were handed one gRPC port (bind(0) returned a port it
had returned a moment before), and the second group's stage 0 failed to bind on every restart.
"""

from __future__ import annotations

import shutil
import socket

import pytest

from pipeserve.config import EngineConfig, StageServeConfig
from pipeserve.local.ports import EPHEMERAL_RANGE, LOWEST, PortBook, below_ephemeral
from pipeserve.local.redis_server import LocalRedis
from pipeserve.supervisor.group import GroupSlot


def test_a_book_never_hands_out_a_port_twice() -> None:
    book = PortBook(range(LOWEST + 3000, LOWEST + 3064))
    got = [book.take() for _ in range(48)]  # 48 of 64: drawn at random, repeats are certain
    assert len(set(got)) == len(got), sorted(got)
    assert book.taken == set(got)


def test_a_full_book_says_so() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        book = PortBook(range(port, port + 1))  # its one port is bound by someone else
        with pytest.raises(OSError, match=f"no free port on 127.0.0.1 in {port}-{port}"):
            book.take()


def test_ports_come_from_below_the_ephemeral_range() -> None:
    low, high = (int(x) for x in EPHEMERAL_RANGE.read_text().split())
    span = below_ephemeral()
    assert span.start >= 1024 and span.stop <= low
    book = PortBook()
    got = [book.take() for _ in range(200)]
    assert not [p for p in got if low <= p <= high], "ports from the ephemeral range"
    assert all(p in span for p in got)


def test_an_ephemeral_range_that_leaves_no_room_falls_back_to_the_unprivileged_ports(tmp_path) -> None:
    odd = tmp_path / "ip_local_port_range"
    odd.write_text("1024\t65535\n")
    assert below_ephemeral(odd) == range(1024, 65536)
    assert below_ephemeral(tmp_path / "missing") == range(1024, 65536)
    odd.write_text("40000\t60999\n")
    assert below_ephemeral(odd) == range(LOWEST, 40000)


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server (make redis-server)")
def test_the_groups_and_redis_of_one_book_share_no_port(llama_dir) -> None:
    """Three groups of two stages and a Redis cluster node: 3 x (gRPC + 2 side ports) + 2 Redis
    ports, all from one small book, all different."""
    book = PortBook(range(LOWEST + 4000, LOWEST + 4016))
    config = EngineConfig(model=str(llama_dir), stages=2, num_kv_blocks=16)
    slots = [GroupSlot(f"g{i}", config, StageServeConfig(), ports=book) for i in range(3)]
    redis = LocalRedis(cluster=True, ports=book)  # never started: its ports are chosen when made
    used = [p for s in slots for p in (s.grpc_port, *s.health_ports)]
    used += [redis.port, int(redis.argv[redis.argv.index("--cluster-port") + 1])]
    redis.stop()
    assert len(used) == 11 and len(set(used)) == 11, sorted(used)
    assert set(used) <= set(book.span)
