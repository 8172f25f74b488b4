"""The wire side of elasticpp's etcd client (elasticpp.cluster.etcd.kv): etcd's gRPC
method names and reply types, the channel options, one endpoint's channel and streams
(`Endpoint`), and what the bench's meter counts of a call (`meter_request`) and of a
watch's batches (`metered`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from elasticpp.cluster.etcd.keepalive import KeepAliveStream
from elasticpp.cluster.etcd.meter import EtcdMeter, kind_of
from elasticpp.cluster.etcd.security import EtcdSecurity
from elasticpp.cluster.etcd.watch_stream import WatchBatch, WatchItem, WatchStream
from elasticpp.rpc.etcd.v3 import etcd_pb2 as pb

CHANNEL_OPTIONS = [
    # Reconnect quickly once etcd is back (gRPC's default backoff grows to 120 s).
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # Notice a silently dead connection (partition) under a long-lived watch stream;
    # etcd refuses pings more often than every 5 s.
    ("grpc.keepalive_time_ms", 10000),
    ("grpc.keepalive_timeout_ms", 5000),
]

RANGE = "/etcdserverpb.KV/Range"
PUT = "/etcdserverpb.KV/Put"
DELETE = "/etcdserverpb.KV/DeleteRange"
TXN = "/etcdserverpb.KV/Txn"
COMPACT = "/etcdserverpb.KV/Compact"
GRANT = "/etcdserverpb.Lease/LeaseGrant"
REVOKE = "/etcdserverpb.Lease/LeaseRevoke"
AUTHENTICATE = "/etcdserverpb.Auth/Authenticate"

REPLIES: dict[str, Any] = {
    RANGE: pb.RangeResponse,
    PUT: pb.PutResponse,
    DELETE: pb.DeleteRangeResponse,
    TXN: pb.TxnResponse,
    COMPACT: pb.CompactionResponse,
    GRANT: pb.LeaseGrantResponse,
    REVOKE: pb.LeaseRevokeResponse,
    AUTHENTICATE: pb.AuthenticateResponse,
}


class Endpoint:
    """One etcd endpoint's channel, when it last refused a call, and its streams (guarded by
    the client's lock; replaced when they end)."""

    def __init__(self, target: str, security: EtcdSecurity, options: list[Any]) -> None:
        self.target = target
        if security.tls:
            self.channel = grpc.secure_channel(target, security.channel_credentials(), options)
        else:
            self.channel = grpc.insecure_channel(target, options)
        self.failed_at_s = float("-inf")
        self._unary: dict[str, Any] = {}
        self.watch_stream: WatchStream | None = None
        self.keepalive: KeepAliveStream | None = None

    def unary(self, method: str) -> Any:
        call = self._unary.get(method)
        if call is None:
            reply = REPLIES[method]
            call = self.channel.unary_unary(
                method,
                request_serializer=lambda m: m.SerializeToString(),
                response_deserializer=reply.FromString,
            )
            self._unary[method] = call
        return call


def meter_request(meter: EtcdMeter, method: str, request: Any, reply: Any) -> None:
    """Count one unary call on `meter` (elasticpp.cluster.etcd.meter): its sizes and kind."""
    value, key = 0, b""
    if method == PUT:
        value, key = len(request.value), request.key
    elif method == TXN:
        puts = [op.request_put for op in request.success if op.HasField("request_put")]
        value = max((len(p.value) for p in puts), default=0)
        key = puts[0].key if puts else b""
    elif method in (RANGE, DELETE):
        key = request.key
    prefix = method == RANGE and bool(request.range_end)
    name = method.rsplit("/", 1)[-1].lower()
    meter.request(
        sent=request.ByteSize(),
        received=reply.ByteSize(),
        write=method in (PUT, TXN, DELETE),
        read=method == RANGE,
        prefix=prefix,
        value=value,
        kind=kind_of(name, key, prefix=prefix),
    )


def metered(sink: Callable[[WatchItem], None], meter: EtcdMeter) -> Callable[[WatchItem], None]:
    """`sink`, with every batch it is handed counted first."""

    def counted(item: WatchItem) -> None:
        if isinstance(item, WatchBatch):
            size = sum(len(e.key) + len(e.value or "") for e in item.events)
            meter.watched(len(item.events), size)
        sink(item)

    return counted
