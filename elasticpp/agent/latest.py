"""One writer of a value that only the newest copy of matters (the node's commit record).

Invariants:
- One thread writes; callers never wait on the write (a slow or unreachable etcd costs the
  decision loop nothing).
- One slot per key (a generation): the newest value offered replaces one still waiting. A
  value is made under the writer's lock (`offer(key, make)`), so values are made, kept and
  written in one order: a value made earlier never lands after one made later, and what is
  written last is the newest.
- Puts are at most every `every_s` (the first at once). Pending keys are written in key order,
  all in one round; at most `KEYS_KEPT` keys wait (the newest), so memory is bounded.
- A put that fails is retried a round later, unless a newer value was offered meanwhile.
  `flush` writes what waits now; `close` writes it once more and ends the thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

log = logging.getLogger("elasticpp.agent")

T = TypeVar("T")
KEYS_KEPT = 4  # generations whose newest value may wait at once


class LatestWriter(Generic[T]):
    """Writes `write(key, value)` on its own thread, newest value per key, paced."""

    def __init__(
        self,
        write: Callable[[int, T], None],
        *,
        every_s: float,
        name: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if every_s < 0:
            raise ValueError(f"every_s must be >= 0, got {every_s!r}")
        self._write = write
        self._every_s = every_s
        self._name = name
        self._clock = clock
        self._cond = threading.Condition()
        self._slot: dict[int, T] = {}
        self._busy = False  # a round of puts is in flight
        self._urgent = False  # flush asked: write without waiting for the pace
        self._closed = False
        self._failing = False  # the last put failed (logged once per run of failures)
        self._last_put_s: float | None = None
        self._thread: threading.Thread | None = None

    def offer(self, key: int, make: Callable[[], T]) -> None:
        """Make the newest value of `key` (under the lock: see the module's invariants) and
        leave it for the writer thread. Never blocks on a write."""
        with self._cond:
            if self._closed:
                return
            self._slot[key] = make()
            for old in sorted(self._slot)[:-KEYS_KEPT]:
                del self._slot[old]
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True, name=self._name)
                self._thread.start()
            self._cond.notify_all()

    def pending(self) -> dict[int, T]:
        with self._cond:
            return dict(self._slot)

    def flush(self, timeout_s: float) -> bool:
        """Write what waits now, without waiting for the pace; True once it is written (or
        nothing waits), False if it is not within `timeout_s`."""
        with self._cond:
            if not self._slot and not self._busy:
                return True
            self._urgent = True
            self._cond.notify_all()
            done = self._cond.wait_for(lambda: not self._slot and not self._busy, timeout_s)
            self._urgent = False
            return done

    def close(self, timeout_s: float) -> None:
        """Write what waits (one try) and end the thread, within `timeout_s`."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)

    def _due_in_s(self) -> float:
        if self._closed or self._last_put_s is None or (self._urgent and not self._failing):
            return 0.0
        # A failed put is retried at the pace even when flushed: no storm at a sick etcd.
        return self._last_put_s + self._every_s - self._clock()

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if not self._slot:
                        if self._closed:
                            return
                        self._cond.wait()
                        continue
                    wait_s = self._due_in_s()
                    if wait_s <= 0:
                        break
                    self._cond.wait(wait_s)
                batch = sorted(self._slot.items())
                self._slot.clear()
                self._busy = True
                self._last_put_s = self._clock()
            failed: list[tuple[int, T]] = []
            for i, (key, value) in enumerate(batch):
                try:
                    self._write(key, value)
                except Exception as exc:  # etcd down or slow: the newest value is kept
                    if not self._failing:
                        log.warning("%s of %d not written (retried): %s", self._name, key, exc)
                    self._failing = True
                    failed = batch[i:]
                    break
                else:
                    if self._failing:
                        log.info("%s written again", self._name)
                    self._failing = False
            with self._cond:
                if not self._closed:
                    for key, value in failed:
                        self._slot.setdefault(key, value)  # unless a newer one came
                self._busy = False
                self._cond.notify_all()
