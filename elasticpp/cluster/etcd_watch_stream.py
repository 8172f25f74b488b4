"""One etcd watch as one bidirectional gRPC stream of its own, read by a thread that only
hands items to its sink: `WatchBatch` per response with events, then one `WatchEnded` (a
compacted start revision says so, with the revision to resync from). After `cancel()` the
sink gets nothing more. Re-creating a watch that ended is `watch.Watch`'s job."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc  # type: ignore[import-untyped]

from elasticpp.cluster.errors import ClusterUnavailableError
from elasticpp.cluster.etcd_errors import rpc_details
from elasticpp.cluster.records import EventType, WatchEvent
from elasticpp.rpc.etcd.v3 import etcd_pb2 as pb

WATCH_METHOD = "/etcdserverpb.Watch/Watch"


@dataclass(frozen=True)
class WatchBatch:
    """Events of one watch response (in revision order)."""

    events: tuple[WatchEvent, ...]


@dataclass(frozen=True)
class WatchEnded:
    """The watch stream ended; `compact_revision` > 0 when the start revision was compacted."""

    reason: str
    compact_revision: int = 0


WatchItem = WatchBatch | WatchEnded


class WatchStream:
    """One watch: a bidirectional stream of its own and a thread that reads it. The thread
    only hands items to the sink; after `cancel()` it hands over nothing more."""

    def __init__(
        self,
        channel: Any,
        create: Any,
        metadata: list[tuple[str, str]] | None,
        sink: Callable[[WatchItem], None],
        key: str,
    ) -> None:
        self._sink = sink
        self._requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._requests.put(pb.WatchRequest(create_request=create))
        self._cancelled = threading.Event()
        self._created = threading.Event()
        self._outcome: tuple[bool, grpc.RpcError | None] = (False, None)
        self.created_revision = 0  # the store's revision when etcd created the watch
        self._call = channel.stream_stream(
            WATCH_METHOD,
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=pb.WatchResponse.FromString,
        )(self._request_iter(), metadata=metadata)
        self._thread = threading.Thread(target=self._read, name=f"etcd-watch-{key}", daemon=True)
        self._thread.start()

    def _request_iter(self) -> Iterator[Any]:
        while True:
            item = self._requests.get()
            if item is None:
                return
            yield item

    def wait_created(self, timeout_s: float) -> bool:
        """True once etcd created the watch; False if it refused the start revision as
        compacted (the sink has the WatchEnded); raises the stream's error, or
        DEADLINE_EXCEEDED-like unavailability when nothing came within `timeout_s`."""
        if not self._created.wait(timeout_s):
            raise ClusterUnavailableError(f"etcd watch: not created within {timeout_s:g} s")
        ok, error = self._outcome
        if error is not None:
            raise error
        return ok

    def _settle(self, ok: bool, error: grpc.RpcError | None = None) -> None:
        if not self._created.is_set():
            self._outcome = (ok, error)
            self._created.set()

    def _read(self) -> None:
        try:
            for reply in self._call:
                if reply.compact_revision > 0 or reply.canceled:
                    ended = WatchEnded(
                        "revision compacted"
                        if reply.compact_revision
                        else f"cancelled by etcd: {reply.cancel_reason}",
                        int(reply.compact_revision),
                    )
                    self._settle(False)
                    if not self._cancelled.is_set():
                        self._sink(ended)
                    return
                if reply.created:
                    self.created_revision = int(reply.header.revision)
                    self._settle(True)
                if reply.events and not self._cancelled.is_set():
                    self._sink(WatchBatch(tuple(_event(ev) for ev in reply.events)))
            if not self._cancelled.is_set():
                self._settle(True)
                self._sink(WatchEnded("stream ended"))
        except grpc.RpcError as exc:
            if not self._created.is_set():
                self._settle(False, exc)
            elif not self._cancelled.is_set():
                self._sink(WatchEnded(f"stream ended: {exc.code().name} {rpc_details(exc)}"))
        finally:
            self._requests.put(None)

    def cancel(self) -> None:
        self._cancelled.set()
        self._requests.put(None)
        self._call.cancel()


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
