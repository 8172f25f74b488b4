"""The etcd client's shared streams against a real etcd: all the watches of a client on one
Watch stream, keep-alives of all its leases on one LeaseKeepAlive stream. What etcd itself
counts (its /metrics, served on the client port) says how many streams there are."""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc  # type: ignore[import-untyped]
import pytest

from elasticpp.cluster.errors import ClusterUnavailableError, LeaseNotFoundError
from elasticpp.cluster.etcd.errors import is_token_error
from elasticpp.cluster.etcd.kv import (
    EtcdKV,
    WatchBatch,
    WatchEnded,
    WatchItem,
)
from elasticpp.cluster.etcd.server import EtcdServer, ServerTLS
from elasticpp.rpc.etcd.v3 import etcd_pb2 as pb
from elasticpp.waiting import wait_until
from tests.etcdtls import client_tls, make_certs

pytestmark = pytest.mark.timeout(120)


def _metric(server: EtcdServer, name: str) -> float:
    """One sample of etcd's Prometheus text: `name` with its labels, as in the exposition."""
    port = server.metrics_port if server.tls is not None else server.client_port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"etcd reports no {name}")


_WATCH_STREAMS = "etcd_debugging_mvcc_watch_stream_total"
_WATCHERS = "etcd_debugging_mvcc_watcher_total"
_KEEPALIVE_STREAMS = (
    'grpc_server_started_total{grpc_method="LeaseKeepAlive",'
    'grpc_service="etcdserverpb.Lease",grpc_type="bidi_stream"}'
)


class _Sink:
    """What one watch was handed."""

    def __init__(self) -> None:
        self.items: list[WatchItem] = []
        self._lock = threading.Lock()

    def __call__(self, item: WatchItem) -> None:
        with self._lock:
            self.items.append(item)

    def keys(self) -> list[str]:
        with self._lock:
            return [e.key for i in self.items if isinstance(i, WatchBatch) for e in i.events]

    def ends(self) -> list[WatchEnded]:
        with self._lock:
            return [i for i in self.items if isinstance(i, WatchEnded)]


@pytest.fixture
def kv(etcd: EtcdServer) -> Iterator[EtcdKV]:
    client = EtcdKV([etcd.endpoint])
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def thread_starts(monkeypatch: pytest.MonkeyPatch) -> Callable[[], int]:
    """How many threads this process started since the test began (gRPC's own included)."""
    started = [0]
    original = threading.Thread.start

    def start(self: threading.Thread) -> None:
        started[0] += 1
        original(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    return lambda: started[0]


def test_twenty_watches_of_one_client_share_one_etcd_watch_stream_and_a_few_threads(
    etcd: EtcdServer, kv: EtcdKV, thread_starts: Callable[[], int]
) -> None:
    start = kv.revision() + 1
    threads_before, started_before = threading.active_count(), thread_starts()
    sinks = [_Sink() for _ in range(20)]
    handles = [kv.add_watch(f"/m/{i}", None, start, sinks[i]) for i in range(20)]
    assert all(h >= 0 for h in handles)
    assert kv.requests()["Watch"] == 20
    # One reader and gRPC's consumer of the requests (and its channel thread): not per watch.
    assert thread_starts() - started_before <= 3
    assert threading.active_count() - threads_before <= 3
    assert _metric(etcd, _WATCH_STREAMS) == 1
    assert _metric(etcd, _WATCHERS) == 20

    for i in range(20):
        kv.put(f"/m/{i}", "1")
    assert wait_until(lambda: all(len(s.keys()) == 1 for s in sinks), 10)
    assert [s.keys() for s in sinks] == [[f"/m/{i}"] for i in range(20)]

    # Cancelling one leaves the others delivering; etcd's "canceled" answer is not an end.
    kv.cancel_watch(handles[3])
    assert wait_until(lambda: _metric(etcd, _WATCHERS) == 19, 10)
    for i in range(20):
        kv.put(f"/m/{i}", "2")
    others = [s for i, s in enumerate(sinks) if i != 3]
    assert wait_until(lambda: all(len(s.keys()) == 2 for s in others), 10)
    assert sinks[3].keys() == ["/m/3"] and sinks[3].ends() == []
    assert all(s.ends() == [] for s in sinks)
    assert _metric(etcd, _WATCH_STREAMS) == 1
    assert kv.requests()["WatchEvent"] == 39


def test_watches_created_at_once_from_many_threads_each_get_their_own_events(
    etcd: EtcdServer, kv: EtcdKV
) -> None:
    start = kv.revision() + 1
    sinks = [_Sink() for _ in range(12)]
    handles: dict[int, int] = {}

    def create(i: int) -> None:
        handles[i] = kv.add_watch(f"/p/{i}/", f"/p/{i}0", start, sinks[i])

    threads = [threading.Thread(target=create, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted(handles) == list(range(12)) and all(h >= 0 for h in handles.values())
    for i in range(12):
        kv.put(f"/p/{i}/k", str(i))
    assert wait_until(lambda: all(s.keys() for s in sinks), 10)
    assert [s.keys() for s in sinks] == [[f"/p/{i}/k"] for i in range(12)]
    assert _metric(etcd, _WATCH_STREAMS) == 1


def test_a_compacted_start_revision_ends_that_watch_only(etcd: EtcdServer, kv: EtcdKV) -> None:
    live = _Sink()
    kv.add_watch("/c/live", None, kv.revision() + 1, live)
    first = kv.put("/c/k", "1")
    newest = kv.put("/c/k", "2")
    kv.compact(newest)
    old = _Sink()
    # etcd 3.5 creates the watch and then cancels it as compacted: a handle or -1, and in
    # either case one WatchEnded naming the revision to resync from.
    handle = kv.add_watch("/c/k", None, first, old)
    assert wait_until(lambda: old.ends() != [], 10)
    assert old.ends() == [WatchEnded("revision compacted", newest)]
    kv.cancel_watch(handle)
    kv.put("/c/live", "1")
    assert wait_until(lambda: live.keys() == ["/c/live"], 10)
    assert live.ends() == [] and old.keys() == []
    assert _metric(etcd, _WATCH_STREAMS) == 1


def test_an_etcd_restart_ends_every_watch_once_and_new_watches_work_after(
    etcd: EtcdServer, kv: EtcdKV
) -> None:
    start = kv.revision() + 1
    sinks = [_Sink() for _ in range(5)]
    for i, sink in enumerate(sinks):
        kv.add_watch(f"/r/{i}", None, start, sink)
    etcd.restart()
    assert wait_until(lambda: all(s.ends() for s in sinks), 15)

    after = _Sink()

    def created() -> bool:
        try:
            return kv.add_watch("/r/after", None, None, after) >= 0
        except ClusterUnavailableError:
            return False  # gRPC reconnects within a second or so

    assert wait_until(created, 15, interval_s=0.2)
    kv.put("/r/after", "1")
    assert wait_until(lambda: after.keys() == ["/r/after"], 10)
    assert all(len(s.ends()) == 1 and s.ends()[0].reason.startswith("stream ended") for s in sinks)
    assert _metric(etcd, _WATCH_STREAMS) == 1  # a new stream, on the new etcd process


def test_two_leases_kept_alive_from_two_threads_share_one_stream(
    etcd: EtcdServer, kv: EtcdKV
) -> None:
    leases = [kv.grant(10), kv.grant(10)]
    ttls: dict[int, list[int]] = {lease: [] for lease in leases}
    failures: list[BaseException] = []

    def keep(lease: int) -> None:
        try:
            for _ in range(25):
                ttls[lease].append(kv.refresh(lease))
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=keep, args=(lease,)) for lease in leases]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert failures == []
    assert all(len(got) == 25 and all(0 < ttl <= 10 for ttl in got) for got in ttls.values())
    assert kv.requests()["LeaseKeepAlive"] == 50
    assert _metric(etcd, _KEEPALIVE_STREAMS) == 1

    kv.revoke(leases[0])
    with pytest.raises(LeaseNotFoundError):
        kv.refresh(leases[0])
    assert kv.refresh(leases[1]) > 0  # the stream still serves the other lease
    assert _metric(etcd, _KEEPALIVE_STREAMS) == 1


def test_a_hundred_refreshes_start_no_thread_and_no_stream(
    etcd: EtcdServer, kv: EtcdKV, thread_starts: Callable[[], int]
) -> None:
    lease = kv.grant(10)
    kv.refresh(lease)  # opens the stream
    threads_before, started_before = threading.active_count(), thread_starts()
    for _ in range(100):
        assert kv.refresh(lease) > 0
    assert thread_starts() == started_before
    assert threading.active_count() <= threads_before
    assert _metric(etcd, _KEEPALIVE_STREAMS) == 1


def test_keep_alives_work_again_on_a_new_stream_after_an_etcd_restart(
    etcd: EtcdServer, kv: EtcdKV
) -> None:
    lease = kv.grant(30)
    assert kv.refresh(lease) > 0
    etcd.restart()

    def refreshed() -> bool:
        try:
            return kv.refresh(lease) > 0
        except ClusterUnavailableError:
            return False

    assert wait_until(refreshed, 15, interval_s=0.2)
    assert _metric(etcd, _KEEPALIVE_STREAMS) == 1


def test_a_watch_refused_for_a_stale_token_renews_it_on_a_new_stream(tmp_path: Path) -> None:
    # Simple tokens lapse after --auth-token-ttl seconds without use; a live watch stream
    # keeps the token it was opened with, and etcd refuses new watches on it.
    # A password goes over TLS only (EtcdSecurity refuses it over plain gRPC).
    certs = make_certs(tmp_path / "certs")
    tls = ServerTLS(certs["ca.pem"], certs["server.pem"], certs["server.key"])
    server = EtcdServer(tmp_path / "etcd-auth", extra_args=("--auth-token-ttl=1",), tls=tls)
    try:
        server.start()
        server.enable_auth("s3cret")
        kv = EtcdKV([server.endpoint], security=client_tls(certs, user="root", password="s3cret"))
        try:
            start = kv.revision() + 1
            a, b, c, d = _Sink(), _Sink(), _Sink(), _Sink()
            handle_a = kv.add_watch("/s/a", None, start, a)  # etcd's watch 0 on the stream
            handle_b = kv.add_watch("/s/b", None, start, b)
            kv.cancel_watch(handle_a)

            # Without a live watch 0: the stream is retired and keeps watch b; c goes to a
            # new stream with a new token.
            _wait_token_lapsed(server, kv)
            logins = kv.requests()["Authenticate"]
            assert kv.add_watch("/s/c", None, start, c) >= 0
            assert kv.requests()["Authenticate"] == logins + 1
            for key in ("/s/b", "/s/c"):
                kv.put(key, "1")
            assert wait_until(lambda: b.keys() == ["/s/b"] and c.keys() == ["/s/c"], 10)
            assert _metric(server, _WATCH_STREAMS) == 2
            kv.cancel_watch(handle_b)  # the retired stream closes with its last watch
            assert wait_until(lambda: _metric(server, _WATCH_STREAMS) == 1, 10)

            # With a live watch 0 (c): etcd's refusal names it and would silence it, so the
            # stream ends (c gets its WatchEnded) and d is created on a new one.
            _wait_token_lapsed(server, kv)
            assert kv.add_watch("/s/d", None, start, d) >= 0
            assert wait_until(lambda: len(c.ends()) == 1, 10)
            assert "naming watch 0" in c.ends()[0].reason
            kv.put("/s/d", "1")
            assert wait_until(lambda: d.keys() == ["/s/d"], 10)
            assert wait_until(lambda: _metric(server, _WATCH_STREAMS) == 1, 10)
            assert [a.ends(), b.ends(), d.ends()] == [[], [], []]
        finally:
            kv.close()
    finally:
        server.close()


def _wait_token_lapsed(server: EtcdServer, kv: EtcdKV) -> None:
    """Until etcd forgot the token the client holds (asking uses it: poll slowly)."""
    token = kv._token  # the one its current watch stream was opened with
    assert token is not None
    creds = kv.security.channel_credentials()
    assert wait_until(lambda: _token_lapsed(server, token, creds), 20, interval_s=2.5)


def _token_lapsed(server: EtcdServer, token: str, creds: grpc.ChannelCredentials) -> bool:
    """True once etcd refuses `token` (asking uses it, so a live one lives on: poll slowly)."""
    with grpc.secure_channel(server.endpoint, creds) as channel:
        rpc = channel.unary_unary(
            "/etcdserverpb.KV/Range",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=pb.RangeResponse.FromString,
        )
        try:
            rpc(pb.RangeRequest(key=b"/s/"), timeout=5, metadata=[("token", token)])
        except grpc.RpcError as exc:
            return is_token_error(exc)
    return False
