"""Hosts as Linux network namespaces: one namespace per "host" (a stage, the router, Redis), each
with its own address on a bridge in the root namespace, like pods on separate nodes.

    back network   10.77.<run>.0/24  bridge psb<run>; host k is 10.77.<run>.<k+1> on its `eth0`;
                                      the root namespace is .254 (the test process)
    front network  10.78.<run>.0/30  a point-to-point veth root (.1) <-> one host (.2) on its `front0`,
                                      for the router: cutting its back link leaves the client's path

`run` is claimed by creating the bridge psb<run> (an atomic `ip link add`), so parallel runs never
share names or subnets. Every process is started with `ip netns exec` (which execs: the Popen's pid is
the process itself) and reaped at `close()`, which asserts nothing is left: no namespace, no link, no
process. Each host's /etc/hosts (/etc/netns/NS/hosts) names every host `<name>.pipeserve`, like a
cluster's DNS, and maps the machine's hostname to 127.0.1.1 as Debian does: a process that binds to
what the hostname resolves to is not reachable from another host (the product binds to --host).

Faults: `link(host, up=False)` (partition from everyone), `cut(src, dst)` (src's packets to dst
dropped: one way; both ways with two calls; htb + u32 filter into a class whose pfifo holds 0
packets, since this kernel has neither netem nor tc actions), `slow(host, kbit)` (tbf both ways),
`freeze(host)` / `thaw(host)` (SIGSTOP/SIGCONT every process in the namespace), `readdress(host)`
(the host comes back with a new address; every hosts file follows, as DNS would).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

ETC_NETNS = Path("/etc/netns")


def unavailable_reason() -> str | None:
    """Why this machine cannot build namespaces (None when it can)."""
    if os.geteuid() != 0:
        return "needs root (ip netns, veth, bridges)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (`ip`, `tc`)"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns` does not work here: {probe.stderr.strip()[:200]}"
    return None


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {r.returncode}: {r.stderr.strip()}")
    return r


class Hosts:
    """N namespaces on one bridge (see the module docstring); `front` names the host that also gets a
    link of its own to the root namespace."""

    def __init__(self, names: Sequence[str], front: str | None = None) -> None:
        self.run = self._claim_bridge()
        self.bridge = f"psb{self.run}"
        self.addr: dict[str, str] = {}
        self.ns: dict[str, str] = {}
        self.veth: dict[str, str] = {}  # host -> its veth's root-side name
        self.procs: list[subprocess.Popen] = []
        self.spawned: dict[str, list[subprocess.Popen]] = {}  # host -> what spawn() started there
        self.cuts: dict[str, set[str]] = {}  # host -> the hosts its packets to are dropped
        self.front_addr: str | None = None
        try:
            sh("ip", "addr", "add", f"10.77.{self.run}.254/24", "dev", self.bridge)
            sh("ip", "link", "set", self.bridge, "up")
            for k, name in enumerate(names):
                self._add_host(k, name)
            self._write_hosts_files()
            if front is not None:
                self._add_front(front)
        except BaseException:
            self.close(check=False)
            raise

    @staticmethod
    def _claim_bridge() -> int:
        for run in random.sample(range(1, 250), 249):
            if sh("ip", "link", "add", f"psb{run}", "type", "bridge", check=False).returncode == 0:
                return run
        raise RuntimeError("no free run id: 249 bridges psb* exist")

    def _add_host(self, k: int, name: str) -> None:
        ns, veth, addr = f"psf{self.run}-{name}", f"pv{self.run}n{k}", f"10.77.{self.run}.{k + 1}"
        sh("ip", "netns", "add", ns)
        self.ns[name] = ns
        (ETC_NETNS / ns).mkdir(parents=True, exist_ok=True)  # its hosts file: _write_hosts_files
        sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        self.veth[name] = veth
        sh("ip", "link", "set", veth, "master", self.bridge, "up")
        self.exec_ok(name, "ip", "addr", "add", f"{addr}/24", "dev", "eth0")
        self.exec_ok(name, "ip", "link", "set", "eth0", "up")
        self.exec_ok(name, "ip", "link", "set", "lo", "up")
        self.addr[name] = addr

    def _write_hosts_files(self) -> None:
        """`ip netns exec` bind-mounts /etc/netns/NS/hosts over /etc/hosts. Written in place (same
        inode), so a rewrite reaches processes already running, as a DNS update would."""
        names = "".join(f"{a} {h}.pipeserve\n" for h, a in self.addr.items())
        for ns in self.ns.values():
            with open(ETC_NETNS / ns / "hosts", "w") as f:
                f.write(f"127.0.0.1 localhost\n127.0.1.1 {socket.gethostname()}\n{names}")

    def _add_front(self, name: str) -> None:
        veth = f"pf{self.run}"
        sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "front0", "netns", self.ns[name])
        sh("ip", "addr", "add", f"10.78.{self.run}.1/30", "dev", veth)
        sh("ip", "link", "set", veth, "up")
        self.exec_ok(name, "ip", "addr", "add", f"10.78.{self.run}.2/30", "dev", "front0")
        self.exec_ok(name, "ip", "link", "set", "front0", "up")
        self.front_addr = f"10.78.{self.run}.2"

    def exec_ok(self, host: str, *argv: str) -> None:
        sh("ip", "netns", "exec", self.ns[host], *argv)

    def spawn(
        self, host: str, argv: Sequence[str], log: Path, env: dict[str, str] | None = None
    ) -> subprocess.Popen:
        """`argv` inside `host`'s namespace, output to `log`. (GLOO_SOCKET_IFNAME would not help: the
        stage asks gloo for its default device, which follows the hostname; see `_add_host`.)"""
        full_env = {**os.environ, **(env or {})}
        with open(log, "ab") as out:
            p = subprocess.Popen(
                ["ip", "netns", "exec", self.ns[host], *argv],
                env=full_env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.procs.append(p)
        self.spawned.setdefault(host, []).append(p)
        return p

    def exited(self, host: str) -> bool:
        """Every process spawn() started on `host` has exited. (Not `pids`: right after spawn, the
        `ip netns exec` child may not have entered the namespace yet.)"""
        return all(p.poll() is not None for p in self.spawned.get(host, []))

    def pids(self, host: str) -> list[int]:
        out = sh("ip", "netns", "pids", self.ns[host], check=False).stdout
        return [int(p) for p in out.split()]

    # -- faults ---------------------------------------------------------------------------------
    def link(self, host: str, up: bool) -> None:
        """Cut (or heal) `host`'s back link: both directions, everything but the front link."""
        sh("ip", "link", "set", self.veth[host], "up" if up else "down")

    def cut(self, src: str, dst: str, cut: bool = True) -> None:
        """Drop (cut=False: deliver again) every IP packet `src` sends to `dst`: one way. On src's
        eth0: htb whose default class passes all, a class whose pfifo holds 0 packets, and a u32
        filter per cut destination into it."""
        dev, cuts = ("ip", "netns", "exec", self.ns[src], "tc"), self.cuts.setdefault(src, set())
        if not cuts and cut:
            sh(*dev, "qdisc", "replace", "dev", "eth0", "root", "handle", "1:", "htb", "default", "1")
            for cls, rate in (("1:1", "100gbit"), ("1:2", "8bit")):
                sh(*dev, "class", "add", "dev", "eth0", "parent", "1:", "classid", cls, "htb", "rate", rate)
            sh(*dev, "qdisc", "add", "dev", "eth0", "parent", "1:2", "pfifo", "limit", "0")
        (cuts.add if cut else cuts.discard)(dst)
        sh(*dev, "filter", "del", "dev", "eth0", "parent", "1:", check=False)
        for d in sorted(cuts):
            sh(*dev, "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio", "1", "u32",
               "match", "ip", "dst", f"{self.addr[d]}/32", "flowid", "1:2")  # fmt: skip
        if not cuts:
            sh(*dev, "qdisc", "del", "dev", "eth0", "root", check=False)

    def readdress(self, host: str) -> str:
        """`host` comes back with a new address (its processes should be gone: a new node); every
        host's hosts file names it there. Returns the new address."""
        assert not self.cuts.get(host), "heal the cuts before readdressing"
        old = self.addr[host]
        new = f"10.77.{self.run}.{int(old.rsplit('.', 1)[1]) + 100}"
        self.exec_ok(host, "ip", "addr", "flush", "dev", "eth0")
        self.exec_ok(host, "ip", "addr", "add", f"{new}/24", "dev", "eth0")
        self.addr[host] = new
        self._write_hosts_files()
        return new

    def slow(self, host: str, kbit: int | None) -> None:
        """Rate-limit `host`'s back link both ways with tbf (queueing delay up to ~200 ms of data);
        None removes it."""
        assert not self.cuts.get(host), "a cut and a rate on one link: heal the cuts first"
        sides = [("ip", "netns", "exec", self.ns[host], "tc"), ("tc",)]
        devs = ["eth0", self.veth[host]]
        for prefix, dev in zip(sides, devs, strict=True):
            if kbit is None:
                sh(*prefix, "qdisc", "del", "dev", dev, "root", check=False)
            else:
                burst = max(1600, kbit * 1000 // 8 // 100)  # 10 ms of data, at least one frame
                limit = max(burst * 2, kbit * 1000 // 8 // 5)  # ~200 ms queued before drops
                sh(*prefix, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{kbit}kbit",
                   "burst", str(burst), "limit", str(limit))  # fmt: skip

    def heal_all(self) -> None:
        """Every fault undone: links up, cuts and rates removed, every process running."""
        for host in self.ns:
            self.link(host, up=True)
            for dst in list(self.cuts.get(host, ())):
                self.cut(host, dst, cut=False)
            self.slow(host, None)
            self.thaw(host)

    def freeze(self, host: str, sig: int = signal.SIGSTOP) -> list[int]:
        pids = self.pids(host)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:  # exited meanwhile
                pass
        return pids

    def thaw(self, host: str) -> list[int]:
        return self.freeze(host, signal.SIGCONT)

    def kill_host(self, host: str) -> None:
        """SIGKILL every process in `host`'s namespace and reap the ones this object started."""
        for pid in self.pids(host):
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            for p in self.procs:
                p.poll()  # reap: a killed child stays a zombie in the namespace until waited for
            if not self.pids(host):
                break
            time.sleep(0.05)

    # -- teardown -------------------------------------------------------------------------------
    def leftovers(self) -> list[str]:
        """What this run still holds: namespaces, links, live processes."""
        left = [ns for ns in sh("ip", "netns", "list").stdout.split() if ns.startswith(f"psf{self.run}-")]
        links = sh("ip", "-o", "link", "show").stdout
        for line in links.splitlines():
            name = line.split(":")[1].strip().split("@")[0]
            if name in (self.bridge, f"pf{self.run}") or name.startswith(f"pv{self.run}n"):
                left.append(name)
        left += [f"pid {p.pid}" for p in self.procs if p.poll() is None]
        left += [str(ETC_NETNS / ns) for ns in self.ns.values() if (ETC_NETNS / ns).exists()]
        return left

    def close(self, check: bool = True) -> None:
        for host in list(self.ns):
            self.kill_host(host)
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        # a veth pair goes with either end, at once; a namespace's own teardown (which would take its
        # veths too) is asynchronous and slow while sockets on a cut link still hold data
        for veth in [*self.veth.values(), f"pf{self.run}"]:
            sh("ip", "link", "del", veth, check=False)
        for ns in self.ns.values():
            sh("ip", "netns", "del", ns, check=False)
            shutil.rmtree(ETC_NETNS / ns, ignore_errors=True)
        sh("ip", "link", "del", self.bridge, check=False)
        if check:
            deadline = time.monotonic() + 5  # a deleted namespace's veths go when the kernel frees it
            while (left := self.leftovers()) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not left, f"left behind after teardown: {left}"
