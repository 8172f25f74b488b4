"""The job's watch-fed cache as `ClusterClient` uses it: `follow` starts it, and reads with
`cached=True` are answered from it (`cache.JobCache`) with no request to etcd."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from elasticpp.cluster import keys as keymod
from elasticpp.cluster.cache import JobCache
from elasticpp.cluster.errors import ClusterUnavailableError
from elasticpp.cluster.etcd_client import EtcdKV
from elasticpp.cluster.records import WatchEvent


class CachedReadsPart:
    """Methods of `ClusterClient` (elasticpp.cluster.client)."""

    job: str
    keys: keymod.JobKeys
    _kv: EtcdKV
    _lock: threading.Lock
    _cache: JobCache | None

    def etcd_requests(self) -> dict[str, int]:
        """Requests this client sent to etcd, by method (`EtcdKV.requests`)."""
        return self._kv.requests()

    def follow(self, on_event: Callable[[WatchEvent], None] | None = None) -> None:
        """Start the job's watch-fed cache (once; four range reads, four watches), for
        reads with `cached=True`. `on_event` runs on a watch thread after each change."""
        with self._lock:
            if self._cache is not None:
                return
        cache = JobCache(self._kv, self.keys, on_event)
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

    def _get(self, key: str, cached: bool) -> Any:
        return self._cached().get(key)[0] if cached else self._kv.get(key)

    def _get_prefix(self, prefix: str, cached: bool) -> tuple[list[Any], int]:
        return self._cached().prefix(prefix) if cached else self._kv.get_prefix(prefix)
