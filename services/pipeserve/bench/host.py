"""What a side-by-side needs of the machine: a server's process tree, its memory over time, the CPU.

Contract:
  - `tree_pids(root)`: root and every live descendant, read from /proc/*/stat (no psutil: this
    module runs on the router's torch-free image too, and /proc is all it needs);
  - `RssSampler(root)`: a daemon thread that sums VmRSS over the tree every `interval_s` (~100 ms)
    and keeps the largest sum seen. That is the tree's *simultaneous* peak, within one interval —
    not the sum of each process's own VmHWM, which adds peaks reached at different times and so
    overstates a tree whose processes peak in turn (a converter that exits, then the stages);
  - `cpu_info()`: the CPU's model name and the flags a kernel's speed depends on, recorded beside
    every table so a figure is never read without the machine that made it; `git_commit()` the
    code's;
  - `ForeignCpu`: the share of the machine's CPUs that processes other than the measured server
    tree and this bench used over a pass (/proc/stat's busy time less the tree's and ours): a
    figure taken while something else ran is not the server's, and the report says so.
"""

from __future__ import annotations

import os
import platform
import subprocess
import threading
import time
from pathlib import Path

# The /proc/cpuinfo flags that decide which integer / float kernels a build can use.
CPU_FLAG_PREFIXES = ("avx2", "avx512", "amx", "avx_vnni", "fma", "f16c")


def tree_pids(root: int) -> list[int]:
    """`root` and all its live descendants (from /proc/*/stat's ppid); [] when root is gone."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:  # exited while we looked
            continue
        # The command name is in parentheses and may hold spaces: the fields follow the last ')'.
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    if not Path(f"/proc/{root}").is_dir():
        return []
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return sorted(out)


def status_bytes(pid: int, field: str) -> int:
    """A memory line of /proc/PID/status (VmHWM, VmRSS) in bytes; 0 for a gone or kernel process."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes(pid: int) -> int:
    """A process's resident memory (statm's second field: VmRSS, read more cheaply); 0 when gone."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return 0


def tree_rss(root: int) -> int:
    """The tree's resident memory now: VmRSS summed over root and its descendants."""
    return sum(rss_bytes(pid) for pid in tree_pids(root))


class RssSampler:
    """Samples `tree_rss(root)` every `interval_s` on a daemon thread; `peak` is the largest sum seen.

    Used as a context manager around what is measured; `mark()` starts a new window (`window_peak`)
    without stopping the thread, so one sampler spans a server's life and each pass reads its own peak.
    The tree is rescanned from /proc every `rescan` samples and its known pids read in between: a
    full scan of /proc costs milliseconds, which at 10 Hz would take a share of a 2-core machine
    from the server it measures; a process born since the last scan is seen within a second.
    """

    def __init__(self, root: int, interval_s: float = 0.1, rescan: int = 10) -> None:
        self.root, self.interval_s, self.rescan = root, interval_s, rescan
        self._pids: list[int] = []
        self.peak = 0
        self.window_peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"rss-{root}", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def sample(self) -> int:
        with self._lock:  # the thread and read_window() both sample: one at a time
            if self.samples % self.rescan == 0 or not self._pids:
                self._pids = tree_pids(self.root)
            rss = sum(rss_bytes(pid) for pid in self._pids)
            self.peak = max(self.peak, rss)
            self.window_peak = max(self.window_peak, rss)
            self.samples += 1
        return rss

    def mark(self) -> None:
        """Start a new window: `window_peak` from now on covers only what follows."""
        with self._lock:
            self.window_peak = 0

    def read_window(self) -> int:
        """The window's peak, with one sample taken now (a pass shorter than the interval still counts)."""
        self.sample()
        with self._lock:
            return self.window_peak

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


CLK_TCK = os.sysconf("SC_CLK_TCK")


def busy_ticks() -> int:
    """CPU time the whole machine spent busy (every CPU; /proc/stat, in clock ticks)."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in f.readline().split()[1:9])
    return user + nice + system + irq + softirq + steal


def proc_ticks(pid: int) -> int:
    """CPU time of a process and of its reaped children (utime+stime+cutime+cstime); 0 when gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    fields = stat[stat.rindex(")") + 2 :].split()
    return sum(int(v) for v in fields[11:15])


class ForeignCpu:
    """Over a window: the share of all CPUs used by anything but the `root` tree and this process.

    A child of the tree that exits inside the window takes its time with it unless its parent reaps
    it (then it is in the parent's cutime): short-lived helpers may count as foreign. None when the
    tree is unknown (a server given by URL only).
    """

    def __init__(self, root: int | None) -> None:
        self.root = root
        self.start = self._read()

    def _read(self) -> tuple[float, int, int, int]:
        tree = sum(proc_ticks(p) for p in tree_pids(self.root)) if self.root else 0
        return time.monotonic(), busy_ticks(), tree, proc_ticks(os.getpid())

    def share(self) -> float | None:
        if self.root is None:
            return None
        t1, busy1, tree1, mine1 = self._read()
        t0, busy0, tree0, mine0 = self.start
        foreign = (busy1 - busy0) - (tree1 - tree0) - (mine1 - mine0)
        cpus = os.cpu_count() or 1
        return max(0.0, foreign / max(1e-9, (t1 - t0) * CLK_TCK * cpus))


def cpu_info() -> dict:
    """{"model", "flags" (the kernel-relevant ones), "cpus" (this process may use), "machine"}."""
    model, flags = "", list[str]()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and not model:
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = sorted(f for f in value.split() if f.startswith(CPU_FLAG_PREFIXES) or "vnni" in f)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    model = model or platform.processor() or "unknown"
    return {"model": model, "flags": flags, "cpus": cpus, "machine": platform.machine()}


def git_commit() -> str:
    """The checkout's short commit ("unknown" outside a git checkout)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"
