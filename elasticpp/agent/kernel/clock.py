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
from collections.abc import Callable
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


class LoopHeartbeat:
    """How long the decision loop has been stuck in one piece of work: the time since it
    last began one (a tick, a try at joining), or 0 while it waits for something to do.

    A loop that sleeps until it is woken is not stalled, however long it sleeps; a loop
    that began a tick and has not come back from it is (a blocked call, a stalled disk).
    The watchdog (health NOT_SERVING) and the lease gate (leases not renewed) read it from
    their own threads, so a quiet follower may tick rarely. On the real clock (see above).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._busy_since: float | None = clock()  # the loop is starting up

    def busy(self) -> None:
        """The loop begins a piece of work."""
        self._busy_since = self._clock()

    def idle(self) -> None:
        """The loop waits to be woken."""
        self._busy_since = None

    def stuck_s(self) -> float:
        """Seconds the loop has been in its current piece of work; 0 while it waits."""
        since = self._busy_since  # one read: the loop thread may reset it meanwhile
        return 0.0 if since is None else max(0.0, self._clock() - since)
