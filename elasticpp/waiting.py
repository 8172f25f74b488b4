"""Waiting on a condition with a deadline: the one polling loop tests and tools share.

A leaf module: standard library only. Deadlines use the monotonic clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(
    cond: Callable[[], bool],
    timeout_s: float,
    *,
    interval_s: float = 0.05,
    each: Callable[[], None] | None = None,
) -> bool:
    """Poll `cond` until it holds or `timeout_s` passes; True if it held.

    `each` runs before every check (e.g. to raise when a watched process died early)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if each is not None:
            each()
        if cond():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)
