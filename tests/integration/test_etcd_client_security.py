"""The etcd client against a real etcd: TLS with client certificates (made by openssl),
username/password authentication with token renewal, explicit message limits, compaction."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from elasticpp.cluster.errors import (
    ClusterAuthError,
    ClusterLimitError,
    ClusterUnavailableError,
)
from elasticpp.cluster.etcd.kv import (
    Compare,
    EtcdKV,
    EtcdSecurity,
    Put,
    WatchBatch,
    WatchEnded,
    WatchItem,
)
from elasticpp.cluster.etcd.server import EtcdServer, ServerTLS
from elasticpp.cluster.records import WatchEvent
from elasticpp.cluster.watch import Watch
from elasticpp.errors import ConfigError
from elasticpp.waiting import wait_until
from tests.etcdtls import client_tls


@pytest.fixture
def tls_etcd(tmp_path: Path, certs: dict[str, Path]) -> Iterator[EtcdServer]:
    tls = ServerTLS(certs["ca.pem"], certs["server.pem"], certs["server.key"])
    server = EtcdServer(tmp_path / "etcd-tls", tls=tls)
    try:
        yield server.start()
    finally:
        server.close()


def test_tls_with_a_client_certificate_reads_writes_watches_and_keeps_leases(
    tls_etcd: EtcdServer, certs: dict[str, Path]
) -> None:
    kv = EtcdKV([tls_etcd.endpoint], security=client_tls(certs))
    items: list[WatchItem] = []
    seen = threading.Event()

    def sink(item: WatchItem) -> None:
        items.append(item)
        seen.set()

    try:
        start = kv.revision() + 1
        handle = kv.add_watch("/t/", "/t0", start, sink)
        lease = kv.grant(5)
        kv.put("/t/a", "1", lease_id=lease)
        assert kv.refresh(lease) > 0
        ok, _, _ = kv.txn([Compare("/t/a", "value", "1")], [Put("/t/b", "2")])
        assert ok
        assert [k.key for k in kv.get_prefix("/t/")[0]] == ["/t/a", "/t/b"]
        assert wait_until(
            lambda: sum(len(i.events) for i in items if isinstance(i, WatchBatch)) == 2, 10
        )
        kv.cancel_watch(handle)
    finally:
        kv.close()


def test_tls_refuses_a_client_without_a_certificate_of_its_ca(
    tls_etcd: EtcdServer, certs: dict[str, Path]
) -> None:
    stranger = EtcdSecurity(
        ca_file=certs["ca.pem"], cert_file=certs["stranger.pem"], key_file=certs["stranger.key"]
    )
    for security in (stranger, EtcdSecurity(ca_file=certs["ca.pem"])):
        kv = EtcdKV([tls_etcd.endpoint], security=security, request_timeout_s=1.0)
        try:
            with pytest.raises(ClusterUnavailableError):
                kv.put("/t/x", "1")
        finally:
            kv.close()
    # And a plain-text client gets nowhere either.
    kv = EtcdKV([tls_etcd.endpoint], request_timeout_s=1.0)
    try:
        with pytest.raises(ClusterUnavailableError):
            kv.get("/t/x")
    finally:
        kv.close()


def test_bad_security_settings_are_refused_naming_the_problem(
    tmp_path: Path, certs: dict[str, Path]
) -> None:
    with pytest.raises(ConfigError, match="both the certificate and its key"):
        EtcdSecurity(ca_file=certs["ca.pem"], cert_file=certs["client.pem"])
    with pytest.raises(ConfigError, match="no such file"):
        EtcdSecurity(ca_file=tmp_path / "missing.pem")
    with pytest.raises(ConfigError, match="both the user and the password"):
        EtcdSecurity(user="root")


def test_F14_a_password_is_never_printed_and_never_sent_in_clear_text(
    tmp_path: Path, certs: dict[str, Path]
) -> None:
    """The review's F14: `repr(EtcdSecurity(user="root", password="hunter2"))` printed the
    password, and a password without TLS was accepted (etcd's AuthenticateRequest then
    travels in clear text)."""
    secured = EtcdSecurity(ca_file=certs["ca.pem"], user="root", password="hunter2")
    assert "hunter2" not in repr(secured) and "hunter2" not in str(secured)
    with pytest.raises(ConfigError, match="only over TLS"):
        EtcdSecurity(user="root", password="hunter2")
    (tmp_path / "pw").write_text("hunter2\n")
    read = EtcdSecurity.from_files(
        ca_file=certs["ca.pem"], user="root", password_file=tmp_path / "pw"
    )
    assert read is not None and read.password == "hunter2"  # the file's line, its newline cut
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="empty"):
        EtcdSecurity.from_files(
            ca_file=certs["ca.pem"], user="root", password_file=tmp_path / "empty"
        )
    with pytest.raises(ConfigError, match="cannot read"):
        EtcdSecurity.from_files(ca_file=certs["ca.pem"], user="root", password_file=tmp_path / "no")
    assert EtcdSecurity.from_files() is None
    with pytest.raises(ConfigError, match="needs the etcd CA file"):
        EtcdKV(["https://127.0.0.1:2379"])
    with pytest.raises(ConfigError, match="endpoint is http"):
        EtcdKV(["http://127.0.0.1:2379"], security=EtcdSecurity(ca_file=certs["ca.pem"]))


def test_username_and_password_over_tls_and_the_token_is_renewed_after_a_restart(
    tls_etcd: EtcdServer, certs: dict[str, Path]
) -> None:
    tls_etcd.enable_auth("s3cret")
    kv = EtcdKV([tls_etcd.endpoint], security=client_tls(certs, user="root", password="s3cret"))
    wrong = EtcdKV([tls_etcd.endpoint], security=client_tls(certs, user="root", password="nope"))
    events: list[WatchEvent] = []
    try:
        kv.put("/a/k", "1")
        watch = Watch(kv, "/a/", events.append, prefix=True, start_revision=None)
        # Simple tokens live in the server's memory: after a restart the old one is invalid,
        # and the client logs in again instead of failing the call.
        tls_etcd.restart()
        assert wait_until(lambda: _answers(kv), 15)
        kv.put("/a/k", "2")
        got = kv.get("/a/k")
        assert got is not None and got.value == "2"
        # The watch's stream ended with the restart; it is created again with a new token.
        assert wait_until(lambda: any(e.value == "2" for e in events), 15)
        watch.cancel()
        with pytest.raises(ClusterAuthError, match="authenticate as root"):
            wrong.get("/a/k")
    finally:
        kv.close()
        wrong.close()


def _answers(kv: EtcdKV) -> bool:
    try:
        kv.revision()
    except ClusterUnavailableError:
        return False
    return True


def test_a_request_or_a_reply_over_the_limits_is_a_limit_error_not_an_outage(
    etcd: EtcdServer,
) -> None:
    kv = EtcdKV([etcd.endpoint])
    small = EtcdKV([etcd.endpoint], max_receive_bytes=64 * 1024)
    try:
        with pytest.raises(ClusterLimitError, match="/big/one"):
            kv.put("/big/one", "x" * (3 * 1024 * 1024))
        assert kv.get("/big/one") is None  # nothing was written
        with pytest.raises(ClusterLimitError):
            kv.txn([], [Put("/big/two", "x" * (3 * 1024 * 1024))])
        for i in range(4):
            kv.put(f"/big/{i}", "y" * 30_000)
        with pytest.raises(ClusterLimitError, match="get range /big/"):
            small.get_prefix("/big/")
        assert len(kv.get_prefix("/big/")[0]) == 4  # the default limit reads it
    finally:
        kv.close()
        small.close()


def test_a_watch_from_a_compacted_revision_ends_saying_so(etcd: EtcdServer) -> None:
    kv = EtcdKV([etcd.endpoint])
    items: list[WatchItem] = []
    try:
        first = kv.put("/c/k", "1")
        kv.put("/c/k", "2")
        newest = kv.put("/c/k", "3")
        kv.compact(newest)
        handle = kv.add_watch("/c/k", None, first, items.append)
        assert wait_until(lambda: any(isinstance(i, WatchEnded) for i in items), 10)
        ended = next(i for i in items if isinstance(i, WatchEnded))
        assert ended.compact_revision == newest
        kv.cancel_watch(handle)
        # From the compacted revision on, the watch sees what comes next.
        seen: list[WatchItem] = []
        handle = kv.add_watch("/c/k", None, newest + 1, seen.append)
        kv.put("/c/k", "4")
        assert wait_until(lambda: any(isinstance(i, WatchBatch) for i in seen), 10)
        kv.cancel_watch(handle)
    finally:
        kv.close()
