"""L3 pages in a real redis-server and a real 3-master Redis Cluster on loopback: the page codec
refuses what it must not use (format, layout, checksum), presence is all-or-nothing across stages
and stops at the first missing block, a different fingerprint or split never reads a page, and
every stage's page of one block shares a cluster slot."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import redis
import torch
from redis.cluster import key_slot

from pipeserve.hicache.page import HEADER_BYTES, PageError, PageLayout, decode_page, encode_page
from pipeserve.hicache.redis_tier import RedisTier, TierUnavailable
from pipeserve.local.ports import PortBook
from pipeserve.local.redis_server import LocalRedis, cluster_create


def layouts(fingerprint: str = "fp0", split: tuple[int, ...] = (0, 2, 4, 6)) -> list[PageLayout]:
    """One PageLayout per stage of a 6-layer model split at `split` (three stages by default)."""
    return [
        PageLayout(fingerprint, stage, lo, hi, block_size=4, kv_heads=2, head_dim=8, dtype=torch.float32)
        for stage, (lo, hi) in enumerate(itertools.pairwise(split))
    ]


def page_of(layout: PageLayout, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layout.shape, generator=g, dtype=layout.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_page_round_trips_bit_exact(dtype: torch.dtype) -> None:
    layout = PageLayout("fp", 1, 2, 5, block_size=16, kv_heads=4, head_dim=64, dtype=dtype)
    page = page_of(PageLayout("fp", 1, 2, 5, 16, 4, 64, torch.float32), 1).to(dtype)
    value = encode_page(layout, page, tokens=16)
    assert len(value) == HEADER_BYTES + layout.payload_bytes
    back, tokens = decode_page(layout, value)
    assert tokens == 16 and back.dtype == dtype and torch.equal(back, page)


def test_the_decoder_refuses_what_it_must_not_use() -> None:
    layout = layouts()[0]
    value = encode_page(layout, page_of(layout, 2), tokens=4)
    flipped = bytearray(value)
    flipped[HEADER_BYTES + 7] ^= 0x01  # one bit of the K/V bytes
    cases = {
        "checksum": bytes(flipped),
        "format": b"XXXX" + value[4:],
        "layout": value,  # read with another split's layout (stage 0 holds 3 layers there)
    }
    for kind, data in cases.items():
        reader = layouts(split=(0, 3, 6))[0] if kind == "layout" else layout
        with pytest.raises(PageError) as e:
            decode_page(reader, data)
        assert e.value.kind == kind
    with pytest.raises(PageError, match="format"):
        decode_page(layout, value[:-1])  # truncated


@pytest.fixture(scope="module")
def server() -> Iterator[LocalRedis]:
    with LocalRedis() as r:
        yield r


@pytest.fixture
def tier(server: LocalRedis) -> Iterator[RedisTier]:
    t = RedisTier(server.url)
    t.client.flushall()
    yield t
    t.close()


def store_chain(
    tier: RedisTier, lays: list[PageLayout], hashes: list[int]
) -> dict[tuple[int, int], torch.Tensor]:
    pages = {}
    for h in hashes:
        for lay in lays:
            pages[lay.stage, h] = page_of(lay, h * 10 + lay.stage)
            tier.store(lay, h, pages[lay.stage, h], tokens=lay.block_size)
    return pages


def test_store_present_load_in_a_real_redis(tier: RedisTier) -> None:
    lays = layouts()
    hashes = [11, 22, 33, 44]
    pages = store_chain(tier, lays, hashes)
    assert tier.present(lays, hashes) == 4
    for lay in lays:
        got = tier.load(lay, hashes)
        assert got.ok and got.tokens == [4] * 4
        assert all(torch.equal(p, pages[lay.stage, h]) for p, h in zip(got.pages, hashes, strict=True))


def test_presence_is_all_or_nothing_across_stages_and_stops_at_a_gap(tier: RedisTier) -> None:
    lays = layouts()
    hashes = [1, 2, 3, 4]
    store_chain(tier, lays, hashes)
    tier.client.delete(lays[1].key(3))  # stage 1's page of the third block
    assert tier.present(lays, hashes) == 2  # block 3 is not whole: neither it nor block 4 counts
    assert tier.present(lays[:1], hashes) == 4  # stage 0 alone would have said 4
    got = tier.load(lays[1], hashes)
    assert got.errors == {2: "missing"} and got.pages[2] is None
    tier.client.setrange(lays[0].key(2), HEADER_BYTES + 1, b"\xff")  # corrupt stage 0's 2nd page
    assert tier.load(lays[0], hashes).errors == {1: "checksum"}
    # Several chains in one round trip (stage 0's probes queued together): each answered alone.
    assert tier.present_many(lays, [hashes, [], [9], hashes[:2], [1, 3]]) == [2, 0, 0, 2, 1]


def test_another_model_or_split_never_reads_a_page(tier: RedisTier) -> None:
    store_chain(tier, layouts(), [5, 6])
    assert tier.present(layouts(fingerprint="fp1"), [5, 6]) == 0
    assert tier.present(layouts(split=(0, 3, 6)), [5, 6]) == 0
    assert tier.load(layouts(split=(0, 3, 6))[1], [5]).errors == {0: "missing"}


def test_ttl_and_a_redis_that_is_gone() -> None:
    with LocalRedis() as server:
        tier = RedisTier(server.url, timeout_s=0.3, ttl_s=60)
        lay = layouts()[0]
        tier.store(lay, 9, page_of(lay, 9), tokens=3)
        assert 0 < tier.client.ttl(lay.key(9)) <= 60
        assert tier.load(lay, [9]).tokens == [3]
    with pytest.raises(TierUnavailable):  # stopped: every call fails within its deadline
        tier.present([lay], [9])
    with pytest.raises(TierUnavailable):
        tier.store(lay, 9, page_of(lay, 9), tokens=3)
    tier.close()


def test_a_redis_cluster_of_three_masters() -> None:
    ports = PortBook()  # six ports (three servers, three cluster buses), all different
    nodes = [LocalRedis(cluster=True, ports=ports) for _ in range(3)]
    late = RedisTier(nodes[2].url, timeout_s=0.2)  # made while the cluster is down
    try:
        with pytest.raises(TierUnavailable):
            late.present(layouts(), [1])
        for n in nodes:
            n.start()
        cluster_create(nodes)
        tier = RedisTier(nodes[1].url)  # any node: the cluster is found from it
        assert type(tier.client).__name__ == "RedisCluster"
        assert late.present(layouts(), [1]) == 0  # recognised once it answers
        assert type(late.client).__name__ == "RedisCluster"
        late.close()
        lays = layouts()
        hashes = list(range(100, 140))  # spread over every master
        assert len({key_slot(lays[0].key(h).encode()) for h in hashes}) > 1
        for h in hashes:  # every stage's page of a block in one slot: one node answers for the block
            assert len({key_slot(lay.key(h).encode()) for lay in lays}) == 1
        pages = store_chain(tier, lays, hashes)
        owners = set()
        for n in nodes:
            with redis.Redis(port=n.port) as c:
                owners |= {n.port} if c.dbsize() > 0 else set()
        assert len(owners) == 3, owners
        assert tier.present(lays, hashes) == len(hashes)
        got = tier.load(lays[1], hashes)
        assert got.ok and all(torch.equal(p, pages[1, h]) for p, h in zip(got.pages, hashes, strict=True))
        tier.client.delete(lays[0].key(120))
        assert tier.present(lays, hashes) == 20
        tier.close()
    finally:
        for n in nodes:
            n.stop()
