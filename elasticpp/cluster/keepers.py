"""`KeeperGroup`: the one thread that keeps every lease of one etcd client alive
(elasticpp.cluster.leases has the keepers and what each step decides).

Invariants:
- one group per client while it has keepers: the first keeper starts its thread, the last
  one to stop (by `stop()`, or by its own step: a lost leadership, a node id taken) ends it;
- the keepers due together have their keep-alives sent together and waited for together
  (`EtcdKV.refresh_many`), so a slow answer holds back none sent beside it, and one keeper's
  error (or bug) never stops the others: it is retried after the keeper's `failing_retry_s`;
- `leave()` returns once no step of that keeper runs (unless called on the group's thread).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

from elasticpp.cluster.errors import ClusterError, ClusterUnavailableError
from elasticpp.cluster.etcd.kv import EtcdKV

if TYPE_CHECKING:
    from elasticpp.cluster.leases import LeaseKeeper

log = logging.getLogger("elasticpp.cluster.client")


class KeeperGroup:
    """The thread that keeps every lease of one client alive (see the module): started by
    the first keeper, ended when the last one stops."""

    _lock: ClassVar[threading.Lock] = threading.Lock()  # guards `_of`
    _of: ClassVar[dict[int, KeeperGroup]] = {}  # id(client) -> its group, while it has keepers
    _names: ClassVar[itertools.count[int]] = itertools.count(1)

    def __init__(self, kv: EtcdKV) -> None:
        self._kv = kv
        self._cond = threading.Condition()
        self._due: list[tuple[float, int, LeaseKeeper]] = []  # (monotonic, seq, keeper)
        self._seq = itertools.count()
        self._members: set[LeaseKeeper] = set()
        self._stepping: frozenset[LeaseKeeper] = frozenset()
        self._thread = threading.Thread(
            target=self._run, name=f"etcd-leases-{next(self._names)}", daemon=True
        )

    @classmethod
    def join(cls, keeper: LeaseKeeper, due_s: float) -> KeeperGroup:
        """Keep `keeper` from `due_s` (monotonic) on its client's group."""
        with cls._lock:
            group = cls._of.get(id(keeper._kv))
            new = group is None
            if group is None:
                group = cls._of[id(keeper._kv)] = cls(keeper._kv)
            with group._cond:
                group._members.add(keeper)
                group._push(keeper, due_s)
            if new:  # with its first member: a group without members ends
                group._thread.start()
        return group

    def leave(self, keeper: LeaseKeeper) -> None:
        """`keeper` is stopped: forget it, and return once no step of it runs (unless on
        this group's own thread: a keeper stopped by its own step)."""
        self._drop(keeper)
        if threading.current_thread() is not self._thread:
            with self._cond:
                self._cond.wait_for(
                    lambda: keeper not in self._stepping,
                    timeout=self._kv.request_timeout_s * 2 + 1,
                )

    def _drop(self, keeper: LeaseKeeper) -> None:
        """Forget a stopped keeper (by `stop()`, or by its own step: a lost leadership, a
        node id taken); the last one ends the group."""
        with self._lock, self._cond:
            self._members.discard(keeper)
            if not self._members and self._of.get(id(self._kv)) is self:
                del self._of[id(self._kv)]
            self._cond.notify_all()

    def _push(self, keeper: LeaseKeeper, due_s: float) -> None:
        heapq.heappush(self._due, (due_s, next(self._seq), keeper))
        self._cond.notify_all()

    def _take_due(self) -> list[LeaseKeeper] | None:
        """Wait for keepers due (dropping stopped ones); None when the group is done."""
        with self._cond:
            while True:
                while self._due and self._due[0][2]._stop.is_set():
                    heapq.heappop(self._due)
                if not self._members:
                    return None
                now_s = time.monotonic()
                if self._due and self._due[0][0] <= now_s:
                    due = []
                    while self._due and self._due[0][0] <= now_s:
                        keeper = heapq.heappop(self._due)[2]
                        if not keeper._stop.is_set():
                            due.append(keeper)
                    self._stepping = frozenset(due)
                    return due
                self._cond.wait(self._due[0][0] - now_s if self._due else None)

    def _run(self) -> None:
        while (due := self._take_due()) is not None:
            try:
                self._step(due)
            finally:
                with self._cond:
                    self._stepping = frozenset()
                    self._cond.notify_all()

    def _step(self, due: list[LeaseKeeper]) -> None:
        batch: list[tuple[LeaseKeeper, int, float]] = []
        for keeper in due:
            delay_s = self._guarded(keeper, keeper.before_refresh)
            if delay_s is None:
                batch.append((keeper, keeper.lease_id, keeper._clock()))
            else:
                self._again(keeper, delay_s)
        if not batch:
            return
        outcomes: list[int | ClusterError]
        try:
            outcomes = self._kv.refresh_many([(lid, k.on_late(lid, t)) for k, lid, t in batch])
        except ClusterError as exc:
            outcomes = [exc] * len(batch)
        except Exception as exc:  # a bug: every keeper retries, none stops silently
            log.exception("lease keep-alives failed")
            outcomes = [ClusterUnavailableError(f"lease keep-alive: {exc}")] * len(batch)
        for (keeper, lease_id, sent_s), outcome in zip(batch, outcomes, strict=True):
            delay_s = self._guarded(
                keeper, functools.partial(keeper.after_refresh, lease_id, sent_s, outcome)
            )
            self._again(keeper, keeper.failing_retry_s if delay_s is None else delay_s)

    def _again(self, keeper: LeaseKeeper, delay_s: float) -> None:
        if keeper._stop.is_set():
            self._drop(keeper)
            return
        with self._cond:
            self._push(keeper, time.monotonic() + delay_s)

    @staticmethod
    def _guarded(keeper: LeaseKeeper, work: Callable[[], float | None]) -> float | None:
        try:
            return work()
        except Exception:  # the thread keeps the client's other leases: it goes on
            log.exception("%s: lease keeping failed", keeper._what)
            return keeper.failing_retry_s


def kept(kv: EtcdKV) -> list[str]:
    """What `kv`'s lease thread keeps now, one entry per lease ("node n1 membership",
    "leader n1 leader"), sorted."""
    with KeeperGroup._lock:
        group = KeeperGroup._of.get(id(kv))
        if group is None:
            return []
        with group._cond:
            return sorted(f"{k._what} {k._kind}" for k in group._members)
