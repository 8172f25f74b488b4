"""How the job's records are read from etcd, shared by the parts of `ClusterClient`
(elasticpp.cluster.client): from etcd or, with `cached=True`, from the job's watch-fed cache
(`cache.JobCache`, started by `follow`) with no request. What a cached read derives is kept
while its source is unchanged: the cache hands out the same list for a prefix until an event
changes it (`cache.CacheCore.prefix`), so an agent does not rebuild its view of N members on
every refresh (`memo`), and a record is parsed once per revision of its key (`parsed_once`).
A value that cannot be read is skipped: counted, and logged once per key (`skip`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any, Protocol, TypeVar, cast

from elasticpp.cluster import keys as keymod
from elasticpp.cluster.cache import JobCache
from elasticpp.cluster.errors import (
    ClusterDataError,
    ClusterUnavailableError,
    MembershipLapsedError,
)
from elasticpp.cluster.etcd.kv import Compare, EtcdKV, Put
from elasticpp.cluster.records import KeyValue, WatchEvent, loads

log = logging.getLogger("elasticpp.cluster.client")
_V = TypeVar("_V")
MAX_PARSED = 100_000  # records kept parsed (a few per node: members, arrivals)
MAX_DERIVED = 256  # derived answers kept (names of old generations' barriers go)
# Derivations `values_once` keeps (a map of N keys each: the leader's arrivals, a few
# barriers a generation): the current generation's and a few before it.
MAX_SEEN = 16


class CachedRanges(Protocol):
    """What a cached read asks of the job's cache (`cache.JobCache`)."""

    def get(self, key: str) -> tuple[KeyValue | None, int]: ...
    def prefix(self, prefix: str) -> tuple[list[KeyValue], int]: ...
    def covers(self, key: str) -> bool: ...
    def serve_leader(self, on: bool) -> None: ...
    def ensure(self) -> None: ...
    def close(self) -> None: ...


class JobReads:
    """The reads (and the node-fenced put) the parts of one `ClusterClient` share: one
    connection, one cache, one memo of what was parsed and derived, one count of skipped
    values. Thread-safe."""

    def __init__(self, kv: EtcdKV, keys: keymod.JobKeys) -> None:
        self.kv = kv
        self.keys = keys
        self._lock = threading.Lock()
        self._cache: CachedRanges | None = None
        # Values that could not be read (malformed, or written by a newer format) are
        # skipped, counted here and logged once per key: one bad value must not stop every
        # agent.
        self.skipped_values = 0
        self._skipped_keys: set[str] = set()
        self._derived: dict[str, tuple[object, Any]] = {}  # name -> (cached answer, derived)
        self._parsed: dict[str, tuple[int, dict[str, Any]]] = {}  # key -> (mod revision, record)
        self._checked: dict[str, tuple[object, Any]] = {}  # key -> (record, check's answer)
        # what -> {key: (the KeyValue, its name, what it gave)} (`values_once`)
        self._seen: dict[str, dict[str, tuple[KeyValue, str, Any]]] = {}

    def skip(self, key: str, exc: Exception) -> None:
        """Count an unreadable value (and log it once per key)."""
        self.skipped_values += 1
        if len(self._skipped_keys) > 10_000:
            self._skipped_keys.clear()  # bounded: keys of old generations are logged again
        if key not in self._skipped_keys:
            self._skipped_keys.add(key)
            log.warning("etcd value of %s skipped: %s", key, exc)

    def records(self, kvs: Iterable[KeyValue], what: str) -> dict[str, dict[str, Any]]:
        """The readable records of `kvs` by last key segment; unreadable ones skipped. A
        value read before (the same key at the same revision) is not parsed again: after one
        member's change, the other N - 1 records are the ones parsed before."""
        out: dict[str, dict[str, Any]] = {}
        for kv in kvs:
            name = keymod.last_segment(kv.key)
            try:
                out[name] = self.parsed_once(kv, f"{what} {name}")
            except ClusterDataError as exc:
                self.skip(kv.key, exc)
        return out

    def put_as_node(self, node_id: str, lease_id: int | None, put: Put) -> None:
        """`put`; with `lease_id` (the node's registration lease) only while the node's
        member key is on that lease, else `MembershipLapsedError`: a node whose lease lapsed
        writes nothing, however late its write reaches etcd (a check before the put would
        race with the lapse)."""
        if lease_id is None:
            self.kv.put(put.key, put.value)
            return
        ok, _, _ = self.kv.txn([Compare(self.keys.node(node_id), "lease", lease_id)], [put])
        if not ok:
            raise MembershipLapsedError(node_id, lease_id)

    def memo(self, name: str, source: object, cached: bool, build: Callable[[], _V]) -> _V:
        """`build()`, or what it returned before for the same cached `source` (the object
        itself: callers must not change what they are handed)."""
        if not cached:
            return build()
        held = self._derived.get(name)
        if held is not None and held[0] is source:
            return cast(_V, held[1])
        value = build()
        if len(self._derived) >= MAX_DERIVED:
            self._derived.clear()
        self._derived[name] = (source, value)
        return value

    def parsed_once(self, kv: KeyValue, what: str) -> dict[str, Any]:
        """`kv`'s JSON record, parsed again only when the key's revision changed (after one
        member's change, the other N - 1 records are the ones parsed before)."""
        held = self._parsed.get(kv.key)
        if held is not None and held[0] == kv.mod_revision and kv.mod_revision > 0:
            return held[1]
        record = loads(kv.value, what)
        if len(self._parsed) >= MAX_PARSED:
            self._parsed.clear()
        self._parsed[kv.key] = (kv.mod_revision, record)
        return record

    def checked_once(self, key: str, record: object, check: Callable[..., _V], *args: Any) -> _V:
        """`check(*args)` of the record parsed from `key`, run again only for another record (a
        new revision, parsed by `parsed_once`): the leader's view of N arrivals or members
        is rebuilt at every change of one of them, and checking all N each time was most of
        that. A check that raises is not kept (it runs again, and raises again)."""
        held = self._checked.get(key)
        if held is not None and held[0] is record:
            return cast(_V, held[1])
        value = check(*args)
        if len(self._checked) >= MAX_PARSED:
            self._checked.clear()
        self._checked[key] = (record, value)
        return value

    def values_once(
        self, kvs: list[KeyValue], what: str, derive: Callable[[str, dict[str, Any]], _V]
    ) -> dict[str, _V]:
        """Name (the key's last segment) -> `derive(name, record)` of each readable record
        of `kvs`. A key whose KeyValue is the object this `what` saw last time (a cached
        answer keeps the KeyValues of unchanged keys) gives what it gave then, with no key,
        parse or check work: when one of N arrivals changes, the leader's rebuild is N
        lookups (it was ~3 ms at 2,048 nodes, at every arrival the leader's turn took).
        One `what`, one derivation. A value that cannot be read or derived
        (ClusterDataError) is skipped and counted at every call."""
        seen = self._seen.get(what, {})
        now: dict[str, tuple[KeyValue, str, Any]] = {}
        out: dict[str, _V] = {}
        for kv in kvs:
            held = seen.get(kv.key)
            if held is None or held[0] is not kv:
                name = keymod.last_segment(kv.key)
                try:
                    held = (kv, name, derive(name, self.parsed_once(kv, f"{what} {name}")))
                except ClusterDataError as exc:
                    self.skip(kv.key, exc)
                    continue
            now[kv.key] = held
            out[held[1]] = held[2]
        if what not in self._seen and len(self._seen) >= MAX_SEEN:
            self._seen.clear()
        self._seen[what] = now
        return out

    def etcd_requests(self) -> dict[str, int]:
        """Requests this client sent to etcd, by method (`EtcdKV.requests`)."""
        return self.kv.requests()

    def follow(
        self, on_event: Callable[[WatchEvent], None] | None = None, own_node: str | None = None
    ) -> None:
        """Start the job's watch-fed cache (once; a range read and a watch per range, see
        `JobCache`), for reads with `cached=True`; `own_node`'s member key is cached too.
        `on_event` runs on a watch thread after each change."""
        with self._lock:
            if self._cache is not None:
                return
        cache = JobCache(self.kv, self.keys, on_event, own_node)
        with self._lock:
            self._cache = cache

    def serve_from(self, cache: CachedRanges) -> None:
        """Answer reads with `cached=True` from `cache` (a cache made elsewhere: a test's of
        an in-memory etcd), instead of a `JobCache` that `follow` starts."""
        with self._lock:
            self._cache = cache

    def close(self) -> None:
        """Stop the cache's watches (reads with `cached=True` then fail)."""
        with self._lock:
            cache, self._cache = self._cache, None
        if cache is not None:
            cache.close()

    def cache_for_leader(self, on: bool) -> None:
        """Cache the `stopped-<G>` arrivals and the commit records too (the leader reads
        them), or no longer."""
        self.cached().serve_leader(on)

    def sync_cache(self) -> None:
        """Read again what the cache lost events of (nothing in steady state)."""
        self.cached().ensure()

    def cached(self) -> CachedRanges:
        cache = self._cache
        if cache is None:
            raise ClusterUnavailableError(f"job {self.keys.job}: the etcd cache is not started")
        return cache

    def covered(self, key: str) -> bool:
        """Whether the cache serves `key` now (False when nothing is cached)."""
        with self._lock:
            cache = self._cache
        return cache is not None and cache.covers(key)

    def get(self, key: str, cached: bool) -> KeyValue | None:
        return self.cached().get(key)[0] if cached else self.kv.get(key)

    def get_prefix(self, prefix: str, cached: bool) -> tuple[list[KeyValue], int]:
        return self.cached().prefix(prefix) if cached else self.kv.get_prefix(prefix)
