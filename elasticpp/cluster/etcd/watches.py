"""The etcd client's watches (`WatchesPart`, a part of `EtcdKV`): every watch of a client
shares one Watch stream per endpoint (`watch_stream.WatchStream`); a watch is created
before `add_watch` returns and is cancelled by its handle. The reconnecting, revision-keeping
watch that callers use is `elasticpp.cluster.watch.Watch`, built on these."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc

from elasticpp.cluster.errors import ClusterUnavailableError
from elasticpp.cluster.etcd.endpoint import Endpoint, metered
from elasticpp.cluster.etcd.errors import is_token_error, is_watch_token_refusal, raise_mapped
from elasticpp.cluster.etcd.meter import EtcdMeter
from elasticpp.cluster.etcd.security import EtcdSecurity
from elasticpp.cluster.etcd.watch_stream import WatchBatch, Watcher, WatchItem, WatchStream
from elasticpp.rpc.etcd.v3 import etcd_pb2 as pb


class WatchesPart:
    """Methods of `EtcdKV` (elasticpp.cluster.etcd.kv); the state they use is set up
    there."""

    request_timeout_s: float
    security: EtcdSecurity
    _lock: threading.Lock
    _limits: tuple[int, int]
    _meter: EtcdMeter | None
    _watches: dict[int, tuple[WatchStream, Watcher]]  # by handle
    _watch_ids: itertools.count[int]

    if TYPE_CHECKING:  # defined by EtcdKV

        def _count(self, method: str, n: int = 1) -> None: ...

        def _endpoint(self) -> Endpoint: ...

        def _refused(self, ep: Endpoint) -> None: ...

        def _metadata(
            self, ep: Endpoint, *, renew: bool = False
        ) -> list[tuple[str, str]] | None: ...

        def _forget_token(self) -> None: ...

    def add_watch(
        self,
        key: str,
        range_end: str | None,
        start_revision: int | None,
        sink: Callable[[WatchItem], None],
    ) -> int:
        """Start a watch; `sink` gets WatchBatch items, then one WatchEnded when it stops.
        Returns a handle for `cancel_watch` (-1 when etcd refused the watch, a start revision
        it had compacted included: the sink has its WatchEnded already).

        The watch is created before this returns (a dead etcd raises here). `sink` runs on
        the reader thread of the Watch stream that all of this client's watches share: it
        must only hand the item over, never wait on this client."""
        request = pb.WatchCreateRequest(
            key=key.encode(),
            range_end=range_end.encode() if range_end is not None else b"",
            start_revision=start_revision or 0,
        )

        def counted(item: WatchItem) -> None:
            if isinstance(item, WatchBatch):
                self._count("WatchEvent", len(item.events))
            sink(item)

        deliver = counted if self._meter is None else metered(counted, self._meter)
        for attempt in range(2):
            renew = self.security.user is not None and attempt == 0
            ep = self._endpoint()
            try:
                stream = self._watch_stream(ep)
                self._count("Watch")
                watcher = stream.create(key, request, deliver, self.request_timeout_s)
            except ClusterUnavailableError as exc:
                if exc.fast:
                    self._refused(ep)
                raise
            except grpc.RpcError as exc:
                if renew and is_token_error(exc):
                    self._forget_token()
                    continue
                try:
                    raise_mapped(f"watch {key}", exc, self._limits)
                except ClusterUnavailableError as mapped:
                    if mapped.fast:
                        self._refused(ep)
                    raise
            if watcher.refused is not None:
                if renew and is_watch_token_refusal(watcher.refused.reason):
                    # The stream's token went stale: new watches go to a stream with a new one.
                    self._forget_token()
                    with self._lock:
                        if ep.watch_stream is stream:
                            ep.watch_stream = None
                    stream.retire()
                    continue
                deliver(watcher.refused)
                return -1
            handle = next(self._watch_ids)
            with self._lock:
                self._watches[handle] = (stream, watcher)
            return handle
        raise ClusterUnavailableError(f"etcd watch {key}: refused twice")  # not reached

    def watch_created_revision(self, watch_id: int) -> int:
        """The store's revision when etcd created watch `watch_id` (0 if unknown)."""
        with self._lock:
            entry = self._watches.get(watch_id)
        return entry[1].created_revision if entry is not None else 0

    def cancel_watch(self, watch_id: int) -> None:
        with self._lock:
            entry = self._watches.pop(watch_id, None)
        if entry is not None:
            stream, watcher = entry
            stream.cancel(watcher)  # never raises: the stream may be dead already

    def _watch_stream(self, ep: Endpoint) -> WatchStream:
        """The endpoint's Watch stream, opened if it has none that takes watchers."""
        with self._lock:
            stream = ep.watch_stream
            if stream is not None and stream.usable:
                return stream
        metadata = self._metadata(ep)
        with self._lock:
            stream = ep.watch_stream
            if stream is None or not stream.usable:
                stream = WatchStream(ep.channel, metadata, name=f"etcd-watch-{ep.target}")
                ep.watch_stream = stream
            return stream
