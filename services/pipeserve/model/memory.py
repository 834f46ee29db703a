"""Hand freed heap pages back to the OS while and after loading weights.

glibc keeps the pages that freed temporaries (float reads, unpacked nibbles, requantized rows)
leave in its arenas mapped in the process, so a stage's resident size would stay at the loader's
peak for its whole life. `malloc_trim(0)` returns them; elsewhere than glibc it is a no-op.
"""

from __future__ import annotations

import ctypes


def return_freed_memory() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
