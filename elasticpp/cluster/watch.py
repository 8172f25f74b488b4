"""`Watch`: a key or prefix watch that survives etcd restarts. When a stream ends it is
re-created from the last delivered revision + 1, so no event is lost or delivered twice.
When events were lost all the same the callback gets a RESYNC event (re-read what you watch):
the start revision was compacted away, or the store's revision went back below it on a
re-creation (a new etcd, or one restored from a backup: a watch from a revision the store has
not reached would wait silently for it).

Invariants:
- the callbacks of every watch on one client (`EtcdKV`) run on one thread, that client's
  `_Dispatcher`: each watch's events one at a time, in revision order; a callback that
  raises is logged, never fatal. A callback hands the news over (applies it to a cache,
  wakes a loop): one that blocks delays the other watches of its client. It may call the
  client, create watches or cancel its own.
- the dispatcher's thread lives while its client has watches: the first watch starts it,
  the last one's cancel ends it. An agent holds one thread for all its watches (it held a
  thread per watch: six per agent, twelve thousand for 2,048 simulated agents, each a
  futex waiter the kernel walks past on every wake-up).
- `cancel()` returns once no callback of that watch runs or will run (but when called from
  the callback itself).
- re-creating a broken watch waits on the dispatcher's clock (backoff RETRY_MIN_S doubling
  to RETRY_MAX_S), never in a sleep that holds the other watches back.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar

from elasticpp.cluster import keys as keymod
from elasticpp.cluster.errors import ClusterError, ClusterUnavailableError
from elasticpp.cluster.etcd.kv import EtcdKV, WatchBatch, WatchEnded, WatchItem
from elasticpp.cluster.leases import RETRY_MAX_S, RETRY_MIN_S
from elasticpp.cluster.records import EventType, WatchEvent

log = logging.getLogger("elasticpp.cluster.client")


class _Dispatcher:
    """The thread that runs the callbacks (and the re-creations) of one client's watches."""

    _lock: ClassVar[threading.Lock] = threading.Lock()  # guards `_of` and `_watches`
    _of: ClassVar[dict[int, _Dispatcher]] = {}  # id(client) -> its dispatcher, while watched
    _names: ClassVar[itertools.count[int]] = itertools.count(1)

    def __init__(self, key: int) -> None:
        self._key = key
        self._watches = 0
        self._items: queue.SimpleQueue[tuple[Watch, int, WatchItem] | None] = queue.SimpleQueue()
        self._retries: list[tuple[float, int, Watch]] = []  # (monotonic due, seq, watch)
        self._seq = itertools.count()
        self._busy = threading.Condition()
        self._running: Watch | None = None  # whose callback runs now
        self._thread = threading.Thread(
            target=self._run, name=f"etcd-watches-{next(self._names)}", daemon=True
        )
        self._thread.start()

    @classmethod
    def join(cls, kv: EtcdKV) -> _Dispatcher:
        """The dispatcher of `kv`'s watches, started for its first; counts one more watch."""
        with cls._lock:
            found = cls._of.get(id(kv))
            if found is None:
                found = cls._of[id(kv)] = cls(id(kv))
            found._watches += 1
            return found

    def leave(self) -> None:
        """One watch fewer; the last one's leave ends the thread (after what is queued)."""
        with self._lock:
            self._watches -= 1
            if self._watches > 0:
                return
            if self._of.get(self._key) is self:
                del self._of[self._key]
        self._items.put(None)

    def put(self, watch: Watch, stream: int, item: WatchItem) -> None:
        self._items.put((watch, stream, item))

    def retry_at(self, due_s: float, watch: Watch) -> None:
        """Ask for `watch._retry()` at `due_s` (called on the dispatcher's thread)."""
        heapq.heappush(self._retries, (due_s, next(self._seq), watch))

    def on_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def wait_idle(self, watch: Watch) -> None:
        """Return once no callback of `watch` runs (not called on the dispatcher's thread)."""
        with self._busy:
            self._busy.wait_for(lambda: self._running is not watch, timeout=5.0)

    def _run(self) -> None:
        while True:
            timeout_s = None
            if self._retries:
                timeout_s = max(0.0, self._retries[0][0] - time.monotonic())
            try:
                entry = self._items.get(timeout=timeout_s)
            except queue.Empty:
                pass  # a re-creation is due
            else:
                if entry is None:  # the last watch left (see `leave`)
                    with self._lock:
                        if self._watches <= 0:
                            return
                    continue
                watch, stream, item = entry
                self._call(watch, watch._take, stream, item)
            while self._retries and self._retries[0][0] <= time.monotonic():
                _, _, due = heapq.heappop(self._retries)
                self._call(due, due._retry)

    def _call(self, watch: Watch, work: Callable[..., None], *args: Any) -> None:
        with self._busy:
            self._running = watch
        try:
            work(*args)
        except Exception:  # the thread serves every watch of its client: it goes on
            log.exception("watch %s: its handling failed", watch.key)
        finally:
            with self._busy:
                self._running = None
                self._busy.notify_all()


class Watch:
    """A watch that outlives etcd restarts. The callback runs on its client's watch thread
    (see the module), one event at a time, in revision order."""

    def __init__(
        self,
        kv: EtcdKV,
        key: str,
        callback: Callable[[WatchEvent], None],
        *,
        prefix: bool,
        start_revision: int | None,
        range_end: str | None = None,
        on_batch: Callable[[tuple[WatchEvent, ...]], None] | None = None,
    ) -> None:
        """`range_end` (exclusive) watches the keys from `key` up to it, whatever `prefix`.
        With `on_batch`, the events of one etcd response (all the events of a revision,
        a transaction's included) go to it in one call; `callback` then gets RESYNC only."""
        self.key = key
        self._kv = kv
        if range_end is None and prefix:
            range_end = keymod.prefix_end(key)
        self._range_end = range_end
        self._callback = callback
        self._on_batch = on_batch
        self._cancelled = threading.Event()
        self._stream = 0  # items of older streams are dropped (streams count from 1)
        self._watch_id = -1
        self._broken: str | None = None  # why the stream is down, while it is
        self._backoff_s = RETRY_MIN_S
        if start_revision is None:
            start_revision = kv.revision(within=key) + 1
        self._next_revision = start_revision
        self._dispatcher = _Dispatcher.join(kv)
        try:
            self._open()  # the first creation is synchronous: a dead etcd raises here
        except BaseException:
            self._dispatcher.leave()
            raise

    @property
    def next_revision(self) -> int:
        """The revision the watch would resume from (last delivered + 1)."""
        return self._next_revision

    @property
    def is_open(self) -> bool:
        """False while the stream is down (being re-created): events may be late."""
        return self._broken is None

    def _open(self) -> None:
        self._stream += 1
        stream = self._stream

        def sink(item: WatchItem) -> None:
            self._dispatcher.put(self, stream, item)

        self._watch_id = self._kv.add_watch(self.key, self._range_end, self._next_revision, sink)

    def _reopen(self) -> None:
        """Re-create the stream; a store now behind the revision to resume from lost what
        this watch saw: say RESYNC and follow the store from where it is."""
        self._open()
        store_revision = self._kv.watch_created_revision(self._watch_id)
        if 0 < store_revision < self._next_revision - 1:
            log.warning(
                "watch %s: the store is at revision %d, behind %d seen before (a new or "
                "restored etcd); resync",
                self.key,
                store_revision,
                self._next_revision - 1,
            )
            self._kv.cancel_watch(self._watch_id)
            self._next_revision = store_revision + 1
            self._open()
            self._safe_call(WatchEvent(EventType.RESYNC, self.key, None, self._next_revision))

    def _retry(self) -> None:
        """Re-create the broken stream (on the dispatcher's thread, when its backoff is up)."""
        broken = self._broken
        if broken is None or self._cancelled.is_set():
            return
        try:
            self._reopen()
            log.info(
                "watch %s re-created from revision %d after: %s",
                self.key,
                self._next_revision,
                broken,
            )
            self._broken, self._backoff_s = None, RETRY_MIN_S
            return
        except ClusterUnavailableError:
            self._backoff_s = min(self._backoff_s * 2, RETRY_MAX_S)
        except ClusterError as exc:  # refused credentials, a limit: said, and retried
            log.warning("watch %s not re-created: %s", self.key, exc)
            self._backoff_s = RETRY_MAX_S
        except Exception:  # a bug: said, and retried, never a watch silently gone
            log.exception("watch %s not re-created", self.key)
            self._backoff_s = RETRY_MAX_S
        self._dispatcher.retry_at(time.monotonic() + self._backoff_s, self)

    def _take(self, stream: int, item: WatchItem) -> None:
        """One item of a stream (on the dispatcher's thread); items of older streams, or
        after a cancel, are dropped."""
        if stream != self._stream or self._cancelled.is_set():
            return
        if isinstance(item, WatchBatch):
            self._deliver(item)
        elif isinstance(item, WatchEnded):
            self._kv.cancel_watch(self._watch_id)
            if item.compact_revision:
                log.warning(
                    "watch %s: revisions before %d were compacted; events lost, resync",
                    self.key,
                    item.compact_revision,
                )
                self._next_revision = item.compact_revision
                self._safe_call(WatchEvent(EventType.RESYNC, self.key, None, item.compact_revision))
            if self._broken is None:
                self._broken = item.reason
                self._dispatcher.retry_at(time.monotonic() + self._backoff_s, self)

    def _deliver(self, batch: WatchBatch) -> None:
        floor = self._next_revision
        # Events below the floor were delivered before a re-creation.
        fresh = tuple(e for e in batch.events if e.mod_revision >= floor)
        if self._on_batch is not None and fresh:
            try:
                self._on_batch(fresh)
            except Exception:
                log.exception("watch %s: callback failed on %d event(s)", self.key, len(fresh))
            self._next_revision = max(self._next_revision, fresh[-1].mod_revision + 1)
            return
        for event in fresh:
            self._safe_call(event)
            self._next_revision = max(self._next_revision, event.mod_revision + 1)

    def _safe_call(self, event: WatchEvent) -> None:
        try:
            self._callback(event)
        except Exception:
            log.exception("watch %s: callback failed on %s", self.key, event)

    def cancel(self) -> None:
        """Stop the watch; once this returns its callback does not run again (unless
        called from that callback, which then finishes)."""
        if self._cancelled.is_set():
            return
        self._cancelled.set()
        self._kv.cancel_watch(self._watch_id)
        self._dispatcher.leave()
        if not self._dispatcher.on_thread():
            self._dispatcher.wait_idle(self)
