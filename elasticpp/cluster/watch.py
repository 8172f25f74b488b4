"""`Watch`: a key or prefix watch that survives etcd restarts. When a stream ends it is
re-created from the last delivered revision + 1, so no event is lost or delivered twice;
callbacks run on the watch's own thread, and one that raises is logged, never fatal.
When events were lost all the same the callback gets a RESYNC event (re-read what you watch):
the start revision was compacted away, or the store's revision went back below it on a
re-creation (a new etcd, or one restored from a backup: a watch from a revision the store has
not reached would wait silently for it).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from elasticpp.cluster import keys as keymod
from elasticpp.cluster.errors import ClusterError, ClusterUnavailableError
from elasticpp.cluster.etcd_client import EtcdKV, WatchBatch, WatchEnded, WatchItem
from elasticpp.cluster.leases import RETRY_MAX_S, RETRY_MIN_S
from elasticpp.cluster.records import EventType, WatchEvent

log = logging.getLogger("elasticpp.cluster.client")


class Watch:
    """A watch that outlives etcd restarts. The callback runs on this watch's own thread,
    one event at a time, in revision order; it may call the client (even create watches)."""

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
        self._items: queue.Queue[tuple[int, WatchItem]] = queue.Queue()
        self._cancelled = threading.Event()
        self._stream = 0  # items of older streams are dropped (streams count from 1)
        self._watch_id = -1
        self._broken: str | None = None  # why the stream is down, while it is
        if start_revision is None:
            start_revision = kv.revision() + 1
        self._next_revision = start_revision
        self._open()  # the first creation is synchronous: a dead etcd raises here
        self._thread = threading.Thread(target=self._run, name=f"watch-{key}", daemon=True)
        self._thread.start()

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
            self._items.put((stream, item))

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

    def _run(self) -> None:
        backoff_s = RETRY_MIN_S
        while not self._cancelled.is_set():
            broken = self._broken
            if broken is not None:
                if self._cancelled.wait(backoff_s):
                    break
                try:
                    self._reopen()
                    log.info(
                        "watch %s re-created from revision %d after: %s",
                        self.key,
                        self._next_revision,
                        broken,
                    )
                    self._broken, backoff_s = None, RETRY_MIN_S
                except ClusterUnavailableError:
                    backoff_s = min(backoff_s * 2, RETRY_MAX_S)
                except ClusterError as exc:  # refused credentials, a limit: said, and retried
                    log.warning("watch %s not re-created: %s", self.key, exc)
                    backoff_s = RETRY_MAX_S
                continue
            # Blocks without polling: cancel() wakes it with an item of no stream.
            stream, item = self._items.get()
            if stream != self._stream or self._cancelled.is_set():
                continue
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
                    self._safe_call(
                        WatchEvent(EventType.RESYNC, self.key, None, item.compact_revision)
                    )
                self._broken = item.reason

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
        self._cancelled.set()
        self._kv.cancel_watch(self._watch_id)
        self._items.put((0, WatchEnded("cancelled")))  # stream 0 is no stream: only wakes _run
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
