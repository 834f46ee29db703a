"""Every thread's stack as text: the wedge report's and the flight recorder's dump's."""

from __future__ import annotations

import sys
import threading
import traceback


def thread_stacks() -> str:
    """One section per live thread (name, ident, its stack, innermost frame last)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        stack = "".join(traceback.format_stack(frame))
        parts.append(f"--- thread {names.get(ident, '?')} ({ident}) ---\n{stack}")
    return "\n".join(parts)
