"""Lease keep-alives over one long-lived LeaseKeepAlive stream to one endpoint.

`KeepAliveStream.refresh(lease_id, timeout_s)` sends one LeaseKeepAliveRequest on the stream
and waits for etcd's answer with that lease's ID. Invariants:

- several threads may refresh at once, the same lease or different ones: etcd answers each
  request once, in the order of the requests, so each lease has a FIFO of waiters and an
  answer goes to the oldest waiter of its ID;
- a request that times out stays in its lease's FIFO, abandoned: its late answer is taken by
  it, so a late answer is never taken for the answer to a later request (etcd would have
  renewed the lease at the earlier one, while the lease keeper's fencing counts from the
  later send instant). A late answer that renewed the lease (TTL > 0) is told to its
  caller's `on_late`, which may credit the renewal to that request's own send instant: on
  an overloaded etcd or process, answers that come after the timeout still keep the lease.
  One slow answer on a stream that many leases share (the simulated nodes of one process)
  fails only its own caller; a stream that answered nothing at all within the timeout is
  taken as stuck and ended;
- a stream error or the end of the stream ends the stream (`usable` False): every waiter on
  it fails, and the client opens a new stream for the next refresh;
- the reader thread only matches answers to waiters (and calls a late answer's `on_late`).
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from elasticpp.cluster.errors import ClusterUnavailableError
from elasticpp.cluster.etcd.watch_stream import open_stream
from elasticpp.rpc.etcd.v3 import etcd_pb2 as pb

KEEPALIVE_METHOD = "/etcdserverpb.Lease/LeaseKeepAlive"


class _Waiter:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.reply: Any = None
        self.error: grpc.RpcError | ClusterUnavailableError | None = None
        self.abandoned = False  # its caller timed out; its answer goes to `on_late`
        self.on_late: Callable[[], None] | None = None


class KeepAliveStream:
    """One LeaseKeepAlive stream and the thread that reads it."""

    def __init__(
        self, channel: Any, metadata: list[tuple[str, str]] | None, name: str = "etcd-keepalive"
    ) -> None:
        self.metadata = metadata
        self._lock = threading.Lock()
        self._requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._waiters: dict[int, collections.deque[_Waiter]] = {}
        self._ended = False
        self._answered_s = time.monotonic()  # when etcd last answered on this stream
        self._call = open_stream(
            channel, KEEPALIVE_METHOD, pb.LeaseKeepAliveResponse, self._requests, metadata
        )
        self._thread = threading.Thread(target=self._read, name=name, daemon=True)
        self._thread.start()

    @property
    def usable(self) -> bool:
        with self._lock:
            return not self._ended

    def refresh(
        self, lease_id: int, timeout_s: float, on_late: Callable[[], None] | None = None
    ) -> Any:
        """etcd's answer to one keep-alive of `lease_id` (TTL 0: no such lease). If it
        times out and an answer renewing the lease comes later, `on_late()` is called (on
        the reader thread: it must not block).

        Raises the stream's gRPC error if it failed, ClusterUnavailableError (fast) if it had
        ended, or ClusterUnavailableError when no answer came within `timeout_s`."""
        waiter, sent_s = self._post(lease_id, on_late)
        return self._answer(waiter, sent_s, timeout_s)

    def refresh_many(
        self,
        leases: Sequence[tuple[int, Callable[[], None] | None]],
        timeout_s: float,
    ) -> list[Any]:
        """One keep-alive of each `(lease_id, on_late)`, all sent before any is waited for;
        etcd's answer to each, in order, or the ClusterUnavailableError of one not answered
        within `timeout_s` of its send. Raises as `refresh` does when the stream has ended
        or failed (every keep-alive on it failed)."""
        posted = [self._post(lease_id, on_late) for lease_id, on_late in leases]
        out: list[Any] = []
        for waiter, sent_s in posted:
            left_s = max(0.0, sent_s + timeout_s - time.monotonic())
            try:
                out.append(self._answer(waiter, sent_s, left_s, timeout_s))
            except ClusterUnavailableError as exc:
                if exc.fast:
                    raise
                out.append(exc)
        return out

    def _post(self, lease_id: int, on_late: Callable[[], None] | None) -> tuple[_Waiter, float]:
        waiter = _Waiter()
        waiter.on_late = on_late
        with self._lock:
            if self._ended:
                raise ClusterUnavailableError("etcd lease keep-alive: the stream ended", fast=True)
            self._waiters.setdefault(lease_id, collections.deque()).append(waiter)
            self._requests.put(pb.LeaseKeepAliveRequest(ID=lease_id))
            sent_s = time.monotonic()
        return waiter, sent_s

    def _answer(
        self, waiter: _Waiter, sent_s: float, wait_s: float, timeout_s: float | None = None
    ) -> Any:
        """The answer of a posted keep-alive, waited for up to `wait_s` (its timeout,
        `timeout_s`, counts from its send)."""
        timeout_s = wait_s if timeout_s is None else timeout_s
        if not waiter.done.wait(wait_s):
            with self._lock:
                waiter.abandoned = True  # still queued: it takes its late answer
                stuck = self._answered_s < sent_s
            if stuck:  # nothing answered on the stream meanwhile: the next refresh opens another
                self.close()
            raise ClusterUnavailableError(
                f"etcd lease keep-alive: no answer within {timeout_s:g} s"
            )
        if waiter.error is not None:
            raise waiter.error
        return waiter.reply

    def close(self) -> None:
        with self._lock:
            self._ended = True
        self._requests.put(None)
        self._call.cancel()

    def _read(self) -> None:
        error: grpc.RpcError | None = None
        try:
            for reply in self._call:
                with self._lock:
                    self._answered_s = time.monotonic()
                    fifo = self._waiters.get(int(reply.ID))
                    waiter = fifo.popleft() if fifo else None
                    if fifo is not None and not fifo:
                        del self._waiters[int(reply.ID)]
                    late = waiter is not None and waiter.abandoned
                if waiter is not None:
                    waiter.reply = reply
                    waiter.done.set()
                    if late and waiter.on_late is not None and int(reply.TTL) > 0:
                        waiter.on_late()
        except grpc.RpcError as exc:
            error = exc
        finally:
            with self._lock:
                self._ended = True
                waiters = [w for fifo in self._waiters.values() for w in fifo]
                self._waiters = {}
            self._requests.put(None)  # ends gRPC's consumer of the requests
            self._call.cancel()
            for w in waiters:
                w.error = error or ClusterUnavailableError(
                    "etcd lease keep-alive: the stream ended", fast=True
                )
                w.done.set()
