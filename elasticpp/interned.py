"""`Interned`: one object per equal key for a whole process, the newest few kept.

The agents of one process (a real node's one, the simulation's hundreds) read the same
immutable values (a generation record, its plan); parsing and indexing them once per process
instead of once per agent turns O(N) per agent into O(N) per process. Pure: no I/O, any layer
may use it.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Interned(Generic[K, V]):
    """The values `make()` gave for the last `size` keys asked for; thread-safe. A `make` that
    raises keeps nothing (bad input is refused every time). Values must be immutable, or at
    least never changed by those they are handed to."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._values: collections.OrderedDict[K, V] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: K, make: Callable[[], V]) -> V:
        with self._lock:
            value = self._values.get(key)
            if value is not None:
                self._values.move_to_end(key)
                return value
        made = make()  # outside the lock: a slow parse does not hold up the others
        with self._lock:
            value = self._values.setdefault(key, made)  # a make beside this one may have won
            self._values.move_to_end(key)
            while len(self._values) > self.size:
                self._values.popitem(last=False)
        return value
