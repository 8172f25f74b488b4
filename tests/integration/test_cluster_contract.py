"""The cluster port's contract: the same cases against the unit tests' fake
(`tests.fakes.MemoryKV`, under the real `ClusterClient`) and against a real etcd. What the
agent's unit tests learn from the fake holds for etcd as far as these cases go: the first
writer wins where it should, fenced writes need the term, a lapsed member writes nothing,
revisions move as etcd moves them, a cached read answers what etcd holds on the ranges a
node caches (the fake's MemoryCache against the real watch-fed cache)."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from elasticpp.cluster.barriers import RESUME_MEMBER, RESUME_WAIT_MEMBER
from elasticpp.cluster.client import ClusterClient
from elasticpp.cluster.errors import (
    ClusterUnavailableError,
    LeaseNotFoundError,
    MembershipLapsedError,
)
from elasticpp.cluster.etcd.kv import EtcdKV
from elasticpp.cluster.etcd.ops import Compare, Delete, Put
from elasticpp.cluster.etcd.server import EtcdServer
from elasticpp.cluster.records import QuarantineRecord, SafeStep
from tests.fakes import MemoryCache, MemoryKV, memory_cluster

_jobs = itertools.count()


@pytest.fixture(scope="module")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    server = EtcdServer(Path(tmp_path_factory.mktemp("contract")) / "etcd-data")
    try:
        server.start()
        yield server
    finally:
        server.close()


@pytest.fixture(params=["memory", "etcd"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def new_client(
    backend: str, request: pytest.FixtureRequest
) -> Iterator[Callable[[], ClusterClient]]:
    """Clients of one fresh job (every client of a test sees the same job's state)."""
    job = f"contract-{next(_jobs)}"
    made: list[ClusterClient] = []
    memory = MemoryKV()

    def make() -> ClusterClient:
        if backend == "memory":
            client = memory_cluster(job, memory)
        else:
            server: EtcdServer = request.getfixturevalue("etcd_server")
            client = ClusterClient([server.endpoint], job, request_timeout_s=2.0)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


@pytest.fixture
def kv(backend: str, request: pytest.FixtureRequest) -> Iterator[EtcdKV | MemoryKV]:
    if backend == "memory":
        yield MemoryKV()
        return
    server: EtcdServer = request.getfixturevalue("etcd_server")
    real = EtcdKV([server.endpoint], request_timeout_s=2.0)
    real.delete_prefix("/kv/")
    yield real
    real.close()


# ---------------------------------------------------------------------- the KV calls
def test_revisions_move_as_etcds_do(kv: EtcdKV | MemoryKV) -> None:
    first = kv.put("/kv/a", "1")
    second = kv.put("/kv/a", "2")
    got = kv.get("/kv/a")
    assert got is not None and second == first + 1
    assert (got.value, got.create_revision, got.mod_revision) == ("2", first, second)
    assert kv.revision() == second
    assert not kv.delete("/kv/none") and kv.revision() == second  # nothing changed
    kv.put("/kv/b/2", "x")
    kv.put("/kv/b/1", "y")
    kvs, at = kv.get_prefix("/kv/b/")
    assert [k.key for k in kvs] == ["/kv/b/1", "/kv/b/2"] and at == kv.revision()
    assert kv.delete_prefix("/kv/b/") == 2 and kv.get_prefix("/kv/b/")[0] == []


def test_a_transaction_is_one_revision_and_applies_only_when_its_compares_hold(
    kv: EtcdKV | MemoryKV,
) -> None:
    kv.put("/kv/t/old", "o")
    ok, found, revision = kv.txn(
        [Compare("/kv/t/new", "create", 0)],
        [Put("/kv/t/new", "n"), Put("/kv/t/other", "p")],
        ["/kv/t/new"],
    )
    new, other = kv.get("/kv/t/new"), kv.get("/kv/t/other")
    assert ok and found == [] and new is not None and other is not None
    assert new.mod_revision == other.mod_revision == revision
    ok, found, _ = kv.txn(
        [Compare("/kv/t/new", "create", 0)], [Put("/kv/t/new", "m")], ["/kv/t/new"]
    )
    assert not ok and found[0] is not None and found[0].value == "n"
    assert kv.txn([Compare("/kv/t/new", "value", "n")], [Delete("/kv/t/old")])[0]
    assert kv.get("/kv/t/old") is None
    deleted = kv.txn_deleting(
        [Compare("/kv/t/new", "mod", new.mod_revision)], [Delete("/kv/t/", prefix=True)]
    )
    assert deleted == 2
    assert kv.txn_deleting([Compare("/kv/t/new", "value", "n")], []) is None


def test_a_key_on_a_lease_goes_with_it(kv: EtcdKV | MemoryKV) -> None:
    lease = kv.grant(30)
    kv.put("/kv/l/k", "v", lease)
    got = kv.get("/kv/l/k")
    assert got is not None and got.lease_id == lease
    assert kv.txn([Compare("/kv/l/k", "lease", lease)], [])[0]
    assert kv.refresh(lease) > 0
    kv.revoke(lease)
    assert kv.get("/kv/l/k") is None
    with pytest.raises(LeaseNotFoundError):
        kv.put("/kv/l/k", "v", lease)
    with pytest.raises(LeaseNotFoundError):
        kv.refresh(lease)


# ---------------------------------------------------------------------- the cluster port
def test_the_spec_and_the_epoch_are_the_first_writers(
    new_client: Callable[[], ClusterClient],
) -> None:
    a, b = new_client(), new_client()
    assert a.put_spec_if_absent('{"spec": 1}') == '{"spec": 1}'
    assert b.put_spec_if_absent('{"spec": 2}') == '{"spec": 1}'
    assert a.epoch_if_absent(7, "n0").epoch == 7
    stored = b.epoch_if_absent(9, "n1")
    assert (stored.epoch, stored.created_by) == (7, "n0")


def test_a_members_arrival_lands_while_it_is_registered_and_never_after(
    new_client: Callable[[], ClusterClient],
) -> None:
    client = new_client()
    reg = client.register("n0", {"address": "h:1", "slots": 2, "incarnation": "aaa"}, 30)
    assert client.member_records(["n0", "n1"])["n0"]["slots"] == 2
    started = {"at": time.time(), "moved_at": time.time()}
    client.arrivals.arrive("started-1", "n0", started, lease_id=reg.lease_id)
    arrived, _ = client.arrivals.barrier_state("started-1")
    assert arrived == {"n0": started}
    client.arrivals.arrive("started-1", "n1", {"nonsense": True})  # the wrong shape: never seen
    assert client.arrivals.barrier_state("started-1")[0] == {"n0": started}
    lease = reg.lease_id
    reg.close()  # revoked: the member key is gone
    assert client.member_records(["n0"]) == {}
    with pytest.raises(MembershipLapsedError):
        client.arrivals.arrive("started-1", "n0", started, lease_id=lease)


def test_fenced_writes_need_the_term(new_client: Callable[[], ClusterClient]) -> None:
    a, b = new_client(), new_client()
    term = a.campaign("n0", 30)
    assert term is not None and b.campaign("n1", 30) is None
    assert b.leader() == "n0"
    record = QuarantineRecord("n2", "sick", time.time(), time.time() + 60, 1, "inc")
    assert a.health.quarantine(record, term)
    assert set(b.health.quarantined()) == {"n2"}
    safe, revision = b.commits.read_safe()
    assert safe is None
    assert a.commits.write_safe(SafeStep(1, 10), revision, term)
    assert not a.commits.write_safe(SafeStep(1, 12), revision, term)  # read again first
    safe, revision = b.commits.read_safe()
    assert safe is not None and (safe.generation, safe.step) == (1, 10)
    assert a.commits.record_timeline(1, {"phases": {}}, term)
    assert b.depose("n0")  # confirmed dead, say: the term is over
    assert not a.health.quarantine(record, term)
    assert not a.commits.write_safe(SafeStep(1, 12), revision, term)
    assert not a.commits.record_timeline(2, {"phases": {}}, term)
    assert b.leader() is None
    term.resign()


def test_the_resume_instruction_is_written_once_and_a_wait_never_over_it(
    new_client: Callable[[], ClusterClient],
) -> None:
    client = new_client()
    term = client.campaign("n0", 30)
    assert term is not None
    assert client.arrivals.write_resume_wait(2, "state of n3 not held", term)
    waits, _ = client.arrivals.barrier_state("resume-2")
    assert waits[RESUME_WAIT_MEMBER]["why"] == "state of n3 not held"
    instruction = {
        "format_version": 2,
        "step": 3,
        "pieces": {},
        "reshard": {},
        "reshard_by_node": {},
        "infos_by_node": {},
        "nodes": [],
        "by_node": {},
    }
    assert client.arrivals.write_resume(2, instruction, term)
    assert not client.arrivals.write_resume(2, {**instruction, "step": 4}, term)
    assert not client.arrivals.write_resume_wait(2, "too late", term)
    arrived, _ = client.arrivals.barrier_state("resume-2")
    assert arrived[RESUME_MEMBER]["step"] == 3  # the wait stays beside it, as it was
    term.resign()


def test_the_first_end_of_a_job_stays(new_client: Callable[[], ClusterClient]) -> None:
    a, b = new_client(), new_client()
    assert b.health.job_end() is None
    first = a.health.end_job("failed", "failure budget spent", "n0", 100)
    later = b.health.end_job("halted", "halted by an operator", "n1")
    assert later == first and b.health.job_end() == first
    assert a.health.reset_end() and a.health.job_end() is None


def test_a_cordon_is_written_once_read_by_every_client_and_deleted_by_uncordon(
    new_client: Callable[[], ClusterClient],
) -> None:
    a, b = new_client(), new_client()
    assert b.requests.cordoned() == {}
    created, first = a.requests.cordon("n2", "ops@host", "disk swap")
    assert created and (first.node_id, first.by, first.reason) == ("n2", "ops@host", "disk swap")
    again, held = b.requests.cordon("n2", "other@host", "another reason")
    assert not again and held == first  # the first cordon stays
    assert b.requests.cordoned() == {"n2": first}
    # A record filed under another node's id is not taken for that node's.
    a.reads.kv.put(a.keys.cordon("n3"), json.dumps(first.to_dict()))
    assert set(b.requests.cordoned()) == {"n2"}
    assert b.requests.uncordon("n2") and not b.requests.uncordon("n2")
    assert set(a.requests.cordoned()) == set()


def test_commit_records_are_read_back_and_housekeeping_keeps_the_newest(
    new_client: Callable[[], ClusterClient],
) -> None:
    client = new_client()
    client.commits.record_commit(1, "n0", 5, anchors=(4, 2), replicas={"n1": (4,)})
    client.commits.record_commit(2, "n0", 9)
    record = client.commits.commit_records(1)["n0"]
    assert (record.step, record.anchors, record.replicas) == (5, (4, 2), {"n1": (4,)})
    assert client.commits.committed_steps(2) == {"n0": 9} and client.commits.ever_committed()
    client.arrivals.arrive("done-1", "n0", {"step": 5})
    assert client.commits.housekeep(4, keep_history=1) > 0
    assert client.commits.commit_records(1) == {} and set(client.commits.commit_records(2)) == {
        "n0"
    }
    assert client.arrivals.barrier_state("done-1")[0] == {
        "n0": {"step": 5}
    }  # not a housekept barrier
    assert client.commits.housekeep(4, keep_history=1) == 0  # idempotent: nothing more to do


# ---------------------------------------------------------------------- cached reads
def _cached_client(backend: str, request: pytest.FixtureRequest, node: str) -> ClusterClient:
    """A client of a fresh job whose reads with cached=True come from `node`'s cache: the
    fake's MemoryCache, or the real watch-fed JobCache (`follow`)."""
    job = f"contract-{next(_jobs)}"
    if backend == "memory":
        memory = MemoryKV()
        client = memory_cluster(job, memory)
        client.reads.serve_from(MemoryCache(memory, client.keys, node))
        return client
    server: EtcdServer = request.getfixturevalue("etcd_server")
    client = ClusterClient([server.endpoint], job, request_timeout_s=2.0)
    client.follow(own_node=node)
    return client


def _eventually(condition: Callable[[], bool]) -> None:
    """Wait until `condition` holds: the watch delivers a write to the real cache a moment
    after etcd took it (the memory's cache answers at once)."""
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, "the cache never caught up with etcd"
        time.sleep(0.01)


def test_a_cached_read_answers_what_etcd_holds_on_the_ranges_a_node_caches(
    backend: str, request: pytest.FixtureRequest
) -> None:
    client = _cached_client(backend, request, "n1")
    try:
        keys = client.keys
        for node in ("n1", "n2"):
            record = f'{{"format_version": 1, "address": "{node}:1", "slots": 1}}'
            client.reads.kv.put(keys.node(node), record)
        client.arrivals.arrive("done", "n2", {"step": 4})
        client.arrivals.arrive("started-3", "n2", {"at": 1.0, "moved_at": 0.5})
        client.commits.record_commit(3, "n2", 5)
        # A follower's cache: the job's keys but the members (its own excepted), the commit
        # records and the stopped/started/failed arrivals, which it reads from etcd.
        assert client.reads.covered(keys.node("n1")) and not client.reads.covered(keys.node("n2"))
        assert not client.reads.covered(keys.commits_prefix)
        assert (
            client.arrivals.barrier_state("resume-3", cached=True)[0]
            == (client.arrivals.barrier_state("resume-3")[0])
        )
        with pytest.raises(ClusterUnavailableError, match="not cached here"):
            client.arrivals.barrier_state("stopped-3", cached=True)
        with pytest.raises(ClusterUnavailableError, match="not cached here"):
            client.members(cached=True)
        # The leader's cache holds them too.
        client.cache_for_leader(True)
        assert client.reads.covered(keys.node("n2")) and client.reads.covered(keys.commits_prefix)
        assert sorted(client.members(cached=True).nodes) == ["n1", "n2"]
        assert client.arrivals.barrier_state("started-3", cached=True)[0] == {
            "n2": {"at": 1.0, "moved_at": 0.5}
        }
        assert set(client.commits.commit_records(3, cached=True)) == {"n2"}
        client.cache_for_leader(False)
        assert not client.reads.covered(keys.node("n2"))
    finally:
        client.close()
