"""One writer of a value that only the newest copy of matters (the node's commit record).

Invariants:
- One thread writes; callers never wait on the write (a slow or unreachable etcd costs the
  decision loop nothing).
- One slot per key (a generation): the newest value offered replaces one still waiting. A
  value is made under the writer's lock (`offer(key, make)`), so values are made, kept and
  written in one order: a value made earlier never lands after one made later, and what is
  written last is the newest.
- Only a change is written: a value equal to the one last taken for its key (written, or
  being written) is not put again, and drops an older one still waiting.
- Puts are at most every `every_s` (the first at once), except a value `due_now` says must not
  wait for the pace (for the commit record: its anchors ran ahead of what etcd lists).
  Pending keys are written in key order, all in one round; at most `KEYS_KEPT` keys wait
  (the newest), and as many are remembered as written, so memory is bounded.
- A put that fails is retried a round later, unless a newer value was offered meanwhile.
  `flush` writes what waits now; `close` writes it once more and ends the thread.
- What to put and when is decided by `Pacing`, pure (a clock's readings in, no threads).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

log = logging.getLogger("elasticpp.agent")

T = TypeVar("T")
KEYS_KEPT = 4  # generations whose newest value may wait at once


@dataclass
class Pacing(Generic[T]):
    """The writer's decisions: which values wait, and when they may be put."""

    every_s: float
    # (value taken last or None, newest value) -> True if the newest must not wait the pace.
    due_now: Callable[[T | None, T], bool] | None = None
    pending: dict[int, T] = field(default_factory=dict)
    # The newest value taken to be put, per key: being written, or written.
    taken: dict[int, T] = field(default_factory=dict)
    last_put_s: float | None = None
    failing: bool = False  # the last put failed
    hurry: bool = False  # a value waiting is due now

    def offer(self, key: int, value: T) -> None:
        """`value` is the newest of `key`: it waits, unless it is what was taken last."""
        if key in self.taken and self.taken[key] == value:
            self.pending.pop(key, None)  # nothing changed since: a waiting value is older
            return
        self.pending[key] = value
        _keep_newest(self.pending)
        if self.due_now is not None and self.due_now(self.taken.get(key), value):
            self.hurry = True

    def wait_s(self, now_s: float, *, urgent: bool = False, closed: bool = False) -> float:
        """Seconds until what waits may be put (<= 0: now). Flushed (`urgent`) or closing:
        now, except that a failed put is retried at the pace (no storm at a sick etcd)."""
        if closed or self.last_put_s is None or ((urgent or self.hurry) and not self.failing):
            return 0.0
        return self.last_put_s + self.every_s - now_s

    def take(self, now_s: float) -> list[tuple[int, T]]:
        """What waits, in key order, to be put now."""
        batch = sorted(self.pending.items())
        self.pending.clear()
        self.hurry = False
        self.last_put_s = now_s
        self.taken.update(batch)
        _keep_newest(self.taken)
        return batch

    def failed(self, unwritten: list[tuple[int, T]], *, retry: bool = True) -> None:
        """The puts of `unwritten` failed: each waits again (`retry`), unless a newer value
        of its key was offered meanwhile."""
        self.failing = bool(unwritten)
        for key, value in unwritten:
            if self.taken.get(key) == value:
                del self.taken[key]  # not written: the same value offered again is a change
            if retry:
                self.pending.setdefault(key, value)


def _keep_newest(values: dict[int, T]) -> None:
    for old in sorted(values)[:-KEYS_KEPT]:
        del values[old]


class LatestWriter(Generic[T]):
    """Writes `write(key, value)` on its own thread, newest value per key, paced."""

    def __init__(
        self,
        write: Callable[[int, T], None],
        *,
        every_s: float,
        name: str,
        clock: Callable[[], float] = time.monotonic,
        due_now: Callable[[T | None, T], bool] | None = None,
    ) -> None:
        if every_s < 0:
            raise ValueError(f"every_s must be >= 0, got {every_s!r}")
        self._write = write
        self._name = name
        self._clock = clock
        self._cond = threading.Condition()
        self._pacing: Pacing[T] = Pacing(every_s, due_now)
        self._busy = False  # a round of puts is in flight
        self._urgent = False  # flush asked: write without waiting for the pace
        self._closed = False
        self._thread: threading.Thread | None = None

    def offer(self, key: int, make: Callable[[], T]) -> None:
        """Make the newest value of `key` (under the lock: see the module's invariants) and
        leave it for the writer thread. Never blocks on a write."""
        with self._cond:
            if self._closed:
                return
            self._pacing.offer(key, make())
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True, name=self._name)
                self._thread.start()
            self._cond.notify_all()

    def pending(self) -> dict[int, T]:
        with self._cond:
            return dict(self._pacing.pending)

    def flush(self, timeout_s: float) -> bool:
        """Write what waits now, without waiting for the pace; True once it is written (or
        nothing waits), False if it is not within `timeout_s`."""
        with self._cond:
            if not self._pacing.pending and not self._busy:
                return True
            self._urgent = True
            self._cond.notify_all()
            done = self._cond.wait_for(
                lambda: not self._pacing.pending and not self._busy, timeout_s
            )
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

    def _run(self) -> None:
        pacing = self._pacing
        while True:
            with self._cond:
                while True:
                    if not pacing.pending:
                        if self._closed:
                            return
                        self._cond.wait()
                        continue
                    now = self._clock()
                    wait_s = pacing.wait_s(now, urgent=self._urgent, closed=self._closed)
                    if wait_s <= 0:
                        break
                    self._cond.wait(wait_s)
                batch = pacing.take(now)
                self._busy = True
                was_failing = pacing.failing
            failed: list[tuple[int, T]] = []
            for i, (key, value) in enumerate(batch):
                try:
                    self._write(key, value)
                except Exception as exc:  # etcd down or slow: the newest value is kept
                    if not was_failing:
                        log.warning("%s of %d not written (retried): %s", self._name, key, exc)
                    failed = batch[i:]
                    break
            if was_failing and not failed:
                log.info("%s written again", self._name)
            with self._cond:
                pacing.failed(failed, retry=not self._closed)
                self._busy = False
                self._cond.notify_all()
