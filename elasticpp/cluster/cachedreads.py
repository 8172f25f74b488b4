"""The job's watch-fed cache as `ClusterClient` uses it: `follow` starts it, and reads with
`cached=True` are answered from it (`cache.JobCache`) with no request to etcd. What a cached
read derives is kept while its source is unchanged: the cache hands out the same list for a
prefix until an event changes it (`cache.CacheCore.prefix`), so an agent does not rebuild its
view of N members on every refresh (`_memo`), and a record is parsed once per revision of its
key (`_parsed_once`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

from elasticpp.cluster import keys as keymod
from elasticpp.cluster.cache import JobCache
from elasticpp.cluster.errors import ClusterDataError, ClusterUnavailableError
from elasticpp.cluster.etcd_client import EtcdKV
from elasticpp.cluster.records import KeyValue, WatchEvent, loads

_V = TypeVar("_V")
MAX_PARSED = 100_000  # records kept parsed (a few per node: members, arrivals)
MAX_DERIVED = 256  # derived answers kept (names of old generations' barriers go)
# Derivations `_values_once` keeps (a map of N keys each: the leader's arrivals, a few
# barriers a generation): the current generation's and a few before it.
MAX_SEEN = 16


class CachedReadsPart:
    """Methods of `ClusterClient` (elasticpp.cluster.client)."""

    job: str
    keys: keymod.JobKeys
    _kv: EtcdKV
    _lock: threading.Lock
    _cache: JobCache | None
    _derived: dict[str, tuple[object, Any]]  # name -> (the cached answer, what was derived)
    _parsed: dict[str, tuple[int, dict[str, Any]]]  # key -> (mod revision, record)
    _checked: dict[str, tuple[object, Any]]  # key -> (the record checked, what the check gave)
    # what -> {key: (the KeyValue, its name, what it gave)} (`_values_once`)
    _seen: dict[str, dict[str, tuple[KeyValue, str, Any]]]

    if TYPE_CHECKING:  # defined by ClusterClient

        def skip_value(self, key: str, exc: Exception) -> None: ...

    def _memo(self, name: str, source: object, cached: bool, build: Callable[[], _V]) -> _V:
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

    def _parsed_once(self, kv: KeyValue, what: str) -> dict[str, Any]:
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

    def _checked_once(self, key: str, record: object, check: Callable[..., _V], *args: Any) -> _V:
        """`check(*args)` of the record parsed from `key`, run again only for another record (a
        new revision, parsed by `_parsed_once`): the leader's view of N arrivals or members
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

    def _values_once(
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
                    held = (kv, name, derive(name, self._parsed_once(kv, f"{what} {name}")))
                except ClusterDataError as exc:
                    self.skip_value(kv.key, exc)
                    continue
            now[kv.key] = held
            out[held[1]] = held[2]
        if what not in self._seen and len(self._seen) >= MAX_SEEN:
            self._seen.clear()
        self._seen[what] = now
        return out

    def etcd_requests(self) -> dict[str, int]:
        """Requests this client sent to etcd, by method (`EtcdKV.requests`)."""
        return self._kv.requests()

    def follow(
        self, on_event: Callable[[WatchEvent], None] | None = None, own_node: str | None = None
    ) -> None:
        """Start the job's watch-fed cache (once; a range read and a watch per range, see
        `JobCache`), for reads with `cached=True`; `own_node`'s member key is cached too.
        `on_event` runs on a watch thread after each change."""
        with self._lock:
            if self._cache is not None:
                return
        cache = JobCache(self._kv, self.keys, on_event, own_node)
        with self._lock:
            self._cache = cache

    def cache_for_leader(self, on: bool) -> None:
        """Cache the `stopped-<G>` arrivals and the commit records too (the leader reads
        them), or no longer."""
        self._cached().serve_leader(on)

    def sync_cache(self) -> None:
        """Read again what the cache lost events of (nothing in steady state)."""
        self._cached().ensure()

    def _cached(self) -> JobCache:
        cache = self._cache
        if cache is None:
            raise ClusterUnavailableError(f"job {self.job}: the etcd cache is not started")
        return cache

    def _covered(self, key: str) -> bool:
        """Whether the cache serves `key` now (False when nothing is cached)."""
        with self._lock:
            cache = self._cache
        return cache is not None and cache.covers(key)

    def _get(self, key: str, cached: bool) -> Any:
        return self._cached().get(key)[0] if cached else self._kv.get(key)

    def _get_prefix(self, prefix: str, cached: bool) -> tuple[list[Any], int]:
        return self._cached().prefix(prefix) if cached else self._kv.get_prefix(prefix)
