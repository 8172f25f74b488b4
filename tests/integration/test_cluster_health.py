"""Quarantine records and the job's end against a real etcd: fenced by the leader's term,
written once, and a value that cannot be read skipped (counted), never handed on."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from elasticpp.cluster.client import ClusterClient
from elasticpp.cluster.etcd.kv import EtcdKV
from elasticpp.cluster.etcd.server import EtcdServer
from elasticpp.cluster.health import QuarantineRecord
from elasticpp.waiting import wait_until

JOB = "job-health"


@pytest.fixture
def clients(no_orphans: None, etcd: EtcdServer) -> Iterator[Callable[[], ClusterClient]]:
    made: list[ClusterClient] = []

    def make() -> ClusterClient:
        client = ClusterClient([etcd.endpoint], JOB, request_timeout_s=1.0)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


def _record(node: str) -> QuarantineRecord:
    return QuarantineRecord(node, "disk full", 100.0, 160.0, 1, "inc-1")


def test_a_quarantine_is_written_only_in_the_leaders_term_and_lifted_by_anyone(
    clients: Callable[[], ClusterClient],
) -> None:
    a, b = clients(), clients()
    lead = a.campaign("n1", ttl_s=30)
    assert lead is not None
    assert a.health.quarantine(_record("n3"), lead)
    assert b.health.quarantined() == {"n3": _record("n3")}
    assert a.depose("n1")
    new = b.campaign("n2", ttl_s=30)
    assert new is not None
    assert not a.health.quarantine(_record("n4"), lead)  # the old term writes nothing
    assert set(b.health.quarantined()) == {"n3"}
    assert b.health.lift_quarantine("n3")  # an operator, through any agent
    assert not b.health.lift_quarantine("n3")
    assert b.health.quarantined() == {}


def test_the_job_ends_once_and_the_first_reason_stays(
    clients: Callable[[], ClusterClient],
) -> None:
    a, b = clients(), clients()
    assert a.health.job_end() is None
    first = a.health.end_job("halted", "step 7: loss nan", by="n1", step=6)
    second = b.health.end_job("failed", "failure budget spent", by="n2")
    assert second == first
    end = b.health.job_end()
    assert end is not None and (end.status, end.reason, end.step) == ("halted", first.reason, 6)


def test_a_following_node_reads_quarantines_and_the_end_from_its_cache(
    clients: Callable[[], ClusterClient],
) -> None:
    # A quarantine's watch event made every node read the quarantines and the end from etcd
    # (2,048 reads at 1,024 nodes); the event had already brought them into its cache.
    a, b = clients(), clients()
    events: list[str] = []
    b.follow(lambda e: events.append(e.key), own_node="n2")
    lead = a.campaign("n1", ttl_s=30)
    assert lead is not None
    assert a.health.quarantine(_record("n3"), lead)
    end = a.health.end_job("halted", "step 7: loss nan", by="n1", step=6)
    assert wait_until(lambda: a.keys.ended in events, 10, interval_s=0.01)
    before = b.etcd_requests()
    assert b.health.quarantined(cached=True) == {"n3": _record("n3")}
    assert b.health.job_end(cached=True) == end
    assert b.etcd_requests() == before  # no request: both from the cache


def test_unreadable_health_values_are_skipped_and_counted(
    clients: Callable[[], ClusterClient], etcd: EtcdServer
) -> None:
    a = clients()
    kv = EtcdKV([etcd.endpoint])
    try:
        root = f"/elasticpp/{JOB}/"
        kv.put(root + "quarantine/n5", '{"format_version": 1, "node_id": "n5", "count": null}')
        kv.put(
            root + "quarantine/n6",
            '{"format_version": 1, "node_id": "n7", "reason": "x", '
            '"since": 1, "until": 2, "count": 1, "incarnation": ""}',
        )
        kv.put(root + "ended", '{"format_version": 1, "status": "exploded"}')
    finally:
        kv.close()
    assert a.health.quarantined() == {}
    assert a.health.job_end() is None
    assert a.skipped_values == 3


def test_barrier_values_without_their_shape_are_skipped_and_counted_not_handed_on(
    clients: Callable[[], ClusterClient], etcd: EtcdServer
) -> None:
    """The review's A2: each of these reached the agent and raised in its loop every tick."""
    a = clients()
    root = f"/elasticpp/{JOB}/barriers/"

    def arrival(value: str) -> str:
        return '{"format_version": 1, "node_id": "x", "at": 1.0, "value": ' + value + "}"

    bad = {
        "done/x": arrival("null"),
        "started-3/x": arrival('"x"'),
        "stopped-3/x": arrival('{"holdings": 7, "next_step": 1, "at": 1.0}'),
        "failed-3/x": arrival('{"reason": "r", "at": "soon"}'),
        "resume-3/resume": arrival('{"step": 4, "fetches": {"0": [["only", "two"]]}}'),
        "timelines/gen-3": arrival("null"),
    }
    good = {
        "done/y": arrival('{"step": 5, "at": 1.0}'),
        "started-3/y": arrival('{"at": 2.0, "moved_at": 1.5}'),
        "failed-3/y": arrival('{"reason": "worker exited", "at": 1.0, "culprit": false}'),
    }
    kv = EtcdKV([etcd.endpoint])
    try:
        for key, value in {**bad, **good}.items():
            kv.put(root + key, value)
        kv.put(f"/elasticpp/{JOB}/nodes/n8", '{"format_version": 1, "node_id": "n8"}')
        kv.put(
            f"/elasticpp/{JOB}/nodes/n9",
            '{"format_version": 1, "node_id": "n9", "address": "h:1", "slots": null}',
        )
    finally:
        kv.close()
    assert a.arrivals.barrier_state("done")[0] == {"y": {"step": 5, "at": 1.0}}
    assert set(a.arrivals.barrier_state("started-3")[0]) == {"y"}
    assert set(a.arrivals.barrier_state("failed-3")[0]) == {"y"}
    assert a.arrivals.barrier_state("stopped-3")[0] == {}
    assert a.arrivals.barrier_state("resume-3")[0] == {}
    assert a.arrivals.barrier_state("timelines")[0] == {}
    assert a.agent_members().nodes == {}
    assert set(a.members().nodes) == {"n8", "n9"}  # the generic read is the cluster's own
    assert a.skipped_values == len(bad) + 2


def test_a_deposed_leader_writes_no_timeline_and_housekeeps_nothing(
    clients: Callable[[], ClusterClient],
) -> None:
    """The review's N21: the timeline put and housekeeping were unfenced leader writes."""
    a, b = clients(), clients()
    old = a.campaign("n1", ttl_s=30)
    assert old is not None
    for g in range(1, 8):
        a.arrivals.arrive(f"stopped-{g}", "n1", {"holdings": {}, "next_step": 0, "at": 1.0})
    assert a.depose("n1")
    assert b.campaign("n2", ttl_s=30) is not None
    assert not a.commits.record_timeline(7, {"generation": 7}, old)
    assert a.arrivals.barrier_state("timelines")[0] == {}
    assert a.commits.housekeep(7, leader=old) == 0
    assert set(a.arrivals.barrier_state("stopped-1")[0]) == {"n1"}  # nothing deleted
