"""Counts of what a process asks of etcd: requests and bytes by method, the largest value
written and the largest reply read, and the watch events delivered. Used by `bench/scale.py`
to measure the control plane; the agent runs without one (`EtcdKV(meter=None)`).

Invariants: one meter may be shared by every client of a process (its counters are updated
under a lock); it only counts, it never changes a request or a reply. Bytes are the protobuf
sizes of the messages (what crosses the wire, without gRPC's framing).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class MeterReading:
    """The counters at one moment; `minus` gives what happened between two readings."""

    requests: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    writes: int = 0
    range_reads: int = 0
    prefix_reads: int = 0
    watch_events: int = 0
    watch_bytes: int = 0
    largest_value: int = 0  # the largest value written in one put (or a transaction's put)
    largest_read: int = 0  # the largest range reply

    def minus(self, earlier: MeterReading) -> MeterReading:
        """The counts since `earlier` (the largest sizes are the process's, not a delta)."""
        return MeterReading(
            requests=self.requests - earlier.requests,
            bytes_sent=self.bytes_sent - earlier.bytes_sent,
            bytes_received=self.bytes_received - earlier.bytes_received,
            writes=self.writes - earlier.writes,
            range_reads=self.range_reads - earlier.range_reads,
            prefix_reads=self.prefix_reads - earlier.prefix_reads,
            watch_events=self.watch_events - earlier.watch_events,
            watch_bytes=self.watch_bytes - earlier.watch_bytes,
            largest_value=self.largest_value,
            largest_read=self.largest_read,
        )

    def plus(self, other: MeterReading) -> MeterReading:
        """Two processes' counts together."""
        return MeterReading(
            requests=self.requests + other.requests,
            bytes_sent=self.bytes_sent + other.bytes_sent,
            bytes_received=self.bytes_received + other.bytes_received,
            writes=self.writes + other.writes,
            range_reads=self.range_reads + other.range_reads,
            prefix_reads=self.prefix_reads + other.prefix_reads,
            watch_events=self.watch_events + other.watch_events,
            watch_bytes=self.watch_bytes + other.watch_bytes,
            largest_value=max(self.largest_value, other.largest_value),
            largest_read=max(self.largest_read, other.largest_read),
        )


class EtcdMeter:
    """Thread-safe counters, fed by `EtcdKV` (elasticpp.cluster.etcd.kv)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._now = MeterReading()
        self._by_kind: dict[str, int] = {}  # "range nodes/" -> requests

    def reading(self) -> MeterReading:
        with self._lock:
            return self._now

    def by_kind(self) -> dict[str, int]:
        """Requests so far by method and what they named (`kind_of`)."""
        with self._lock:
            return dict(self._by_kind)

    def request(
        self,
        *,
        sent: int,
        received: int,
        write: bool = False,
        prefix: bool = False,
        read: bool = False,
        value: int = 0,
        kind: str = "",
    ) -> None:
        """One request answered: its sizes, whether it wrote, whether it read a range (a
        prefix read or one key), the largest value it put, and what it was (`kind_of`)."""
        with self._lock:
            if kind:
                self._by_kind[kind] = self._by_kind.get(kind, 0) + 1
            n = self._now
            self._now = MeterReading(
                requests=n.requests + 1,
                bytes_sent=n.bytes_sent + sent,
                bytes_received=n.bytes_received + received,
                writes=n.writes + int(write),
                range_reads=n.range_reads + int(read),
                prefix_reads=n.prefix_reads + int(prefix),
                watch_events=n.watch_events,
                watch_bytes=n.watch_bytes,
                largest_value=max(n.largest_value, value),
                largest_read=max(n.largest_read, received if read else 0),
            )

    def watched(self, events: int, size: int) -> None:
        """One watch response delivered: its events and their keys' and values' bytes."""
        with self._lock:
            n = self._now
            self._now = MeterReading(
                **{
                    **n.__dict__,
                    "watch_events": n.watch_events + events,
                    "watch_bytes": n.watch_bytes + size,
                }
            )


def kind_of(method: str, key: bytes, *, prefix: bool) -> str:
    """A request's kind: the method and the key's first segment under the job's root, with
    node ids and generation numbers left out ("range barriers/", "put commits/")."""
    parts = key.decode(errors="replace").split("/")
    # /elasticpp/<job>/<segment>/...: the segment, and whether the read was of a prefix
    segment = parts[3] if len(parts) > 3 else key.decode(errors="replace")
    tail = "/" if (prefix or len(parts) > 4) and not segment.endswith("/") else ""
    return f"{method} {segment}{tail}"
