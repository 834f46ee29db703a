"""Ports chosen now for local processes that bind them later (a stage's gRPC and side ports, Redis).

Between the choice and the child's bind, two things can take the port:
- the same process choosing again: the OS's bind(0) pick can return a port it returned a moment ago,
  since nothing holds it yet (two groups of one `pipeserve up` were once handed one gRPC port, and
  the second group restarted on it until its backoff gave up);
- anyone's bind(0) or outgoing connection (gloo's listeners, clients), which the kernel serves from
  its ephemeral range (net.ipv4.ip_local_port_range).
So a book draws at random from below the ephemeral range, checks that the port can be bound now,
and never hands out the same port twice. One `pipeserve up` shares one book among all it starts.
"""

from __future__ import annotations

import errno
import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 20000  # above the ports services commonly listen on (8000, 8080, 9090, 6379, 11211, ...)
TRIES = 1000


def below_ephemeral(path: Path = EPHEMERAL_RANGE) -> range:
    """The ports under the kernel's ephemeral range, from LOWEST; the whole unprivileged range where
    that leaves fewer than 1,000 (an unusual ip_local_port_range) or the range cannot be read."""
    try:
        low = int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return range(1024, 65536)
    return range(LOWEST, low) if low - LOWEST >= 1000 else range(1024, 65536)


def bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


class PortBook:
    def __init__(self, span: range | None = None) -> None:
        self.span = span if span is not None else below_ephemeral()
        self.taken: set[int] = set()  # every port this book handed out, bound by now or not

    def take(self, host: str = "127.0.0.1") -> int:
        """A port free on `host` now that this book never handed out before."""
        for _ in range(TRIES):
            port = random.choice(self.span)
            if port not in self.taken and bindable(host, port):
                self.taken.add(port)
                return port
        raise OSError(
            errno.EADDRINUSE,
            f"no free port on {host} in {self.span.start}-{self.span.stop - 1} after {TRIES} tries",
        )


def free_port(host: str = "127.0.0.1") -> int:
    """One port for one listener started right away (a test's server); a process that starts several
    takes them from one PortBook."""
    return PortBook().take(host)
