"""Many etcd watches over one bidirectional gRPC Watch stream, as etcd's own clients do.

A `WatchStream` is one Watch stream to one endpoint and one thread that reads it. Each
watcher on it is created by a WatchCreateRequest and known by the watch_id etcd gives it in
its `created` answer; etcd answers the create requests of one stream in the order they were
sent (and holds a watcher's events back until its `created` answer is out), so the answers
are matched to a FIFO of the creates not answered yet. Invariants:

- a watcher's sink gets a `WatchBatch` per response with events, then exactly one
  `WatchEnded` when the watcher stops: compacted (with the revision to resync from), cancelled
  by etcd (with its reason), or the stream ended or failed, which ends EVERY watcher on it;
  an ended stream takes no new watchers (`usable` is False): the client opens another;
- after `cancel(watcher)` its sink gets nothing more; the cancel goes to etcd on the same
  stream (once etcd has named the watcher), and etcd's `canceled` answer to it is dropped;
- a create etcd refuses (an empty range, permission denied) is not delivered to the sink:
  `create` returns it (`Watcher.refused`) for the client to retry or hand over. etcd 3.5
  answers a create refused for permission with the request's watch_id (0: we let etcd pick
  ids) and then forgets that id in its sender, so a live watcher 0 would get no event again,
  silently: such an answer naming a live watcher ends the whole stream instead;
- the reader thread only hands items to sinks, outside the stream's lock; a sink must not
  wait on this stream (it must not create a watch), or the stream stalls;
- `retire()` keeps the stream for the watchers it has and closes it when the last one goes
  (its token went stale: new watchers go to a new stream).

Re-creating a watch that ended is `watch.Watch`'s job.
"""

from __future__ import annotations

import collections
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from elasticpp.cluster.errors import ClusterUnavailableError
from elasticpp.cluster.etcd.errors import rpc_details
from elasticpp.cluster.records import EventType, WatchEvent
from elasticpp.rpc.etcd.v3 import etcd_pb2 as pb

WATCH_METHOD = "/etcdserverpb.Watch/Watch"


def open_stream(
    channel: Any,
    method: str,
    reply_type: Any,
    requests: queue.SimpleQueue[Any],
    metadata: list[tuple[str, str]] | None,
) -> Any:
    """A bidirectional call of `method` whose requests are what is put on `requests`, until
    a None ends them (the Watch and LeaseKeepAlive streams)."""

    def sent() -> Iterator[Any]:
        while (item := requests.get()) is not None:
            yield item

    return channel.stream_stream(
        method,
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=reply_type.FromString,
    )(sent(), metadata=metadata)


@dataclass(frozen=True)
class WatchBatch:
    """Events of one watch response (in revision order)."""

    events: tuple[WatchEvent, ...]


@dataclass(frozen=True)
class WatchEnded:
    """The watch ended; `compact_revision` > 0 when the start revision was compacted."""

    reason: str
    compact_revision: int = 0


WatchItem = WatchBatch | WatchEnded


class Watcher:
    """One watch on a `WatchStream`: its sink, and what etcd said when creating it."""

    def __init__(self, key: str, sink: Callable[[WatchItem], None]) -> None:
        self.key = key
        self.sink = sink
        self.watch_id: int | None = None  # etcd's, once created
        self.created_revision = 0  # the store's revision when etcd created the watch
        self.refused: WatchEnded | None = None  # etcd refused the create: why
        self.error: grpc.RpcError | ClusterUnavailableError | None = None  # the stream failed
        self.cancelled = False  # by us: nothing more goes to the sink
        self.settled = threading.Event()  # created, refused, or the stream failed


class WatchStream:
    """One Watch stream carrying many watchers, and the thread that reads it."""

    def __init__(
        self, channel: Any, metadata: list[tuple[str, str]] | None, name: str = "etcd-watch"
    ) -> None:
        self.metadata = metadata
        self._lock = threading.Lock()
        self._requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._pending: collections.deque[Watcher] = collections.deque()  # creates not answered
        self._watchers: dict[int, Watcher] = {}  # by etcd's watch_id
        self._ended = False
        self._retired = False
        self._end_reason: str | None = None  # why we ended it, when we did
        self._call = open_stream(channel, WATCH_METHOD, pb.WatchResponse, self._requests, metadata)
        self._thread = threading.Thread(target=self._read, name=name, daemon=True)
        self._thread.start()

    @property
    def usable(self) -> bool:
        """False once the stream ended or was retired: new watchers go to another."""
        with self._lock:
            return not self._ended and not self._retired

    def watcher_count(self) -> int:
        with self._lock:
            return len(self._watchers) + len(self._pending)

    def create(
        self, key: str, request: Any, sink: Callable[[WatchItem], None], timeout_s: float
    ) -> Watcher:
        """Create a watcher; returns it once etcd created it or refused it (`refused`).

        Raises the stream's gRPC error if it failed first, ClusterUnavailableError (fast)
        if the stream had ended, or ClusterUnavailableError when etcd did not answer within
        `timeout_s` (the watcher is then cancelled as soon as etcd names it)."""
        watcher = Watcher(key, sink)
        with self._lock:
            if self._ended:
                raise ClusterUnavailableError(f"etcd watch {key}: the stream ended", fast=True)
            # Appended and queued under one lock: the FIFO is in the order of the requests.
            self._pending.append(watcher)
            self._requests.put(pb.WatchRequest(create_request=request))
        if not watcher.settled.wait(timeout_s):
            self.cancel(watcher)
            raise ClusterUnavailableError(f"etcd watch {key}: not created within {timeout_s:g} s")
        if watcher.error is not None:
            raise watcher.error
        return watcher

    def cancel(self, watcher: Watcher) -> None:
        """Stop `watcher`: its sink gets nothing more. Never raises."""
        with self._lock:
            watcher.cancelled = True
            wid = watcher.watch_id
            if wid is not None and self._watchers.pop(wid, None) is not None and not self._ended:
                self._requests.put(
                    pb.WatchRequest(cancel_request=pb.WatchCancelRequest(watch_id=wid))
                )
            # A create not answered yet is cancelled when etcd names it (see _created).
            close = self._retired and not self._watchers and not self._pending
        if close:
            self.close()

    def retire(self) -> None:
        """Take no new watchers; close once the ones it has are gone."""
        with self._lock:
            self._retired = True
            close = not self._watchers and not self._pending
        if close:
            self.close()

    def close(self) -> None:
        """End the stream; no sink gets anything more."""
        with self._lock:
            self._ended = True
            for w in [*self._watchers.values(), *self._pending]:
                w.cancelled = True
        self._requests.put(None)
        self._call.cancel()

    # ------------------------------------------------------------------ the reader
    def _read(self) -> None:
        error: grpc.RpcError | None = None
        try:
            for reply in self._call:
                if reply.created:
                    self._created(reply)
                else:
                    self._answer(reply)
        except grpc.RpcError as exc:
            error = exc
        finally:
            self._end(error)

    def _created(self, reply: Any) -> None:
        with self._lock:
            if not self._pending:
                return  # an answer to no create of ours: nothing to match it to
            watcher = self._pending.popleft()
            abort = False
            if reply.canceled or reply.compact_revision > 0:
                watcher.refused = _ended(reply)
                wid = int(reply.watch_id)
                if wid in self._watchers and not self._ended:
                    # etcd no longer sends this live watcher's events (see the module doc).
                    abort = True
                    self._ended = True
                    self._end_reason = (
                        f"stream ended: etcd refused a watch on it ({reply.cancel_reason}) "
                        f"naming watch {wid}"
                    )
            else:
                wid = int(reply.watch_id)
                watcher.watch_id = wid
                watcher.created_revision = int(reply.header.revision)
                if watcher.cancelled:  # given up on while etcd created it
                    self._requests.put(
                        pb.WatchRequest(cancel_request=pb.WatchCancelRequest(watch_id=wid))
                    )
                else:
                    self._watchers[wid] = watcher
            close = self._retired and not self._watchers and not self._pending
        watcher.settled.set()
        if abort:
            self._call.cancel()  # the reader then ends every watcher (`_end`)
        elif close:
            self.close()

    def _answer(self, reply: Any) -> None:
        wid = int(reply.watch_id)
        ends = reply.canceled or reply.compact_revision > 0
        with self._lock:
            watcher = self._watchers.pop(wid, None) if ends else self._watchers.get(wid)
            close = ends and self._retired and not self._watchers and not self._pending
        if watcher is not None and not watcher.cancelled:
            if ends:
                watcher.sink(_ended(reply))
            elif reply.events:
                watcher.sink(WatchBatch(tuple(_event(ev) for ev in reply.events)))
        if close:
            self.close()

    def _end(self, error: grpc.RpcError | None) -> None:
        """The stream is over: creates in flight fail, every watcher gets its WatchEnded."""
        with self._lock:
            self._ended = True
            pending, self._pending = list(self._pending), collections.deque()
            watchers, self._watchers = list(self._watchers.values()), {}
        self._requests.put(None)  # ends gRPC's consumer of the requests
        self._call.cancel()
        for w in pending:
            w.error = error or ClusterUnavailableError(
                f"etcd watch {w.key}: the stream ended before the watch was created", fast=True
            )
            w.settled.set()
        if self._end_reason is not None:
            reason = self._end_reason
        elif error is None:
            reason = "stream ended"
        else:
            reason = f"stream ended: {error.code().name} {rpc_details(error)}"
        for w in watchers:
            if not w.cancelled:
                w.sink(WatchEnded(reason))


def _ended(reply: Any) -> WatchEnded:
    if reply.compact_revision > 0:
        return WatchEnded("revision compacted", int(reply.compact_revision))
    return WatchEnded(f"cancelled by etcd: {reply.cancel_reason}")


def _event(ev: Any) -> WatchEvent:
    kv = ev.kv
    if ev.type == pb.Event.DELETE:
        return WatchEvent(EventType.DELETE, kv.key.decode(), None, int(kv.mod_revision))
    return WatchEvent(
        EventType.PUT,
        kv.key.decode(),
        kv.value.decode(),
        int(kv.mod_revision),
        int(kv.create_revision),
        int(kv.lease),
    )
