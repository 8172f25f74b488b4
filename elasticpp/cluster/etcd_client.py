"""The one module that imports the etcd client library (`etcd3`, from cslab-etcd3).

It turns the library's calls into a small, typed surface and its many failure types into two:
`ClusterUnavailableError` (etcd did not answer within `request_timeout_s`) and
`LeaseNotFoundError` (a lease expired or was revoked). Everything above it is library-free.

Why the client is built by hand instead of with `etcd3.client()`: the library marks an endpoint
"failed" for 300 s after one UNAVAILABLE answer and then refuses to use it; after an etcd
restart that would keep us offline for five minutes. Endpoints here are retried after
`retry_endpoint_s`, and gRPC's reconnect backoff is capped at 1 s instead of 120 s, so calls
work again within about a second of etcd coming back.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import etcd3  # type: ignore[import-untyped]
import etcd3.etcdrpc  # type: ignore[import-untyped]
import etcd3.events  # type: ignore[import-untyped]
import etcd3.exceptions  # type: ignore[import-untyped]
import etcd3.transactions  # type: ignore[import-untyped]
import grpc  # type: ignore[import-untyped]

from elasticpp.cluster.errors import ClusterUnavailableError, LeaseNotFoundError
from elasticpp.cluster.records import EventType, KeyValue, WatchEvent
from elasticpp.errors import ConfigError

log = logging.getLogger(__name__)

_CHANNEL_OPTIONS = [
    # Reconnect quickly once etcd is back (gRPC's default backoff grows to 120 s).
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # Notice a silently dead connection (partition) under a long-lived watch stream;
    # etcd refuses pings more often than every 5 s.
    ("grpc.keepalive_time_ms", 10000),
    ("grpc.keepalive_timeout_ms", 5000),
]


def parse_endpoint(text: str) -> tuple[str, int]:
    """`host:port` or `http://host:port` -> (host, port)."""
    raw = text.strip()
    if raw.startswith("https://"):
        raise ConfigError(f"etcd endpoint {text!r}: TLS endpoints are not supported yet")
    raw = raw.removeprefix("http://").rstrip("/")
    host, sep, port = raw.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"etcd endpoint {text!r}: expected host:port, e.g. 127.0.0.1:2379")
    return host.strip("[]"), int(port)


@dataclass(frozen=True)
class Compare:
    """An equality test of a transaction: `target` is "value", "mod", "create" or "lease"
    (the id of the lease the key is on, 0 for none)."""

    key: str
    target: str
    value: str | int


@dataclass(frozen=True)
class Put:
    key: str
    value: str
    lease_id: int | None = None


@dataclass(frozen=True)
class Delete:
    key: str


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


class _LeaseCompare(etcd3.transactions.BaseCompare):  # type: ignore[misc]
    # The library has no compare on a key's lease (etcd >= 3.3 has); "is the key still on
    # my lease" is how a registration tells its own key from another agent's.
    def build_compare(self, compare: Any) -> None:
        compare.target = etcd3.etcdrpc.Compare.LEASE
        compare.lease = int(self.value)


def _raise_mapped(op: str, exc: BaseException) -> NoReturn:
    if isinstance(exc, grpc.RpcError):
        details = str(exc.details() if hasattr(exc, "details") else exc)
        if exc.code() == grpc.StatusCode.NOT_FOUND and "lease" in details:
            raise LeaseNotFoundError(f"etcd {op}: {details}") from None
        fast = exc.code() == grpc.StatusCode.UNAVAILABLE
        raise ClusterUnavailableError(
            f"etcd {op}: {exc.code().name} {details}", fast=fast
        ) from None
    # Connection refused / no endpoint: answered at once, worth another try.
    fast = isinstance(
        exc, etcd3.exceptions.ConnectionFailedError | etcd3.exceptions.NoServerAvailableError
    )
    raise ClusterUnavailableError(f"etcd {op}: {type(exc).__name__} {exc}", fast=fast) from None


@contextlib.contextmanager
def _mapped(op: str) -> Iterator[None]:
    try:
        yield
    except etcd3.exceptions.RevisionCompactedError:
        raise  # not an outage: the watch layer restarts from the compacted revision
    except (etcd3.exceptions.Etcd3Exception, grpc.RpcError) as exc:
        _raise_mapped(op, exc)


def _text(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


_R = TypeVar("_R")
_RETRY_PAUSE_S = 0.1


class EtcdKV:
    """A thread-safe, typed view of one etcd cluster. Every call is bounded by
    `request_timeout_s` and raises `ClusterUnavailableError` when etcd does not answer."""

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        request_timeout_s: float = 2.0,
        retry_endpoint_s: float = 0.5,
        retry_window_s: float = 1.2,
    ) -> None:
        if not endpoints:
            raise ConfigError("etcd endpoints: at least one host:port is required")
        self.request_timeout_s = request_timeout_s
        # Covers gRPC's reconnect backoff (capped at 1 s below) after etcd comes back.
        self.retry_window_s = min(retry_window_s, request_timeout_s)
        # With one endpoint there is nothing to fail over to: always try it (the library
        # would otherwise refuse every call for `time_retry` after one failure anywhere).
        time_retry_s = retry_endpoint_s if len(endpoints) > 1 else 0.0
        eps = []
        for text in endpoints:
            host, port = parse_endpoint(text)
            eps.append(
                etcd3.Endpoint(
                    host, port, secure=False, time_retry=time_retry_s, opts=_CHANNEL_OPTIONS
                )
            )
        self._client = etcd3.MultiEndpointEtcd3Client(
            endpoints=eps, timeout=request_timeout_s, failover=True
        )
        self._t = self._client.transactions

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._client.close()

    def _call(self, op: str, fn: Callable[[], _R], *, retry: bool = True) -> _R:
        """Run one library call, mapping its failures; with `retry`, a fast "unavailable"
        answer is retried for `retry_window_s`.

        Why retry: right after etcd comes back, gRPC's channel is still in reconnect backoff
        and refuses calls for up to a second. Only idempotent calls retry; a transaction
        whose answer was lost must not be sent twice (its compare would then fail)."""
        deadline = time.monotonic() + self.retry_window_s
        while True:
            try:
                with _mapped(op):
                    return fn()
            except ClusterUnavailableError as exc:
                if not retry or exc.fast is False or time.monotonic() >= deadline:
                    raise
            time.sleep(_RETRY_PAUSE_S)  # pause between attempts, bounded by the deadline

    # ------------------------------------------------------------------ reads
    def get(self, key: str) -> KeyValue | None:
        value, meta = self._call(f"get {key}", lambda: self._client.get(key))
        if meta is None:
            return None
        return KeyValue(key, _text(value), meta.mod_revision, meta.create_revision, meta.lease_id)

    def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """All keys under `prefix` (sorted by key) and the store revision they were read at."""
        resp = self._call(
            f"get prefix {prefix}",
            lambda: self._client.get_prefix_response(prefix, sort_order="ascend"),
        )
        kvs = [
            KeyValue(_text(kv.key), _text(kv.value), kv.mod_revision, kv.create_revision, kv.lease)
            for kv in resp.kvs
        ]
        return kvs, int(resp.header.revision)

    def revision(self) -> int:
        """The store's current revision."""
        resp = self._call("read revision", lambda: self._client.get_response("\0"))
        return int(resp.header.revision)

    # ------------------------------------------------------------------ writes
    def put(self, key: str, value: str, lease_id: int | None = None) -> int:
        """Write `key`; returns the revision of the write."""
        resp = self._call(f"put {key}", lambda: self._client.put(key, value, lease=lease_id))
        return int(resp.header.revision)

    def delete(self, key: str) -> bool:
        return bool(self._call(f"delete {key}", lambda: self._client.delete(key)))

    def delete_prefix(self, prefix: str) -> int:
        resp = self._call(f"delete prefix {prefix}", lambda: self._client.delete_prefix(prefix))
        return int(resp.deleted)

    def txn(
        self,
        compares: Sequence[Compare],
        success: Sequence[Put | Delete],
        failure_get: Sequence[str] = (),
    ) -> tuple[bool, list[KeyValue | None], int]:
        """All `compares` equal -> apply `success`; else read `failure_get` (one entry each).

        Returns (succeeded, what failure_get found, revision of the transaction)."""
        built: list[Any] = []
        for c in compares:
            kind = {
                "value": self._t.value,
                "mod": self._t.mod,
                "create": self._t.create,
                "lease": _LeaseCompare,
            }.get(c.target)
            if kind is None:
                raise ConfigError(f"compare target {c.target!r}: allowed value, mod, create, lease")
            built.append(kind(c.key) == c.value)
        ops = [
            self._t.delete(p.key)
            if isinstance(p, Delete)
            else self._t.put(p.key, p.value, lease=p.lease_id)
            for p in success
        ]
        gets = [self._t.get(k) for k in failure_get]
        ok, responses, revision = self._call(
            "txn", lambda: self._transaction(built, ops, gets), retry=False
        )
        found: list[KeyValue | None] = [r[0] if r else None for r in responses] if not ok else []
        return bool(ok), found, revision

    def _transaction(self, compare: list[Any], success: list[Any], failure: list[Any]) -> Any:
        # The library's transaction() drops the response header; the revision is the fencing
        # token of what we wrote (a won election's create revision), so read it ourselves.
        request = etcd3.etcdrpc.TxnRequest(
            compare=[c.build_message() for c in compare],
            success=self._client._ops_to_requests(success),
            failure=self._client._ops_to_requests(failure),
        )
        try:
            resp = self._client.kvstub.Txn(
                request,
                self.request_timeout_s,
                credentials=self._client.call_credentials,
                metadata=self._client.metadata,
            )
        except grpc.RpcError as exc:
            # Same endpoint bookkeeping as the library's own calls (failover, stub reset).
            with contextlib.suppress(Exception):
                self._client._manage_grpc_errors(exc)
            raise
        found = [
            [
                KeyValue(
                    _text(kv.key),
                    _text(kv.value),
                    int(kv.mod_revision),
                    int(kv.create_revision),
                    int(kv.lease),
                )
                for kv in r.response_range.kvs
            ]
            for r in resp.responses
            if r.WhichOneof("response") == "response_range"
        ]
        return resp.succeeded, found, int(resp.header.revision)

    # ------------------------------------------------------------------ leases
    def grant(self, ttl_s: int) -> int:
        # A retried grant may leave an unused lease behind; it lapses after its TTL.
        return int(self._call("lease grant", lambda: self._client.lease(int(ttl_s))).id)

    def refresh(self, lease_id: int) -> int:
        """Keep a lease alive once; returns its new TTL, raises LeaseNotFoundError if gone."""
        responses = self._call(
            "lease keep-alive", lambda: list(self._client.refresh_lease(lease_id))
        )
        ttl = int(responses[0].TTL) if responses else 0
        if ttl <= 0:  # etcd answers TTL 0 for a lease it no longer has
            raise LeaseNotFoundError(f"lease {lease_id:x} not found")
        return ttl

    def revoke(self, lease_id: int) -> None:
        self._call("lease revoke", lambda: self._client.revoke_lease(lease_id))

    # ------------------------------------------------------------------ watches
    def add_watch(
        self,
        key: str,
        range_end: str | None,
        start_revision: int | None,
        sink: Callable[[WatchItem], None],
    ) -> int:
        """Start a watch; `sink` gets WatchBatch items, then one WatchEnded when it stops.

        `sink` runs on the library's shared watch thread: it must only hand the item over.
        """

        def on_response(resp: Any) -> None:
            if isinstance(resp, etcd3.exceptions.RevisionCompactedError):
                sink(WatchEnded("revision compacted", int(resp.compacted_revision)))
            elif isinstance(resp, grpc.RpcError):
                sink(WatchEnded(f"stream ended: {resp.code().name} {resp.details()}"))
            elif isinstance(resp, BaseException) or resp is None or not hasattr(resp, "events"):
                sink(WatchEnded(f"stream ended: {resp!r}"))
            else:
                sink(WatchBatch(tuple(_event(ev) for ev in resp.events)))

        kwargs: dict[str, Any] = {}
        if range_end is not None:
            kwargs["range_end"] = range_end
        if start_revision is not None:
            kwargs["start_revision"] = start_revision
        try:
            with _mapped(f"watch {key}"):
                return int(self._client.add_watch_callback(key, on_response, **kwargs))
        except etcd3.exceptions.RevisionCompactedError as exc:  # raised before mapping
            sink(WatchEnded("revision compacted", int(exc.compacted_revision)))
            return -1

    def cancel_watch(self, watch_id: int) -> None:
        if watch_id < 0:
            return
        # Cancelling a watch of a dead stream is a no-op; never let it raise.
        with contextlib.suppress(Exception):
            self._client.cancel_watch(watch_id)


def _event(ev: Any) -> WatchEvent:
    if isinstance(ev, etcd3.events.DeleteEvent):
        return WatchEvent(EventType.DELETE, _text(ev.key), None, int(ev.mod_revision))
    return WatchEvent(EventType.PUT, _text(ev.key), _text(ev.value), int(ev.mod_revision))
