"""A watch-fed cache of key ranges of etcd: read once, then follow changes.

Each range is read once at a revision R (one range read), then watched from R + 1; the
watch's PUT and DELETE events are applied in revision order, and readers are answered from
memory together with the revision the answer reflects. Invariants:

- An answer is a state etcd held: the read at R plus every event after R, none missed. An
  event at or below the revision read is one the read holds already, and is dropped. The
  events of one watch response (every event of a revision) are applied under one lock, so
  no reader sees part of a transaction.
- Nothing is served across a gap. When events may have been lost (the watch's start revision
  was compacted away, the store went back in revision, an event came out of order) the range
  is marked stale: readers get `ClusterUnavailableError` until `ensure()` reads it again.
  Events that arrive while it is stale are kept and applied over the new read.
- While a range's watch is down (etcd restarting) readers get `ClusterUnavailableError` too:
  the last answer may be old, and the caller already knows what to do when etcd is away.

`CacheCore` is the pure part (a map, a revision, the rules above); `RangeCache` adds the etcd
read and the watch (`watch.Watch`, which re-creates its stream after an etcd restart from the
last revision it delivered + 1). Reads happen only in `ensure()`, on the caller's thread;
the watch thread only applies events.
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections.abc import Callable, Iterable

from elasticpp.cluster.barriers import CHECKPOINT_BARRIER
from elasticpp.cluster.errors import ClusterUnavailableError
from elasticpp.cluster.etcd.kv import EtcdKV
from elasticpp.cluster.keys import JobKeys, prefix_end
from elasticpp.cluster.records import EventType, KeyValue, WatchEvent
from elasticpp.cluster.watch import Watch

log = logging.getLogger(__name__)

MAX_ANSWERS = 64  # prefix answers a range keeps (a reader asks for a handful per generation)


class CacheCore:
    """The keys of one range at a revision, fed by `load` (a read) and `apply` (events).
    Not thread-safe (`RangeCache` locks around it); no I/O."""

    def __init__(self) -> None:
        self._kvs: dict[str, KeyValue] = {}
        self._keys: list[str] = []  # sorted: a prefix is a slice found by bisection
        self.loaded = False
        self.read_revision = 0  # the revision of the last read
        self.revision = 0  # the newest revision the map reflects
        self.stale_reason: str | None = "not read yet"
        self._pending: list[WatchEvent] = []  # events that came while stale
        # prefix -> its answer, while no event under it came: an unchanged prefix is the
        # same list object, so a reader may keep what it derived from it (ClusterClient)
        self._answers: dict[str, list[KeyValue]] = {}

    def load(self, kvs: Iterable[KeyValue], revision: int) -> None:
        """Take a read at `revision` as the state, then the events kept while stale that
        are newer than it."""
        self._kvs = {kv.key: kv for kv in kvs}
        self._keys = sorted(self._kvs)
        self._answers = {}
        self.read_revision = self.revision = revision
        self.loaded, self.stale_reason = True, None
        pending, self._pending = self._pending, []
        for event in pending:
            self.apply(event)

    def invalidate(self, reason: str) -> None:
        """Events were lost: nothing is served until the next `load`. Events kept before
        are dropped with the state (the next read holds them)."""
        self.loaded, self.stale_reason = False, reason
        self._pending = []
        self._answers = {}

    def apply(self, event: WatchEvent) -> bool:
        """Apply one watch event; True if the map changed. A RESYNC event, or an event older
        than one applied before, invalidates the map."""
        if event.type is EventType.RESYNC:
            self.invalidate(f"events lost before revision {event.mod_revision}")
            return True
        if not self.loaded:
            self._pending.append(event)
            return False
        if event.mod_revision <= self.read_revision:
            return False  # the read holds it already
        if event.mod_revision < self.revision:
            self.invalidate(
                f"event of {event.key} at revision {event.mod_revision} came after "
                f"revision {self.revision}"
            )
            return True
        self.revision = event.mod_revision
        for prefix in [p for p in self._answers if event.key.startswith(p)]:
            del self._answers[prefix]
        if event.type is EventType.DELETE:
            if self._kvs.pop(event.key, None) is None:
                return False
            del self._keys[bisect.bisect_left(self._keys, event.key)]
            return True
        assert event.value is not None
        if event.key not in self._kvs:
            bisect.insort(self._keys, event.key)
        self._kvs[event.key] = KeyValue(
            event.key, event.value, event.mod_revision, event.create_revision, event.lease_id
        )
        return True

    def get(self, key: str) -> KeyValue | None:
        return self._kvs.get(key)

    def prefix(self, prefix: str) -> list[KeyValue]:
        """The keys under `prefix`, sorted by key (as etcd's range read sorts them). Until an
        event under `prefix` comes, the same list (callers must not change it)."""
        answer = self._answers.get(prefix)
        if answer is not None:
            return answer
        lo = bisect.bisect_left(self._keys, prefix)
        hi = bisect.bisect_left(self._keys, prefix_end(prefix), lo)
        answer = [self._kvs[k] for k in self._keys[lo:hi]]
        if len(self._answers) >= MAX_ANSWERS:  # prefixes of old generations: start afresh
            self._answers = {}
        self._answers[prefix] = answer
        return answer


class RangeCache:
    """One key range of etcd (`key` up to `range_end`, exclusive), read once and then
    followed by a watch. `on_event` (if given) runs on the watch's thread after each event
    is applied: it may only hand the news over (wake a loop)."""

    def __init__(
        self,
        kv: EtcdKV,
        key: str,
        range_end: str,
        *,
        on_event: Callable[[WatchEvent], None] | None = None,
    ) -> None:
        self.key, self.range_end = key, range_end
        self._kv = kv
        self._on_event = on_event
        self._lock = threading.Lock()
        self._core = CacheCore()
        self.reads = 0  # range reads done (the first, and one per resync)
        self._watch: Watch | None = None
        self.ensure()  # a dead etcd raises here, before any watch exists
        self._watch = Watch(
            kv,
            key,
            self._apply,
            prefix=False,
            range_end=range_end,
            start_revision=self._core.read_revision + 1,
            on_batch=self._apply_batch,
        )

    def _apply_batch(self, events: tuple[WatchEvent, ...]) -> None:
        """The events of one etcd response at once: a reader never sees half of a
        transaction (a resume instruction without its parts, say)."""
        with self._lock:
            was_loaded = self._core.loaded
            for event in events:
                self._core.apply(event)
            lost = self._core.stale_reason if was_loaded and not self._core.loaded else None
        if lost is not None:
            log.warning("cache of %s: %s; read again", self.key, lost)
        if self._on_event is not None:
            for event in events:
                self._on_event(event)

    def _apply(self, event: WatchEvent) -> None:
        with self._lock:
            self._core.apply(event)
            reason = self._core.stale_reason
        if event.type is EventType.RESYNC:
            log.warning("cache of %s: %s; read again", self.key, reason)
        if self._on_event is not None:
            self._on_event(event)

    def ensure(self) -> None:
        """Read the range again if events were lost (one range read); else nothing."""
        with self._lock:
            if self._core.loaded:
                return
        kvs, revision = self._kv.get_range(self.key, self.range_end)
        self.reads += 1
        with self._lock:
            if self._core.loaded:
                return  # cannot happen with one caller; a second read is harmless
            self._core.load(kvs, revision)
        log.info("cache of %s: read at revision %d (%d keys)", self.key, revision, len(kvs))

    def _check(self) -> None:
        """Raise unless the range may be served (lock held)."""
        if not self._core.loaded:
            raise ClusterUnavailableError(
                f"etcd cache of {self.key}: {self._core.stale_reason}; read it again first"
            )
        if self._watch is not None and not self._watch.is_open:
            raise ClusterUnavailableError(f"etcd cache of {self.key}: its watch is down")

    def get(self, key: str) -> tuple[KeyValue | None, int]:
        """One key (None if absent) and the revision the cache reflects."""
        with self._lock:
            self._check()
            return self._core.get(key), self._core.revision

    def prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """The keys under `prefix` (sorted) and the revision the cache reflects."""
        with self._lock:
            self._check()
            return self._core.prefix(prefix), self._core.revision

    def covers(self, key: str) -> bool:
        return self.key <= key < self.range_end

    def cancel(self) -> None:
        if self._watch is not None:
            self._watch.cancel()


Range = tuple[str, str]  # [key, range_end)


def cache_ranges(keys: JobKeys, own_node: str | None) -> tuple[list[Range], tuple[Range, ...]]:
    """The key ranges a `JobCache` serves: those every node caches, and those only the
    leader caches (while `serve_leader(True)`): the member keys, the commit records, the
    `failed-<G>`, `started-<G>`, `stepped-<G>` and `stopped-<G>` arrivals, the answers to
    a `stop` and the `checkpoint` reports. Every node caches the gaps between the leader's
    ranges, and its own member key (`own_node`)."""
    barriers = keys.barriers_prefix
    # "<name>." is the first key past every "<name>-..." ('.' follows '-'); between
    # "started-" and "stopped." lie only "stepped-<G>" and "stop/" (the answers to a job
    # stop, which only the leader reads), so one range holds all four kinds.
    failed = (barriers + "failed-", barriers + "failed.")
    arrivals = (barriers + "started-", barriers + "stopped.")
    commits = (keys.commits_prefix, prefix_end(keys.commits_prefix))
    nodes = (keys.nodes_prefix, prefix_end(keys.nodes_prefix))
    # Every node's report at a checkpoint request: read by `job checkpoint`, by no agent.
    checkpoint = keys.barrier_prefix(CHECKPOINT_BARRIER)
    reports = (checkpoint, prefix_end(checkpoint))
    leader_only = tuple(sorted((nodes, failed, arrivals, commits, reports)))
    shared: list[Range] = []
    start = keys.root
    for key, end in leader_only:
        shared.append((start, key))
        start = end
    shared.append((start, prefix_end(keys.root)))
    if own_node is not None:
        own = keys.node(own_node)
        shared.append((own, own + "\0"))  # the one key: "\0" sorts first after it
    return shared, leader_only


class JobCache:
    """What an agent reads of its job, cached: every key under the job's root but those
    that would send each node's value to every node (N² watch events when a job starts, and
    at every transition or more often): the member keys (`nodes/`: every registration, and
    every drain, would reach every node), the commit records (`commits/`), and the
    `failed-<G>`, `started-<G>`, `stepped-<G>` and `stopped-<G>` arrivals (a holdings
    digest each in stopped). The leader alone reads those, and caches them too while
    `serve_leader(True)`. A follower caches its own member key (another agent taking its
    node id shows at once), reads the few others it needs by key
    (`ClusterClient.member_records`: the leader's, its sources' and its replication peers'),
    knows its own arrivals from its writes, and learns that a generation started everywhere
    from the leader's timeline. Six watches
    (seven with `own_node`), eleven on the leader."""

    def __init__(
        self,
        kv: EtcdKV,
        keys: JobKeys,
        on_event: Callable[[WatchEvent], None] | None = None,
        own_node: str | None = None,
    ) -> None:
        self._kv, self._on_event = kv, on_event
        shared, self._leader_only = cache_ranges(keys, own_node)
        self._ranges: list[RangeCache] = []
        self._leader: list[RangeCache] = []
        try:
            for key, end in shared:
                self._ranges.append(RangeCache(kv, key, end, on_event=on_event))
        except BaseException:
            self.close()
            raise

    def serve_leader(self, on: bool) -> None:
        """Cache the leader's ranges too (a read and a watch each), or stop doing so."""
        if on and not self._leader:
            try:
                for key, end in self._leader_only:
                    self._leader.append(RangeCache(self._kv, key, end, on_event=self._on_event))
            except BaseException:
                self.serve_leader(False)
                raise
        elif not on and self._leader:
            for r in self._leader:
                r.cancel()
            self._leader = []

    def _all(self) -> list[RangeCache]:
        return [*self._ranges, *self._leader]

    def ensure(self) -> None:
        """Read again each range that lost events (see `RangeCache.ensure`)."""
        for r in self._all():
            r.ensure()

    def reads(self) -> int:
        return sum(r.reads for r in self._all())

    def covers(self, key: str) -> bool:
        """Whether `key` is served here now (a member key: the own one, or any while the
        leader's ranges are cached)."""
        return any(r.covers(key) for r in self._all())

    def _range(self, key: str, end: str) -> RangeCache:
        for r in self._all():
            if r.covers(key) and end <= r.range_end:
                return r
        raise ClusterUnavailableError(f"etcd cache: {key} is not cached here")

    def get(self, key: str) -> tuple[KeyValue | None, int]:
        return self._range(key, key).get(key)

    def prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        return self._range(prefix, prefix_end(prefix)).prefix(prefix)

    def close(self) -> None:
        for r in self._all():
            r.cancel()
        self._ranges, self._leader = [], []
