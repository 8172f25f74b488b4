"""The leases of one etcd client are kept by one thread (elasticpp.cluster.keepers,
`KeeperGroup`), against a real etcd: every lease outlives its TTL, the keep-alives due
together go together (`EtcdKV.refresh_many`), a lease stopped or lost leaves the others
kept, and the thread ends with the last one."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from elasticpp.cluster.errors import ClusterUnavailableError, LeaseNotFoundError
from elasticpp.cluster.etcd.kv import EtcdKV
from elasticpp.cluster.etcd.server import EtcdServer
from elasticpp.cluster.leases import Registration
from elasticpp.waiting import wait_until


@pytest.fixture
def kv(no_orphans: None, etcd: EtcdServer) -> Iterator[EtcdKV]:
    client = EtcdKV([etcd.endpoint], request_timeout_s=1.0)
    try:
        yield client
    finally:
        client.close()


def _renewed_after(reg: Registration, t_s: float) -> bool:
    """etcd answered a keep-alive of `reg`'s lease sent after monotonic `t_s`."""
    with reg._keeper._lock:
        return reg._keeper._sent_ok > t_s


def _lease_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("etcd-leases-")]


@pytest.mark.timeout(60)
def test_the_leases_of_a_client_are_kept_by_one_thread_past_their_ttl(kv: EtcdKV) -> None:
    before = len(_lease_threads())
    granted_s = time.monotonic()
    regs = [Registration(kv, f"/l/nodes/n{i}", f"n{i}", {}, ttl_s=3) for i in range(5)]
    assert len(_lease_threads()) == before + 1
    # Each lease renewed by a keep-alive sent a whole TTL after its grant: only keep-alives
    # can have kept the keys till then.
    assert wait_until(lambda: all(_renewed_after(r, granted_s + 3.0) for r in regs), 15.0)
    assert sorted(k.key for k in kv.get_prefix("/l/nodes/")[0]) == [
        f"/l/nodes/n{i}" for i in range(5)
    ]
    assert all(not r.may_have_lapsed() for r in regs)
    regs[0].close(revoke=False)  # stopped, not revoked: its key lapses, the others stay
    assert wait_until(lambda: kv.get("/l/nodes/n0") is None, 10.0, interval_s=0.1)
    gone_s = time.monotonic()
    assert wait_until(lambda: all(_renewed_after(r, gone_s) for r in regs[1:]), 10.0)
    assert len(kv.get_prefix("/l/nodes/")[0]) == 4
    for r in regs[1:]:
        r.close()
    assert wait_until(lambda: len(_lease_threads()) == before, 10.0, interval_s=0.05)
    assert kv.get_prefix("/l/nodes/")[0] == []  # revoked: gone at once


@pytest.mark.timeout(60)
def test_a_lease_lost_to_etcd_is_granted_again_and_the_others_are_untouched(kv: EtcdKV) -> None:
    regs = [Registration(kv, f"/g/nodes/n{i}", f"n{i}", {}, ttl_s=3) for i in range(3)]
    lost = regs[1].lease_id
    kv.revoke(lost)  # etcd forgets it: the keeper's next keep-alive says so
    assert wait_until(lambda: regs[1].lease_id != lost, 10.0, interval_s=0.05)
    assert wait_until(lambda: kv.get("/g/nodes/n1") is not None, 10.0, interval_s=0.05)
    found = kv.get("/g/nodes/n1")
    assert found is not None and found.lease_id == regs[1].lease_id
    regranted_s = time.monotonic()  # every lease, the new one too, renewed since
    assert wait_until(lambda: all(_renewed_after(r, regranted_s) for r in regs), 10.0)
    assert len(kv.get_prefix("/g/nodes/")[0]) == 3
    assert [r.lease_id for r in (regs[0], regs[2])] == [
        kv.get(f"/g/nodes/n{i}").lease_id  # type: ignore[union-attr]
        for i in (0, 2)
    ]
    for r in regs:
        r.close()


@pytest.mark.timeout(60)
def test_refresh_many_answers_each_lease_in_order(kv: EtcdKV, etcd: EtcdServer) -> None:
    live, gone = kv.grant(5), kv.grant(5)
    kv.revoke(gone)
    late: list[int] = []
    out = kv.refresh_many([(live, lambda: late.append(live)), (gone, None), (live, None)])
    assert out[0] == 5 and out[2] == 5
    assert isinstance(out[1], LeaseNotFoundError)
    assert late == []  # answered in time: no late credit
    etcd.kill()
    with pytest.raises(ClusterUnavailableError):
        kv.refresh_many([(live, None)])
