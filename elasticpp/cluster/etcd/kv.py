"""The one module that calls etcd's v3 gRPC API: a thin client of our own.

It sends and reads the messages of `proto/elasticpp/rpc/etcd/v3/etcd.proto` (etcd's wire
format, the subset we use) by etcd's method names, over grpcio; everything above it is typed
(the typed operations and their encoding are `ops`).
Failures come out as `ClusterUnavailableError` (no answer within `request_timeout_s`; `fast`
when refused at once), `LeaseNotFoundError`, `ClusterLimitError` (over a message-size limit:
not an outage) and `ClusterAuthError` (elasticpp.cluster.etcd.errors).

Why our own: the etcd3 library line is unmaintained; its forks set no message limits, refuse an
endpoint for 300 s after one UNAVAILABLE answer and cannot combine client certificates with
token authentication. Here every call is bounded; idempotent calls refused at once are retried
for `retry_window_s` (gRPC's reconnect backoff is capped at 1 s, so calls work again about a
second after etcd is back), on the next endpoint if there are several; a transaction is never
sent twice. Message sizes are explicit. TLS and username/password (`security`): the token
is fetched on first use and again when etcd stops accepting it.

Streams, as etcd's own clients keep them: all the watches of a client share one Watch stream
per endpoint (`watch_stream`; creating and cancelling watches is `watches`), and its
lease keep-alives one LeaseKeepAlive stream per
endpoint (`keepalive`); each stream has one reader thread and lives until it fails, which
ends every watch on it (each gets its WatchEnded) or fails the keep-alives waiting on it; the
next call opens a new one. A stream carries the token of its creation: when etcd refuses a
watch's creation for it, the token is renewed, the stream retired (it keeps the watches it
has, unless etcd's refusal silenced one: then it ends) and the creation tried once more on a
new one.

Every request sent is counted by method (`requests()`: each unary call and each attempt of
it, each lease keep-alive, each watch created, and each event a watch delivers), so that the
agent can say what it costs etcd.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, TypeVar

import grpc

from elasticpp.cluster.errors import (
    ClusterError,
    ClusterLimitError,
    ClusterUnavailableError,
    LeaseNotFoundError,
)
from elasticpp.cluster.etcd.endpoint import (
    AUTHENTICATE,
    CHANNEL_OPTIONS,
    COMPACT,
    DELETE,
    GRANT,
    PUT,
    RANGE,
    REVOKE,
    TXN,
    Endpoint,
    meter_request,
)
from elasticpp.cluster.etcd.errors import is_token_error, raise_mapped
from elasticpp.cluster.etcd.keepalive import KeepAliveStream
from elasticpp.cluster.etcd.meter import EtcdMeter
from elasticpp.cluster.etcd.ops import (
    Compare,
    Delete,
    Put,
    byte_prefix_end,
    compare_msg,
    is_compacted,
    kv_of,
    op_msg,
)
from elasticpp.cluster.etcd.security import EtcdSecurity, parse_endpoint
from elasticpp.cluster.etcd.watch_stream import (
    WatchBatch,
    WatchEnded,
    Watcher,
    WatchItem,
    WatchStream,
)
from elasticpp.cluster.etcd.watches import WatchesPart
from elasticpp.cluster.records import KeyValue
from elasticpp.errors import ConfigError
from elasticpp.rpc.etcd.v3 import etcd_pb2 as pb

__all__ = [
    "Compare",
    "Delete",
    "EtcdKV",
    "EtcdSecurity",
    "Put",
    "WatchBatch",
    "WatchEnded",
    "WatchItem",
    "parse_endpoint",
]

log = logging.getLogger(__name__)

# etcd's default --max-request-bytes is 1.5 MiB; gRPC adds a little. A larger request is
# refused here, naming the key, instead of by the server.
DEFAULT_MAX_SEND_BYTES = 2 * 1024 * 1024
# gRPC's own default is 4 MiB; a reply over the limit is a ClusterLimitError naming the read.
DEFAULT_MAX_RECEIVE_BYTES = 16 * 1024 * 1024

# Keys per range reply: with records of a few hundred bytes (one per node) a reply stays far
# under 1 MiB; a larger range is read in pages at one revision (`EtcdKV.get_range`).
RANGE_PAGE_KEYS = 512
COMPACTED_RETRIES = 3  # a paged read whose revision was compacted meanwhile starts again
_R = TypeVar("_R")
_RETRY_PAUSE_S = 0.1


class EtcdKV(WatchesPart):
    """A thread-safe, typed view of one etcd cluster. Every call is bounded by
    `request_timeout_s` and raises `ClusterUnavailableError` when etcd does not answer."""

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        request_timeout_s: float = 2.0,
        retry_endpoint_s: float = 0.5,
        retry_window_s: float = 1.2,
        security: EtcdSecurity | None = None,
        max_send_bytes: int = DEFAULT_MAX_SEND_BYTES,
        max_receive_bytes: int = DEFAULT_MAX_RECEIVE_BYTES,
        meter: EtcdMeter | None = None,
        around_request: Callable[[], AbstractContextManager[None]] | None = None,
    ) -> None:
        if not endpoints:
            raise ConfigError("etcd endpoints: at least one host:port is required")
        if max_send_bytes <= 0 or max_receive_bytes <= 0:
            raise ConfigError("etcd message limits: both must be positive")
        self.request_timeout_s = request_timeout_s
        # Covers gRPC's reconnect backoff (capped at 1 s) after etcd comes back.
        self.retry_window_s = min(retry_window_s, request_timeout_s)
        self._retry_endpoint_s = retry_endpoint_s
        self.security = security or EtcdSecurity()
        self._limits = (max_send_bytes, max_receive_bytes)
        self._meter = meter  # counts requests and bytes (bench/scale.py); None: nothing counted
        # Entered on the calling thread around each request with its retries: a simulation
        # of many agents on a few threads (bench/scalesim.py) gives a waiting agent's thread
        # to another agent's turn meanwhile. None: nothing around it.
        self._around_request = around_request
        options = [
            *CHANNEL_OPTIONS,
            ("grpc.max_send_message_length", max_send_bytes),
            ("grpc.max_receive_message_length", max_receive_bytes),
        ]
        self._endpoints = []
        for text in endpoints:
            host, port = parse_endpoint(text, tls=self.security.tls)
            target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            self._endpoints.append(Endpoint(target, self.security, options))
        self._lock = threading.Lock()
        self._current = 0
        self._token: str | None = None
        self._watches: dict[int, tuple[WatchStream, Watcher]] = {}  # by handle
        self._watch_ids = itertools.count(1)
        self._sent: Counter[str] = Counter()  # requests by etcd method name (see requests())

    def _count(self, method: str, n: int = 1) -> None:
        with self._lock:
            self._sent[method] += n

    def requests(self) -> dict[str, int]:
        """Requests sent to etcd since this client started, by method ("Range", "Put",
        "Txn", "LeaseKeepAlive", "Watch" for a watch created, "WatchEvent" for an event a
        watch delivered, ...): every attempt counts, retries included."""
        with self._lock:
            return dict(self._sent)

    def close(self) -> None:
        with self._lock:
            streams: list[WatchStream | KeepAliveStream] = [s for s, _ in self._watches.values()]
            self._watches = {}
            for ep in self._endpoints:
                streams += [s for s in (ep.watch_stream, ep.keepalive) if s is not None]
                ep.watch_stream, ep.keepalive = None, None
        for stream in streams:
            stream.close()  # no sink gets anything more
        for ep in self._endpoints:
            ep.channel.close()

    # ------------------------------------------------------------------ plumbing
    def _endpoint(self) -> Endpoint:
        """The endpoint to use: the current one, unless it refused a call within
        `retry_endpoint_s` and another did not."""
        with self._lock:
            n = len(self._endpoints)
            now = time.monotonic()
            for i in range(n):
                ep = self._endpoints[(self._current + i) % n]
                if now - ep.failed_at_s >= self._retry_endpoint_s:
                    self._current = (self._current + i) % n
                    return ep
            # Every endpoint refused recently: the one that refused longest ago.
            ep = min(self._endpoints, key=lambda e: e.failed_at_s)
            self._current = self._endpoints.index(ep)
            return ep

    def _refused(self, ep: Endpoint) -> None:
        if len(self._endpoints) > 1:
            with self._lock:
                ep.failed_at_s = time.monotonic()

    def _metadata(self, ep: Endpoint, *, renew: bool = False) -> list[tuple[str, str]] | None:
        """The auth token for calls (fetched on first use, or again when `renew`)."""
        sec = self.security
        if sec.user is None:
            return None
        with self._lock:
            token = None if renew else self._token
        if token is None:
            self._count("Authenticate")
            try:
                reply = ep.unary(AUTHENTICATE)(
                    pb.AuthenticateRequest(name=sec.user, password=sec.password or ""),
                    timeout=self.request_timeout_s,
                )
            except grpc.RpcError as exc:
                raise_mapped(f"authenticate as {sec.user}", exc, self._limits)
            token = str(reply.token)
            with self._lock:
                self._token = token
        return [("token", token)]

    def _forget_token(self) -> None:
        with self._lock:
            self._token = None  # etcd restarted, or the token lapsed: log in again

    def _keepalive_stream(self, ep: Endpoint, metadata: Any) -> KeepAliveStream:
        """The endpoint's LeaseKeepAlive stream, opened if it has none that works."""
        with self._lock:
            stream = ep.keepalive
            if stream is None or not stream.usable:
                stream = KeepAliveStream(ep.channel, metadata, name=f"etcd-keepalive-{ep.target}")
                ep.keepalive = stream
            return stream

    def _unary(self, op: str, method: str, request: Any, *, retry: bool = True) -> Any:
        """One unary call (see `_attempts`)."""
        name = method.rsplit("/", 1)[-1]

        def call(ep: Endpoint, md: Any) -> Any:
            self._count(name)
            return ep.unary(method)(request, timeout=self.request_timeout_s, metadata=md)

        reply = self._attempts(op, call, retry=retry)
        if self._meter is not None:
            meter_request(self._meter, method, request, reply)
        return reply

    def _attempts(self, op: str, call: Callable[[Endpoint, Any], _R], *, retry: bool = True) -> _R:
        """`_tries` inside the `around_request` context, if there is one."""
        around = self._around_request
        if around is None:
            return self._tries(op, call, retry=retry)
        with around():
            return self._tries(op, call, retry=retry)

    def _tries(self, op: str, call: Callable[[Endpoint, Any], _R], *, retry: bool = True) -> _R:
        """Run `call(endpoint, auth metadata)`; with `retry`, a fast "unavailable" answer is
        retried for `retry_window_s` (on the next endpoint, if there are several).

        Only idempotent calls retry; a transaction whose answer was lost must not be sent
        twice (its compare would then fail). A token etcd no longer accepts is renewed and
        the call sent again: etcd refused it, so nothing was applied."""
        deadline = time.monotonic() + self.retry_window_s
        renewed = False
        while True:
            ep = self._endpoint()
            try:
                return call(ep, self._metadata(ep))
            except grpc.RpcError as exc:
                if self.security.user is not None and is_token_error(exc) and not renewed:
                    renewed = True
                    self._forget_token()
                    continue
                try:
                    raise_mapped(op, exc, self._limits)
                except ClusterUnavailableError as mapped:
                    if mapped.fast:
                        self._refused(ep)
                    if not retry or not mapped.fast or time.monotonic() >= deadline:
                        raise
            except ClusterUnavailableError as mapped:  # the authentication itself
                if not retry or not mapped.fast or time.monotonic() >= deadline:
                    raise
                self._refused(ep)
            time.sleep(_RETRY_PAUSE_S)  # pause between attempts, bounded by the deadline

    # ------------------------------------------------------------------ reads
    def get(self, key: str) -> KeyValue | None:
        reply = self._unary(f"get {key}", RANGE, pb.RangeRequest(key=key.encode()))
        return kv_of(reply.kvs[0]) if reply.kvs else None

    def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """All keys under `prefix` (sorted by key) and the store revision they were read at
        (in pages: see `get_range`)."""
        return self.get_range(prefix, byte_prefix_end(prefix.encode()).decode())

    def get_range(
        self, key: str, range_end: str, *, page_keys: int = RANGE_PAGE_KEYS
    ) -> tuple[list[KeyValue], int]:
        """Every key from `key` up to `range_end` (exclusive), sorted by key, and the store
        revision they were read at.

        Read in pages of `page_keys` keys, every page at the revision of the first: one
        snapshot, as one reply would be, while no reply grows with the cluster (a range of
        one record per node passed 1 MiB at a few hundred nodes). A page whose revision was
        compacted meanwhile starts the read again, at most `COMPACTED_RETRIES` times."""
        if page_keys < 1:
            raise ValueError(f"page_keys must be >= 1, got {page_keys}")
        end = range_end.encode()
        for attempt in range(COMPACTED_RETRIES + 1):
            out: list[KeyValue] = []
            start, revision = key.encode(), 0
            try:
                while True:
                    request = pb.RangeRequest(
                        key=start,
                        range_end=end,
                        limit=page_keys,
                        revision=revision,
                        sort_order=pb.RangeRequest.ASCEND,
                        sort_target=pb.RangeRequest.KEY,
                    )
                    reply = self._unary(f"get range {key}..{range_end}", RANGE, request)
                    if revision == 0:
                        revision = int(reply.header.revision)
                    out.extend(kv_of(kv) for kv in reply.kvs)
                    if not reply.more or not reply.kvs:
                        return out, revision
                    start = bytes(reply.kvs[-1].key) + b"\0"
            except ClusterUnavailableError as exc:
                if not is_compacted(exc):
                    raise
                if attempt == COMPACTED_RETRIES:
                    raise
                log.info("range %s: revision %d compacted between pages; read again", key, revision)
        raise AssertionError("unreachable")

    def revision(self, within: str = "\0") -> int:
        """The store's current revision, read as the header of a one-key read of `within`
        (a key a user confined to a prefix may read: any read's header has it)."""
        request = pb.RangeRequest(key=within.encode(), keys_only=True, limit=1)
        return int(self._unary("read revision", RANGE, request).header.revision)

    # ------------------------------------------------------------------ writes
    def put(self, key: str, value: str, lease_id: int | None = None) -> int:
        """Write `key`; returns the revision of the write."""
        request = pb.PutRequest(key=key.encode(), value=value.encode(), lease=lease_id or 0)
        self._check_size(f"put {key}", request)
        return int(self._unary(f"put {key}", PUT, request).header.revision)

    def delete(self, key: str) -> bool:
        reply = self._unary(f"delete {key}", DELETE, pb.DeleteRangeRequest(key=key.encode()))
        return int(reply.deleted) > 0

    def delete_prefix(self, prefix: str) -> int:
        raw = prefix.encode()
        request = pb.DeleteRangeRequest(key=raw, range_end=byte_prefix_end(raw))
        return int(self._unary(f"delete prefix {prefix}", DELETE, request).deleted)

    def compact(self, revision: int, *, physical: bool = False) -> bool:
        """Drop the history before `revision` (etcd keeps every revision until compacted);
        False if it was compacted that far already."""
        request = pb.CompactionRequest(revision=revision, physical=physical)
        try:
            self._unary(f"compact to revision {revision}", COMPACT, request)
        except ClusterUnavailableError as exc:
            if is_compacted(exc):
                return False
            raise
        return True

    def txn(
        self,
        compares: Sequence[Compare],
        success: Sequence[Put | Delete],
        failure_get: Sequence[str] = (),
    ) -> tuple[bool, list[KeyValue | None], int]:
        """All `compares` equal -> apply `success`; else read `failure_get` (one entry each).

        Returns (succeeded, what failure_get found, revision of the transaction)."""
        reply = self._txn(compares, success, failure_get)
        found: list[KeyValue | None] = []
        if not reply.succeeded:
            for r in reply.responses:
                if r.WhichOneof("response") == "response_range":
                    kvs = r.response_range.kvs
                    found.append(kv_of(kvs[0]) if kvs else None)
        return bool(reply.succeeded), found, int(reply.header.revision)

    def txn_deleting(self, compares: Sequence[Compare], ops: Sequence[Put | Delete]) -> int | None:
        """All `compares` equal -> apply `ops` in one transaction (one revision: a watcher
        of their keys gets one message). Returns the keys deleted, None if a compare failed."""
        reply = self._txn(compares, ops)
        if not reply.succeeded:
            return None
        return sum(
            int(r.response_delete_range.deleted)
            for r in reply.responses
            if r.WhichOneof("response") == "response_delete_range"
        )

    def _txn(
        self,
        compares: Sequence[Compare],
        success: Sequence[Put | Delete],
        failure_get: Sequence[str] = (),
    ) -> Any:
        request = pb.TxnRequest(
            compare=[compare_msg(c) for c in compares],
            success=[op_msg(p) for p in success],
            failure=[
                pb.RequestOp(request_range=pb.RangeRequest(key=k.encode())) for k in failure_get
            ],
        )
        self._check_size("txn", request)
        return self._unary("txn", TXN, request, retry=False)

    def _check_size(self, op: str, request: Any) -> None:
        size = request.ByteSize()
        if size > self._limits[0]:
            raise ClusterLimitError(
                f"etcd {op}: the request is {size} bytes, over this client's limit of "
                f"{self._limits[0]} (etcd refuses more than its --max-request-bytes, "
                "1.5 MiB by default)"
            )

    # ------------------------------------------------------------------ leases
    def grant(self, ttl_s: int) -> int:
        # A retried grant may leave an unused lease behind; it lapses after its TTL.
        reply = self._unary("lease grant", GRANT, pb.LeaseGrantRequest(TTL=int(ttl_s)))
        if reply.error:
            raise ClusterUnavailableError(f"etcd lease grant: {reply.error}")
        return int(reply.ID)

    def refresh(self, lease_id: int, on_late: Callable[[], None] | None = None) -> int:
        """Keep a lease alive once; returns its new TTL, raises LeaseNotFoundError if gone.

        Sent on the endpoint's LeaseKeepAlive stream, shared by every lease of this client
        (threads may refresh at once); no answer within `request_timeout_s` raises
        ClusterUnavailableError (a stream that answered nothing meanwhile is replaced at the
        next call), and an answer renewing the lease after that calls `on_late()` (see
        `keepalive`)."""

        def once(ep: Endpoint, metadata: Any) -> Any:
            self._count("LeaseKeepAlive")
            stream = self._keepalive_stream(ep, metadata)
            return stream.refresh(lease_id, self.request_timeout_s, on_late)

        result = self._renewed(lease_id, self._attempts("lease keep-alive", once))
        if isinstance(result, LeaseNotFoundError):
            raise result
        return result

    def _renewed(self, lease_id: int, reply: Any) -> int | LeaseNotFoundError:
        """A keep-alive's answer, metered: the lease's new TTL, or LeaseNotFoundError (etcd
        answers TTL 0 for a lease it no longer has)."""
        if self._meter is not None:
            received = 0 if reply is None else reply.ByteSize()
            self._meter.request(sent=12, received=received, kind="keepalive")
        ttl = int(reply.TTL) if reply is not None else 0
        return ttl if ttl > 0 else LeaseNotFoundError(f"lease {lease_id:x} not found")

    def refresh_many(
        self, leases: Sequence[tuple[int, Callable[[], None] | None]]
    ) -> list[int | ClusterError]:
        """`refresh` of several leases at once, for one thread that keeps them all: every
        keep-alive is sent before any answer is waited for. For each `(lease_id, on_late)`,
        in order: its new TTL, LeaseNotFoundError, or ClusterUnavailableError (no answer
        within `request_timeout_s`; a late answer that renewed it calls `on_late`). Raises
        ClusterUnavailableError when the stream failed (every keep-alive on it did)."""

        def once(ep: Endpoint, metadata: Any) -> list[Any]:
            self._count("LeaseKeepAlive", len(leases))
            stream = self._keepalive_stream(ep, metadata)
            return stream.refresh_many(leases, self.request_timeout_s)

        replies = self._attempts("lease keep-alive", once)
        out: list[int | ClusterError] = []
        for (lease_id, _), reply in zip(leases, replies, strict=True):
            out.append(reply if isinstance(reply, ClusterError) else self._renewed(lease_id, reply))
        return out

    def revoke(self, lease_id: int) -> None:
        self._unary("lease revoke", REVOKE, pb.LeaseRevokeRequest(ID=lease_id))
