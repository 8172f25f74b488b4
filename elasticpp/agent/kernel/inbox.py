"""What other threads and parts may hand to a part: signals, never its state.

A part's state has one writer, the part's own code on the decision loop. Watches, gRPC
threads and other parts only raise a `Signal` the owning part takes on its next step (the
view's "read etcd again", the health part's "the quarantine keys changed"), or put a request
on a queue it drains. The events log (`EventLog`) is an output every part writes to, like
the log itself; it is thread-safe because the WatchEvents streams read it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator


class Signal:
    """A flag any thread may raise and one owner takes (reads and lowers) in one step."""

    def __init__(self, raised: bool = False) -> None:
        self._event = threading.Event()
        if raised:
            self._event.set()

    def raise_(self) -> None:
        self._event.set()

    def is_raised(self) -> bool:
        return self._event.is_set()

    def take(self) -> bool:
        """Whether it was raised; lowered either way. A raise racing a take is either taken
        now or seen on the next take, never lost."""
        if not self._event.is_set():
            return False
        self._event.clear()
        return True


Event = tuple[float, str, str, int]  # wall time, kind, message, generation


class EventLog:
    """The agent's decisions and observations, newest `maxlen` kept, for `ctl events`."""

    def __init__(self, maxlen: int = 500) -> None:
        self._items: deque[Event] = deque(maxlen=maxlen)
        self._cond = threading.Condition()
        self._total = 0

    def append(self, kind: str, message: str, generation: int, at: float | None = None) -> None:
        with self._cond:
            self._items.append((time.time() if at is None else at, kind, message, generation))
            self._total += 1
            self._cond.notify_all()

    @property
    def total(self) -> int:
        return self._total

    def items(self) -> list[Event]:
        with self._cond:
            return list(self._items)

    def __iter__(self) -> Iterator[Event]:
        return iter(self.items())

    def __getitem__(self, index: int) -> Event:
        return self.items()[index]

    def since(self, index: int, timeout_s: float) -> tuple[list[Event], int]:
        """Events after the `index`-th one ever logged, waiting up to `timeout_s` for one."""
        with self._cond:
            if self._total <= index:
                self._cond.wait(timeout_s)
            items = list(self._items)
            first = self._total - len(items)
            return items[max(0, index - first) :], self._total
