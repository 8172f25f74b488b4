"""The agent's clock, injected: every decision of its parts reads time from here, so that a
test (or a simulation of many nodes) drives deadlines, backoffs and probes with a clock it
moves by hand, with no sleeps.

`monotonic()` is for deadlines and intervals on this node; `time()` is wall time for what
goes into etcd records and events (compared across nodes). The executor's own liveness (the
loop's heartbeat, the lease gate, the loop watchdog) stays on the real clock: it is about the
real loop stalling, which a manual clock cannot tell.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def time(self) -> float: ...


class SystemClock:
    """The real clocks."""

    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()


class ManualClock:
    """A clock that moves only when told (`advance`); thread-safe. Wall time starts at
    `wall_s` and moves with it."""

    def __init__(self, start_s: float = 1000.0, wall_s: float = 1.7e9) -> None:
        self._lock = threading.Lock()
        self._now_s = start_s
        self._offset_s = wall_s - start_s

    def monotonic(self) -> float:
        with self._lock:
            return self._now_s

    def time(self) -> float:
        with self._lock:
            return self._now_s + self._offset_s

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a clock does not go back ({seconds} s)")
        with self._lock:
            self._now_s += seconds
