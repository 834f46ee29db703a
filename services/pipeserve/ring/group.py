"""Forming a pipeline group: rendezvous, process groups, and the congruence check.

Rendezvous is either TCP (MASTER_ADDR:MASTER_PORT, stage 0 hosts the store —
what a Kubernetes group uses) or a file (the local launcher: no listening
store, and gloo bound to 127.0.0.1). Over TCP, gloo binds to (and announces to
its peers) the stage's own address, `--host`, when that names one; on a
wildcard (0.0.0.0: a pod's) or a loopback (the default 127.0.0.1) it takes what
the hostname resolves to: the pod's address in Kubernetes, but loopback
(127.0.1.1) on many machines. Every stage loads its weights and sizes its KV
pool before joining, so the congruence exchange compares what each stage
actually holds:

  model fingerprint, layer split, block size, max_model_len, dtype  must be equal
  KV blocks                                                         group minimum

A difference stops the group at start-up with a line naming both values; all
stages see all identities, so all of them stop with the same line.
"""

from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol, cast

import msgspec
import torch
import torch.distributed as dist

from pipeserve.errors import ConfigError, GroupStopped

log = logging.getLogger(__name__)

IDENTITY_BYTES = 2048


@dataclass(frozen=True)
class Rendezvous:
    rank: int
    world_size: int
    master_addr: str | None = None
    master_port: int | None = None
    file: str | None = None  # a FileStore path instead of TCP
    host: str | None = None  # the stage's --host: gloo's address over TCP if it names one (module doc)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank: must be in [0, {self.world_size}) (got {self.rank})")
        tcp = self.master_addr is not None and self.master_port is not None
        alone = self.world_size == 1 and not tcp and self.file is None  # nothing to join
        if tcp == (self.file is not None) and not alone:
            raise ConfigError("rendezvous: give either master_addr and master_port, or a rendezvous file")


class CommGroup(Protocol):
    """A c10d backend used as the group itself (ProcessGroupGloo, ProcessGroupNCCL): the calls the
    ring makes on it. torch's stubs type these backends without their collectives."""

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> dist.Work: ...
    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> dist.Work: ...
    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor]) -> dist.Work: ...


def _own_address(host: str | None) -> str | None:
    """`host` when it is this machine's address on a network, else None (the hostname's)."""
    if not host:
        return None
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host  # a name: gloo resolves it
    return None if ip.is_unspecified or ip.is_loopback else host


def join(rdzv: Rendezvous, timeout_s: float) -> tuple[CommGroup, dist.Store]:
    """Connect to every other stage; returns the gloo group and the store."""
    timeout = timedelta(seconds=timeout_s)
    if rdzv.file is not None:
        store: dist.Store = dist.FileStore(rdzv.file, rdzv.world_size)
        store.set_timeout(timeout)
        gloo_host: str | None = "127.0.0.1"
    else:
        if rdzv.master_addr is None or rdzv.master_port is None:  # Rendezvous refuses this; for the reader
            raise ConfigError("rendezvous: master_addr and master_port are needed without a file")
        store = dist.TCPStore(
            rdzv.master_addr,
            rdzv.master_port,
            rdzv.world_size,
            rdzv.rank == 0,
            timeout=timeout,
            wait_for_workers=False,
        )
        gloo_host = _own_address(rdzv.host)
    store.set(f"joined/{rdzv.rank}", "1")
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # not in torch's stubs
    opts._timeout = timeout
    opts._devices = [
        dist.ProcessGroupGloo.create_device(hostname=gloo_host)
        if gloo_host
        else dist.ProcessGroupGloo.create_default_device()
    ]
    try:
        meta = dist.ProcessGroupGloo(dist.PrefixStore("meta", store), rdzv.rank, rdzv.world_size, opts)
    except RuntimeError as e:
        missing = [r for r in range(rdzv.world_size) if not store.check([f"joined/{r}"])]
        raise GroupStopped(
            f"stage {rdzv.rank}: group did not form within {timeout_s:g}s "
            f"(stages not joined: {missing or 'none'}): {str(e).splitlines()[0][:200]}"
        ) from None
    return cast(CommGroup, meta), store


def data_backend(gpus: list[str]) -> str:
    """'nccl' when every stage has a GPU of its own, else 'gloo' (activations via host memory).

    gpus: each stage's GPU UUID ('' on CPU). NCCL cannot pair two ranks on one
    GPU, which is what stages sharing a machine's only GPU would be; a CPU stage has no NCCL at all.
    """
    return "nccl" if gpus and all(gpus) and len(set(gpus)) == len(gpus) else "gloo"


def activation_group(
    rdzv: Rendezvous, store: dist.Store, meta: CommGroup, gpus: list[str], timeout_s: float
) -> CommGroup:
    """The NCCL group when `data_backend(gpus)` says so, else the gloo group itself."""
    if data_backend(gpus) == "gloo":
        return meta
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timedelta(seconds=timeout_s)
    nccl = dist.ProcessGroupNCCL(dist.PrefixStore("data", store), rdzv.rank, rdzv.world_size, opts)
    return cast(CommGroup, nccl)


class StageIdentity(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    rank: int
    fingerprint: str
    layer_split: str
    block_size: int
    max_model_len: int
    dtype: str
    kv_dtype: str  # the KV pool's (kv_cache_dtype resolved)
    kv_blocks: int
    gpu: str  # UUID of the stage's GPU; '' on CPU
    host_slots: int  # L2 slots this stage can hold (the group takes the minimum)
    l3: bool  # whether this stage has an L3 URL (HiCache): every stage or none


_MUST_MATCH = (
    ("fingerprint", "model fingerprint"),
    ("layer_split", "layer split"),
    ("block_size", "block size"),
    ("max_model_len", "max_model_len"),
    ("dtype", "dtype"),
    ("kv_dtype", "KV cache dtype"),
    ("l3", "L3 (hicache_url) on or off"),
)


def agree(pg: CommGroup, mine: StageIdentity, world_size: int, timeout_s: float) -> list[StageIdentity]:
    """Exchange identities with every stage; returns them in rank order (see module doc)."""
    data = msgspec.json.encode(mine)
    if len(data) > IDENTITY_BYTES:
        raise ConfigError(f"stage identity too long ({len(data)} bytes)")
    buf = torch.zeros(IDENTITY_BYTES, dtype=torch.uint8)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = [torch.empty_like(buf) for _ in range(world_size)]
    try:
        pg.allgather([out], [buf]).wait(timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise GroupStopped(
            f"stage {mine.rank}: congruence exchange failed: {str(e).splitlines()[0][:200]}"
        ) from None
    ids = [msgspec.json.decode(t.numpy().tobytes().rstrip(b"\0"), type=StageIdentity) for t in out]
    for field, label in _MUST_MATCH:
        for other in ids:
            if getattr(other, field) != getattr(ids[0], field):
                raise GroupStopped(
                    f"congruence: {label} differs: stage {ids[0].rank} has {getattr(ids[0], field)!r}, "
                    f"stage {other.rank} has {getattr(other, field)!r}"
                )
    if mine.rank == 0:
        log.info(
            "group agreed: %d stages, split %s, %d KV blocks (proposed %s)",
            world_size,
            mine.layer_split,
            group_blocks(ids),
            [i.kv_blocks for i in ids],
        )
    return ids


def group_host_slots(ids: list[StageIdentity]) -> int:
    """L2 has the same slot count on every stage: stage 0 picks slots for all of them."""
    return min(i.host_slots for i in ids)


def group_blocks(ids: list[StageIdentity]) -> int:
    """Every stage's pool has the group minimum of the proposed block counts."""
    return min(i.kv_blocks for i in ids)
