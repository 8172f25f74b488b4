"""ClusterClient against a real etcd: leases, election, generation CAS, watches through an
etcd restart, barriers, and behaviour while etcd is down."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from elasticpp.cluster.client import ClusterClient
from elasticpp.cluster.errors import (
    BarrierTimeoutError,
    ClusterUnavailableError,
    GenerationConflictError,
    MembershipLapsedError,
)
from elasticpp.cluster.etcd.kv import EtcdKV, WatchEnded, WatchItem
from elasticpp.cluster.etcd.meter import EtcdMeter
from elasticpp.cluster.etcd.server import EtcdServer
from elasticpp.cluster.leases import Leadership, ProgressGate, Registration
from elasticpp.cluster.records import (
    EventType,
    GenerationRecord,
    GenerationSummary,
    JobEpoch,
    WatchEvent,
    propose_epoch,
)
from elasticpp.waiting import wait_until

JOB = "job-test"


def wait_for(cond: Callable[[], bool], timeout_s: float = 10.0, what: str = "condition") -> None:
    """Poll `cond` until true; fail the test at the deadline."""
    if not wait_until(cond, timeout_s, interval_s=0.02):
        pytest.fail(f"timed out after {timeout_s} s waiting for {what}")


def reachable(fn: Callable[[], Any]) -> Callable[[], bool]:
    """`fn` as a condition: False while etcd is unreachable."""

    def check() -> bool:
        try:
            return bool(fn())
        except ClusterUnavailableError:
            return False

    return check


@pytest.fixture
def clients(no_orphans: None, etcd: EtcdServer) -> Iterator[Callable[[], ClusterClient]]:
    """Factory of clients on the test's etcd; all closed at teardown."""
    made: list[ClusterClient] = []

    def make() -> ClusterClient:
        client = ClusterClient([etcd.endpoint], JOB, request_timeout_s=1.0)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


def record(generation: int, leader: str) -> GenerationRecord:
    return GenerationRecord(generation, {"nodes": generation}, leader, time.time(), resume_step=0)


# ---------------------------------------------------------------------------- spec, members
def test_spec_first_writer_wins(clients: Callable[[], ClusterClient]) -> None:
    a, b = clients(), clients()
    results: dict[str, str] = {}
    threads = [
        threading.Thread(target=lambda c=c, s=s: results.__setitem__(s, c.put_spec_if_absent(s)))
        for c, s in ((a, '{"spec": "a"}'), (b, '{"spec": "b"}'))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stored = a.spec()
    assert stored in ('{"spec": "a"}', '{"spec": "b"}')
    assert set(results.values()) == {stored}


def test_registration_is_visible_to_another_client(clients: Callable[[], ClusterClient]) -> None:
    a, b = clients(), clients()
    reg = a.register("n1", {"address": "127.0.0.1:7000", "slots": 2}, ttl_s=2)
    members = b.members()
    assert members.nodes["n1"]["address"] == "127.0.0.1:7000"
    assert members.nodes["n1"]["slots"] == 2
    assert members.revision > 0
    reg.update({"address": "127.0.0.1:7001", "slots": 2})
    assert b.members().nodes["n1"]["address"] == "127.0.0.1:7001"
    reg.close()
    assert "n1" not in b.members().nodes  # revoked: gone at once, no TTL wait


@pytest.mark.timeout(30)
def test_node_whose_keep_alive_stopped_is_removed_by_lease_expiry(
    clients: Callable[[], ClusterClient],
) -> None:
    a, b = clients(), clients()
    reg = a.register("n1", {}, ttl_s=2)
    b.register("n2", {}, ttl_s=2)
    # Outlive the TTL while kept alive: the keep-alive thread really refreshes.
    watched: list[WatchEvent] = []
    b.watch_members(watched.append)
    started = time.monotonic()
    wait_for(lambda: time.monotonic() - started > 3.0, what="3 s of keep-alive")
    assert set(b.members().nodes) == {"n1", "n2"}
    reg.close(revoke=False)  # the process "dies": no more keep-alive, no revoke
    wait_for(lambda: "n1" not in b.members().nodes, timeout_s=10, what="n1's lease to expire")
    assert set(b.members().nodes) == {"n2"}
    wait_for(lambda: any(e.type is EventType.DELETE for e in watched), what="delete event")
    assert [e.key.rsplit("/", 1)[-1] for e in watched if e.type is EventType.DELETE] == ["n1"]


@pytest.mark.timeout(30)
def test_lost_registration_lease_is_regranted_and_key_reput(
    clients: Callable[[], ClusterClient], etcd: EtcdServer
) -> None:
    a, b = clients(), clients()
    reg = a.register("n1", {"address": "x"}, ttl_s=2)
    old_lease = reg.lease_id
    raw = EtcdKV([etcd.endpoint])
    try:
        raw.revoke(old_lease)  # as if it expired while etcd was unreachable
    finally:
        raw.close()
    wait_for(
        lambda: "n1" in b.members().nodes and reg.lease_id != old_lease,
        what="n1 re-registered on a new lease",
    )
    assert b.members().nodes["n1"]["address"] == "x"


def _manual_registration(client: ClusterClient, incarnation: str) -> Registration:
    """n1's registration whose keep-alive steps are taken by the test (no thread)."""
    info = {"address": "x", "incarnation": incarnation}
    return Registration(client._kv, client.keys.node("n1"), "n1", info, 2, start=False)


@pytest.mark.timeout(30)
def test_a_revoked_registration_lease_fences_at_once_and_unfences_after_the_re_put(
    clients: Callable[[], ClusterClient], etcd: EtcdServer
) -> None:
    a, b = clients(), clients()
    reg = _manual_registration(a, "inc-a")
    reg._keeper.step()
    assert not reg.may_have_lapsed()
    old_lease = reg.lease_id
    b._kv.revoke(old_lease)  # as if it expired while etcd was unreachable
    reg._keeper.step()  # etcd says the lease is gone; a new one is granted
    assert reg.may_have_lapsed()  # at once: no TTL wait for a lease known lost
    assert "n1" not in b.members().nodes
    reg._keeper.step()  # the key re-put on the new lease
    assert not reg.may_have_lapsed()
    assert reg.lease_id != old_lease
    assert b.members().nodes["n1"]["incarnation"] == "inc-a"
    reg.close()


@pytest.mark.timeout(30)
def test_a_lapsed_registration_never_overwrites_another_incarnation_of_its_node(
    clients: Callable[[], ClusterClient], caplog: pytest.LogCaptureFixture
) -> None:
    a, b = clients(), clients()
    old = _manual_registration(a, "inc-old")
    b._kv.revoke(old.lease_id)  # the old agent was cut off past its TTL...
    b.register("n1", {"address": "y", "incarnation": "inc-new"}, ttl_s=2)  # ...and replaced
    with caplog.at_level(logging.ERROR, logger="elasticpp.cluster.client"):
        old._keeper.step()  # lease lost: granted anew
        old._keeper.step()  # the key is the replacement's: left alone
    node = b.members().nodes["n1"]
    assert node["incarnation"] == "inc-new" and node["address"] == "y"
    assert old.conflict is not None and "another agent with the same node id" in old.conflict
    assert old.may_have_lapsed()
    assert any("inc-new" in r.message and r.levelno == logging.ERROR for r in caplog.records)
    old._keeper.step()  # and it stays so
    assert b.members().nodes["n1"]["incarnation"] == "inc-new"


@pytest.mark.timeout(40)
def test_a_registration_whose_loop_stalls_lapses_and_comes_back_when_it_runs(
    clients: Callable[[], ClusterClient],
) -> None:
    a, b = clients(), clients()
    stalled = threading.Event()
    gate = ProgressGate(lambda: 60.0 if stalled.is_set() else 0.0, 5.0)
    reg = a.register("n1", {"address": "x"}, ttl_s=2, gate=gate)
    started = time.monotonic()
    wait_for(lambda: time.monotonic() - started > 2.5, what="a TTL of keep-alive")
    assert "n1" in b.members().nodes
    stalled.set()
    wait_for(lambda: "n1" not in b.members().nodes, timeout_s=10, what="n1's lease to lapse")
    assert reg.may_have_lapsed()
    stalled.clear()
    wait_for(lambda: "n1" in b.members().nodes, timeout_s=10, what="n1 registered again")
    wait_for(lambda: not reg.may_have_lapsed(), what="n1 unfenced")


@pytest.mark.timeout(40)
def test_a_leadership_whose_loop_stalls_loses_the_term(
    clients: Callable[[], ClusterClient],
) -> None:
    a, b = clients(), clients()
    stalled = threading.Event()
    gate = ProgressGate(lambda: 60.0 if stalled.is_set() else 0.0, 5.0)
    lead = a.campaign("n1", ttl_s=2, gate=gate)
    assert lead is not None
    stalled.set()
    wait_for(lambda: b.leader() is None, timeout_s=10, what="the leader key to lapse")
    assert not lead.is_held()
    stalled.clear()
    assert b.campaign("n2", ttl_s=2) is not None


# ---------------------------------------------------------------------------- election
def test_exactly_one_of_concurrent_campaigns_wins(clients: Callable[[], ClusterClient]) -> None:
    cs = [clients() for _ in range(4)]
    won: list[str] = []
    lock = threading.Lock()

    def run(i: int) -> None:
        if cs[i].campaign(f"n{i}", ttl_s=2) is not None:
            with lock:
                won.append(f"n{i}")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1
    assert cs[0].leader() == won[0]


def test_a_campaign_that_finds_the_key_taken_grants_no_lease(
    clients: Callable[[], ClusterClient], etcd: EtcdServer
) -> None:
    """Every node that sees its leader go campaigns within a spread; those that come after
    the winner cost one read each, not a lease granted and revoked around a failed try."""
    meter = EtcdMeter()
    with ClusterClient([etcd.endpoint], JOB, meter=meter) as late:
        lead = clients().campaign("n1", ttl_s=2)
        assert lead is not None
        before = meter.by_kind()
        assert late.campaign("n2", ttl_s=10) is None
        after = meter.by_kind()
    made = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    assert made == {"range leader": 1}
    assert not any(k.startswith("lease") for k in after)


@pytest.mark.timeout(30)
def test_leader_fails_over_when_its_lease_lapses(clients: Callable[[], ClusterClient]) -> None:
    a, b = clients(), clients()
    lost = threading.Event()
    lead_a = a.campaign("n1", ttl_s=2, on_lost=lost.set)
    assert lead_a is not None and lead_a.is_held()
    assert b.campaign("n2", ttl_s=2) is None
    a.close()  # n1's process dies: keep-alive stops, the lease lapses after its TTL
    wait_for(lambda: b.leader() is None, what="n1's leader lease to lapse")
    lead_b = b.campaign("n2", ttl_s=2)
    assert lead_b is not None
    assert b.leader() == "n2"


def test_a_leader_confirmed_dead_is_deposed_at_once_and_only_its_own_term(
    clients: Callable[[], ClusterClient],
) -> None:
    a, b = clients(), clients()
    old = a.campaign("n1", ttl_s=30)  # a lease that would hold the key for 30 s
    assert old is not None
    assert not b.depose("n2")  # not the leader: nothing happens
    assert b.depose("n1")
    assert b.leader() is None
    new = b.campaign("n2", ttl_s=30)
    assert new is not None
    assert not a.arrivals.write_resume(1, _resume(0), old)  # the deposed term writes nothing
    assert not a.depose("n1") and b.leader() == "n2"


def test_resigned_leader_is_replaced_at_once(clients: Callable[[], ClusterClient]) -> None:
    a, b = clients(), clients()
    lead_a = a.campaign("n1", ttl_s=30)
    assert lead_a is not None
    lead_a.resign()
    assert not lead_a.is_held()
    assert b.leader() is None
    assert b.campaign("n2", ttl_s=30) is not None


def _resume(step: int) -> dict[str, Any]:
    """An instruction with nothing to fetch (elasticpp.store.instruction's form)."""
    empty: dict[str, Any] = {"pieces": {}, "reshard": {}, "reshard_by_node": {}}
    return {
        "format_version": 2,
        "step": step,
        **empty,
        "nodes": [],
        "by_node": {},
        "infos_by_node": {},
    }


def test_a_resume_instruction_is_written_once_fenced_and_read_by_any_later_leader(
    clients: Callable[[], ClusterClient],
) -> None:
    from elasticpp.cluster.barriers import RESUME_MEMBER

    a, b = clients(), clients()
    old = a.campaign("n1", ttl_s=5)
    assert old is not None
    assert a.arrivals.write_resume(3, _resume(7), old)
    assert not a.arrivals.write_resume(3, _resume(9), old)  # written once
    # Leadership moves mid-transition: the new leader finds the instruction, under the one
    # member name followers read, and cannot replace it.
    old.resign()
    new = b.campaign("n2", ttl_s=5)
    assert new is not None
    assert b.arrivals.barrier_state("resume-3")[0] == {RESUME_MEMBER: _resume(7)}
    assert not b.arrivals.write_resume(3, _resume(0), new)
    assert not a.arrivals.write_resume(4, _resume(7), old)  # a deposed term writes nothing
    assert b.arrivals.write_resume(4, _resume(8), new)
    assert a.arrivals.barrier_state("resume-4")[0] == {RESUME_MEMBER: _resume(8)}


def test_a_leader_that_cannot_resume_says_so_fenced_and_never_over_an_instruction(
    clients: Callable[[], ClusterClient],
) -> None:
    from elasticpp.cluster.barriers import RESUME_MEMBER, RESUME_WAIT_MEMBER

    a, b = clients(), clients()
    old = a.campaign("n1", ttl_s=5)
    assert old is not None
    assert a.arrivals.write_resume_wait(3, "no state", old)
    assert a.arrivals.write_resume_wait(3, "no state on n2", old)  # a later wait replaces it
    [wait] = [
        v for m, v in b.arrivals.barrier_state("resume-3")[0].items() if m == RESUME_WAIT_MEMBER
    ]
    assert wait["why"] == "no state on n2" and isinstance(wait["at"], float)
    old.resign()
    new = b.campaign("n2", ttl_s=5)
    assert new is not None
    assert not a.arrivals.write_resume_wait(3, "stale", old)  # a deposed term says nothing
    assert b.arrivals.write_resume(3, _resume(7), new)  # the state came back: the instruction
    assert not b.arrivals.write_resume_wait(3, "too late", new)  # never said over an instruction
    state = a.arrivals.barrier_state("resume-3")[0]
    assert (
        state[RESUME_MEMBER] == _resume(7) and state[RESUME_WAIT_MEMBER]["why"] == "no state on n2"
    )
    # A wait without its reason is refused by name, as any malformed arrival.
    a._kv.put(a.keys.barrier("resume-4", RESUME_WAIT_MEMBER), '{"node_id": "n2", "value": {}}')
    assert a.arrivals.barrier_state("resume-4")[0] == {}


def test_a_large_resume_instruction_is_written_in_parts_and_read_whole(
    clients: Callable[[], ClusterClient],
) -> None:
    from elasticpp.cluster.barriers import RESUME_MEMBER

    a, b = clients(), clients()
    lead = a.campaign("n1", ttl_s=30)
    assert lead is not None
    # 2,000 pieces with their sha256: ~170 KiB, over the 64 KiB a value may take.
    value = _resume(5) | {"pieces": {f"u{i:05d}.tp0": [f"{i:064x}", i] for i in range(2000)}}
    assert a.arrivals.write_resume(6, value, lead)
    raw, _ = a._kv.get_prefix(a.keys.barrier_prefix("resume-6"))
    assert len(raw) > 2 and max(len(kv.value) for kv in raw) <= 64 * 1024
    assert b.arrivals.barrier_state("resume-6")[0] == {RESUME_MEMBER: value}
    # A part gone (an operator's delete, say): the instruction is not seen, and counted.
    a._kv.delete(a.keys.barrier("resume-6", "resume-part-0001"))
    assert b.arrivals.barrier_state("resume-6")[0] == {}
    assert b.skipped_values == 1


def _timeline(generation: int) -> dict[str, Any]:
    return {
        "generation": generation,
        "reason": "a reason",
        "layout_before": "",
        "layout_after": "pp=1,tp=1,dp=1",
        "resume_step": 0,
        "steps_recomputed": 0,
        "detected_at": 1.0,
        "planned_s": 0.1,
        "stopped_s": 0.2,
        "moved_s": 0.3,
        "resumed_s": 0.4,
    }


def _six_generations(a: ClusterClient, *, arrivals: bool, commits_upto: int) -> Leadership:
    """Generations 1-6 led by n1, each with its resume instruction and timeline (and, with
    `arrivals`, n1's stopped, started and failed arrivals), commits up to `commits_upto`."""
    lead = a.campaign("n1", ttl_s=30)
    assert lead is not None
    for g in range(1, 7):
        _, rev = a.read_generation()
        assert a.write_generation(record(g, "n1"), rev, lead)
        if arrivals:
            a.arrivals.arrive(f"stopped-{g}", "n1", {"holdings": {}, "next_step": g, "at": g})
            a.arrivals.arrive(f"started-{g}", "n1", {"at": g, "moved_at": g})
            a.arrivals.arrive(f"failed-{g}", "n1", {"reason": "a worker exited", "at": g})
        assert a.arrivals.write_resume(g, _resume(g), lead)
        a.arrivals.arrive("timelines", f"gen-{g}", _timeline(g))
        if g <= commits_upto:
            a.commits.record_commit(g, "n1", g)
    return lead


def test_housekeeping_bounds_what_old_generations_leave_in_etcd(
    clients: Callable[[], ClusterClient], etcd: EtcdServer
) -> None:
    a = clients()
    _six_generations(a, arrivals=True, commits_upto=4)
    assert a.commits.housekeep(6, keep_history=2) > 0
    for g in range(1, 7):
        kept = g >= 5  # the running generation and the one before it
        for name in ("stopped", "resume", "started", "failed"):
            assert bool(a.arrivals.barrier_state(f"{name}-{g}")[0]) == kept, (name, g)
    assert [r.generation for r in a.generation_history()] == [4, 5, 6]
    assert sorted(a.arrivals.barrier_state("timelines")[0]) == ["gen-4", "gen-5", "gen-6"]
    assert (
        a.commits.committed_steps(4) == {"n1": 4}
        and a.commits.committed_steps(3) == {}
        and a.commits.ever_committed()
    )
    assert a.read_generation()[0] is not None
    assert a.commits.housekeep(6, keep_history=2) == 0  # the watermark: nothing is looked at twice


def test_housekeeping_is_one_revision_that_a_watcher_gets_as_one_message(
    clients: Callable[[], ClusterClient],
) -> None:
    # Every node watches the resume instructions and timelines: a delete per key was a
    # watch message (and a wake of its loop) per key for every node, at every transition.
    a = clients()
    lead = _six_generations(a, arrivals=False, commits_upto=6)
    _, start = a.arrivals.barrier_state("timelines")  # the store's revision now
    batches: list[list[int]] = []
    seen = threading.Event()

    def on_event(event: Any) -> None:
        batches.append([event.mod_revision])
        if event.key == a.keys.housekeeping:
            seen.set()

    watch = a.watch(a.keys.root, on_event, prefix=True, start_revision=start + 1)
    try:
        removed = a.commits.housekeep(6, keep_history=2, leader=lead)
        assert removed == 4 + 3 + 3 + 5  # resume-1..4, timelines and history 1..3, commits 1..5
        assert seen.wait(10)
        assert len({r for (r,) in batches}) == 1  # every delete and the mark: one revision
        mark = a._kv.get(a.keys.housekeeping)
        assert mark is not None
        assert a.commits.housekeep(6, keep_history=2, leader=lead) == 0
        again = a._kv.get(a.keys.housekeeping)
        assert again is not None and again.mod_revision == mark.mod_revision  # not rewritten
    finally:
        watch.cancel()


# ---------------------------------------------------------------------------- generations
def test_generation_cas_refuses_stale_revision_and_wrong_number(
    clients: Callable[[], ClusterClient],
) -> None:
    a = clients()
    lead = a.campaign("n1", ttl_s=5)
    assert lead is not None
    assert a.read_generation() == (None, 0)
    assert a.write_generation(record(1, "n1"), 0, lead)
    rec, rev = a.read_generation()
    assert rec is not None and rec.generation == 1 and rev > 0
    assert not a.write_generation(record(2, "n1"), 0, lead)  # stale: read before gen 1
    with pytest.raises(GenerationConflictError, match="exactly 2"):
        a.write_generation(record(3, "n1"), rev, lead)
    with pytest.raises(GenerationConflictError, match="names leader"):
        a.write_generation(record(2, "n9"), rev, lead)
    assert a.write_generation(record(2, "n1"), rev, lead)
    assert [r.generation for r in a.generation_history()] == [1, 2]


def test_the_history_of_a_generation_is_its_summary_and_old_full_copies_still_read(
    clients: Callable[[], ClusterClient],
) -> None:
    a = clients()
    lead = a.campaign("n1", ttl_s=5)
    assert lead is not None
    # An earlier release kept a second full copy of generation 1.
    first = GenerationRecord(1, {"pp": 1, "tp": 2, "dp": 2}, "n1", 5.0, extra={"reason": "start"})
    a._kv.put(a.keys.generation, first.to_json())
    a._kv.put(a.keys.generation_history(1), first.to_json())
    _, rev = a.read_generation()
    second = GenerationRecord(
        2,
        {"pp": 2, "tp": 2, "dp": 1},
        "n1",
        6.0,
        extra={"reason": "lost n2", "nodes": {"n1": "a:1"}, "previous_layout": "pp=1,tp=2,dp=2"},
    )
    assert a.write_generation(second, rev, lead)
    stored = a._kv.get(a.keys.generation_history(2))
    assert stored is not None and "plan" not in json.loads(stored.value)
    assert a.read_generation()[0] == second  # the record itself is whole
    assert a.generation_history() == [
        GenerationSummary(1, "n1", 5.0, "pp=1,tp=2,dp=2", 0, "start"),
        GenerationSummary(2, "n1", 6.0, "pp=2,tp=2,dp=1", 1, "lost n2", "pp=1,tp=2,dp=2"),
    ]


def test_two_writers_of_the_same_read_revision_only_one_wins(
    clients: Callable[[], ClusterClient],
) -> None:
    a, b = clients(), clients()
    lead = a.campaign("n1", ttl_s=5)
    assert lead is not None
    _, rev = a.read_generation()
    assert a.write_generation(record(1, "n1"), rev, "n1")
    assert not b.write_generation(record(1, "n1"), rev, "n1")  # same read, second loses
    rec, _ = b.read_generation()
    assert rec is not None and rec.generation == 1


def test_deposed_leader_cannot_write_a_generation(clients: Callable[[], ClusterClient]) -> None:
    a, b = clients(), clients()
    old = a.campaign("n1", ttl_s=5)
    assert old is not None
    _, rev = a.read_generation()
    old.resign()
    new = b.campaign("n2", ttl_s=5)
    assert new is not None
    assert not a.write_generation(record(1, "n1"), rev, old)  # by Leadership
    assert not a.write_generation(record(1, "n1"), rev, "n1")  # by node id
    # Same node id re-elected: its old term's token is still refused.
    new.resign()
    again = a.campaign("n1", ttl_s=5)
    assert again is not None
    assert not a.write_generation(record(1, "n1"), rev, old)
    assert a.write_generation(record(1, "n1"), rev, again)


def test_generation_watch_delivers_each_new_generation(
    clients: Callable[[], ClusterClient],
) -> None:
    a, b = clients(), clients()
    _, rev = b.read_generation()
    seen: list[int] = []
    b.watch_generation(
        lambda e: seen.append(GenerationRecord.from_json(e.value or "").generation),
        start_revision=rev + 1,
    )
    lead = a.campaign("n1", ttl_s=5)
    assert lead is not None
    for g in (1, 2, 3):
        _, rev = a.read_generation()
        assert a.write_generation(record(g, "n1"), rev, lead)
    wait_for(lambda: seen == [1, 2, 3], what="three generation events")


# ---------------------------------------------------------------------------- etcd restarts
@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["kill", "stop"])
def test_watch_keeps_delivering_after_etcd_restart_without_loss(
    clients: Callable[[], ClusterClient], etcd: EtcdServer, how: str
) -> None:
    a, b = clients(), clients()
    events: list[WatchEvent] = []
    lock = threading.Lock()

    def on_event(event: WatchEvent) -> None:
        with lock:
            events.append(event)

    watch = b.watch(a.keys.commits_prefix, on_event, prefix=True)
    for step in range(3):
        a.commits.record_commit(1, "n1", step)
    # Stop etcd without waiting for delivery: events 0-2 may still be undelivered.
    etcd.kill() if how == "kill" else etcd.stop()
    etcd.start()
    for step in range(3, 6):
        wait_for(reachable(lambda s=step: a.commits.record_commit(1, "n1", s) or True), what="put")
    wait_for(lambda: len(events) >= 6, what="six commit events")
    with lock:
        steps = [json.loads(e.value or "")["step"] for e in events]
        revisions = [e.mod_revision for e in events]
    assert steps == [0, 1, 2, 3, 4, 5]  # none lost, none twice, in order
    assert revisions == sorted(set(revisions))
    assert watch.next_revision == revisions[-1] + 1


@pytest.mark.timeout(60)
def test_a_registration_cut_off_for_a_ttl_says_it_may_have_lapsed_until_renewed(
    clients: Callable[[], ClusterClient], etcd: EtcdServer
) -> None:
    a = clients()
    reg = a.register("n1", {"address": "x"}, ttl_s=2)
    assert not reg.may_have_lapsed()
    etcd.stop()
    wait_for(reg.may_have_lapsed, timeout_s=10, what="fenced while etcd is down")
    etcd.start()
    wait_for(lambda: not reg.may_have_lapsed(), timeout_s=20, what="renewed after etcd")
    assert "n1" in a.members().nodes


@pytest.mark.timeout(60)
def test_registration_and_leadership_survive_etcd_restart(
    clients: Callable[[], ClusterClient], etcd: EtcdServer
) -> None:
    a, b = clients(), clients()
    a.register("n1", {"address": "x"}, ttl_s=2)
    lead = a.campaign("n1", ttl_s=2)
    assert lead is not None
    etcd.kill()
    # Down for longer than a keep-alive interval: the keeper sees failures and retries.
    with pytest.raises(ClusterUnavailableError):
        b.members()
    etcd.start()
    wait_for(reachable(lambda: "n1" in b.members().nodes), what="n1 registered after restart")
    wait_for(reachable(lambda: b.leader() == "n1"), what="n1 still leader after restart")
    wait_for(lead.is_held, what="leadership refreshed after restart")
    # And it stays: the keep-alive works against the restarted etcd beyond one TTL.
    started = time.monotonic()
    wait_for(lambda: time.monotonic() - started > 2.5, what="one TTL after restart")
    assert "n1" in b.members().nodes and lead.is_held()


@pytest.mark.timeout(30)
def test_calls_while_etcd_is_down_raise_unavailable_within_bounded_time(
    clients: Callable[[], ClusterClient], etcd: EtcdServer
) -> None:
    a = clients()  # request_timeout_s=1.0
    lead = a.campaign("n1", ttl_s=5)
    assert lead is not None
    etcd.kill()
    calls: list[Callable[[], Any]] = [
        a.members,
        a.leader,
        a.read_generation,
        lambda: a.write_generation(record(1, "n1"), 0, lead),
        lambda: a.campaign("n2", ttl_s=2),
        lambda: a.register("n3", {}, ttl_s=2),
        lambda: a.arrivals.arrive("b", "n1"),
        lambda: a.commits.record_commit(1, "n1", 1),
        lambda: a.arrivals.report_suspect("n2", "n1", "probe failed"),
        lambda: a.watch(a.keys.root, lambda e: None, prefix=True),
    ]
    for call in calls:
        started = time.monotonic()
        with pytest.raises(ClusterUnavailableError):
            call()
        # Generous bound for a busy 2-core machine; the point is "bounded", not "fast".
        assert time.monotonic() - started < 8.0


# ---------------------------------------------------------------------------- barriers etc.
def test_barrier_completes_when_all_arrive(clients: Callable[[], ClusterClient]) -> None:
    a, b = clients(), clients()
    a.arrivals.arrive("gen1-stopped", "n1", {"step": 7})
    result: dict[str, Any] = {}
    waiter = threading.Thread(
        target=lambda: result.update(
            a.arrivals.wait_barrier("gen1-stopped", ["n1", "n2", "n3"], 20)
        )
    )
    waiter.start()
    b.arrivals.arrive("gen1-stopped", "n2", {"step": 7})
    b.arrivals.arrive("gen1-stopped", "n3", None)
    waiter.join(timeout=30)
    assert not waiter.is_alive()
    assert result == {
        "n1": {"step": 7},
        "n2": {"step": 7},
        "n3": None,
    }
    assert a.arrivals.clear_barrier("gen1-stopped") == 3


def test_barrier_times_out_naming_the_missing_nodes(clients: Callable[[], ClusterClient]) -> None:
    a = clients()
    a.arrivals.arrive("gen2-ready", "n1")
    with pytest.raises(BarrierTimeoutError, match="n2") as info:
        a.arrivals.wait_barrier("gen2-ready", ["n1", "n2", "n3"], timeout_s=0.5)
    assert info.value.missing == ["n2", "n3"]


def test_commit_records_and_suspects_round_trip(clients: Callable[[], ClusterClient]) -> None:
    a, b = clients(), clients()
    a.commits.record_commit(3, "n1", 41)
    a.commits.record_commit(3, "n1", 42)
    b.commits.record_commit(3, "n2", 40)
    b.commits.record_commit(2, "n2", 30)
    assert a.commits.committed_steps(3) == {"n1": 42, "n2": 40}
    a.commits.housekeep(3)  # commits of all but the newest generation that has any go
    assert a.commits.committed_steps(2) == {} and a.commits.committed_steps(3) == {
        "n1": 42,
        "n2": 40,
    }
    suspected: list[WatchEvent] = []
    b.watch_suspects(suspected.append)
    a.arrivals.report_suspect("n2", "n1", "collective failed")
    assert b.arrivals.suspects()["n2"]["by"] == "n1"
    wait_for(lambda: len(suspected) == 1, what="suspect event")
    assert b.arrivals.clear_suspect("n2")
    assert b.arrivals.suspects() == {}


def test_unreadable_values_are_skipped_counted_and_logged_once(
    clients: Callable[[], ClusterClient], etcd: EtcdServer, caplog: pytest.LogCaptureFixture
) -> None:
    c = clients()
    c.arrivals.arrive("done", "n1", {"step": 3})
    c.commits.record_commit(2, "n1", 7)
    raw = EtcdKV([etcd.endpoint])
    try:
        raw.put(c.keys.barrier("done", "bad"), "{not json")
        raw.put(c.keys.barrier("done", "newer"), json.dumps({"format_version": 99, "value": 1}))
        raw.put(c.keys.commit(2, "bad"), json.dumps({"format_version": 1, "step": "seven"}))
        raw.put(c.keys.node("bad"), "[]")
    finally:
        raw.close()
    for _ in range(2):
        assert c.arrivals.barrier_state("done")[0] == {"n1": {"step": 3}}
        assert c.commits.committed_steps(2) == {"n1": 7}
        assert "bad" not in c.members().nodes
    assert c.skipped_values == 8
    warnings = [r for r in caplog.records if "skipped" in r.getMessage()]
    assert len(warnings) == 4  # one line per key, however often it is read


def test_commit_records_carry_anchors_and_skip_what_they_cannot_read(
    clients: Callable[[], ClusterClient], etcd: EtcdServer
) -> None:
    a = clients()
    a.commits.record_commit(5, "n1", 42, anchors=[40, 42], replicas={"n3": [42, 40, 38]})
    a.commits.record_commit(5, "n2", -1, replicas={"n1": [40]})  # replicas only, no own commit yet
    raw = EtcdKV([etcd.endpoint])
    try:
        newer = {"format_version": 2, "node_id": "n4", "generation": 5, "step": 3}
        raw.put(a.keys.commit(5, "n4"), json.dumps(newer))
        bad = {"format_version": 1, "node_id": "n5", "generation": 5, "step": 3, "anchors": "40"}
        raw.put(a.keys.commit(5, "n5"), json.dumps(bad))
        elsewhere = {"format_version": 1, "node_id": "n1", "generation": 5, "step": 3}
        raw.put(a.keys.commit(5, "n6"), json.dumps(elsewhere))
        old = {"format_version": 1, "node_id": "n7", "generation": 5, "step": 9, "at": 0.0}
        raw.put(a.keys.commit(5, "n7"), json.dumps(old))  # an older release's record
    finally:
        raw.close()
    records = a.commits.commit_records(5)
    assert sorted(records) == ["n1", "n2", "n7"]
    assert records["n1"].step == 42 and records["n1"].anchors == (42, 40)
    assert records["n1"].replicas == {"n3": (42, 40, 38)}
    assert records["n2"].step == -1 and records["n2"].replicas == {"n1": (40,)}
    assert records["n7"].anchors == () and records["n7"].replicas == {}
    assert a.skipped_values == 3
    assert a.commits.committed_steps(5)["n1"] == 42  # the high-water mark reads the same records
    assert a.commits.commit_records(4) == {}


def test_the_safe_step_is_written_by_the_leaders_term_against_the_revision_it_read(
    clients: Callable[[], ClusterClient], etcd: EtcdServer
) -> None:
    from elasticpp.cluster.records import SafeStep

    a, b = clients(), clients()
    assert a.commits.read_safe() == (None, 0)
    old = a.campaign("n1", ttl_s=5)
    assert old is not None
    assert a.commits.write_safe(SafeStep(2, 40), 0, old)
    safe, rev = b.commits.read_safe()
    assert safe == SafeStep(2, 40) and rev > 0
    assert not a.commits.write_safe(SafeStep(2, 44), 0, old)  # the key changed since revision 0
    assert a.commits.write_safe(SafeStep(2, 44), rev, old)
    assert SafeStep(3, 2) > SafeStep(2, 44)  # commit order: generation, then step
    old.resign()
    new = b.campaign("n2", ttl_s=5)
    assert new is not None
    _, rev = a.commits.read_safe()
    assert not a.commits.write_safe(SafeStep(2, 48), rev, old)  # a deposed term writes nothing
    # A value this build cannot read is skipped (logged once), never acted on, and the
    # leader may replace it.
    raw = EtcdKV([etcd.endpoint])
    try:
        raw.put(b.keys.safe, json.dumps({"format_version": 2, "generation": 9, "step": 1}))
    finally:
        raw.close()
    safe, rev = b.commits.read_safe()
    assert safe is None and b.skipped_values == 1
    assert b.commits.write_safe(SafeStep(3, 2), rev, new)
    assert a.commits.read_safe()[0] == SafeStep(3, 2)


# ---------------------------------------------------------------------------- job epochs
def test_the_epoch_is_created_once_and_read_by_every_later_client(
    clients: Callable[[], ClusterClient],
) -> None:
    a, b = clients(), clients()
    assert a.epoch() is None
    results: dict[str, JobEpoch] = {}
    threads = [
        threading.Thread(
            target=lambda c=c, n=n, e=e: results.__setitem__(n, c.epoch_if_absent(e, n))
        )
        for c, n, e in ((a, "n1", 1_000), (b, "n2", 2_000))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stored = a.epoch()
    assert stored is not None and stored.epoch in (1_000, 2_000)
    assert results["n1"] == results["n2"] == stored == b.epoch()
    assert clients().epoch_if_absent(3_000, "n3") == stored  # a later joiner reads it


def test_a_wiped_job_prefix_gets_a_new_larger_epoch(
    clients: Callable[[], ClusterClient], etcd: EtcdServer
) -> None:
    a = clients()
    a.put_spec_if_absent('{"spec": "a"}')
    first = a.epoch_if_absent(propose_epoch(0), "n1")
    # An operator deletes the job's prefix; a node whose clock is far behind joins first.
    kv = EtcdKV([etcd.endpoint])
    try:
        assert kv.delete_prefix(a.keys.root) >= 2
    finally:
        kv.close()
    assert a.epoch() is None and a.spec() is None
    b = clients()
    b.put_spec_if_absent('{"spec": "a"}')
    second = b.epoch_if_absent(propose_epoch(first.epoch, now_ns=first.epoch - 10**12), "n2")
    assert second.epoch > first.epoch
    assert a.epoch() == second  # every agent of the new etcd state reads the new epoch


def test_the_leader_compacts_history_to_the_revision_of_its_previous_compaction(
    clients: Callable[[], ClusterClient], etcd: EtcdServer
) -> None:
    a, b = clients(), clients()
    lead = a.campaign("n1", ttl_s=30)
    assert lead is not None
    raw = EtcdKV([etcd.endpoint])
    try:
        first = raw.put("/elsewhere/k", "1")
        raw.put("/elsewhere/k", "2")
        assert a.commits.compact_history(lead) is None  # the first call only notes the revision
        ended: list[WatchItem] = []
        raw.put("/elsewhere/k", "3")
        compacted = a.commits.compact_history(lead)
        assert compacted is not None and compacted > first
        # History before it is gone: a watch from an older revision is told to resync.
        raw.add_watch("/elsewhere/k", None, first, ended.append)
        wait_for(lambda: any(isinstance(i, WatchEnded) for i in ended), what="a resync")
        assert next(i for i in ended if isinstance(i, WatchEnded)).compact_revision == compacted
        got = raw.get("/elsewhere/k")
        assert got is not None and got.value == "3"  # current values stay
        # Only the leader's term compacts: another client's stale term does nothing.
        lead.resign()
        other = b.campaign("n2", ttl_s=30)
        assert other is not None
        assert a.commits.compact_history(lead) is None
    finally:
        raw.close()


# ---------------------------------------------------------------------------- cached reads
def test_cached_reads_parse_a_record_again_only_when_it_changed(
    clients: Callable[[], ClusterClient],
) -> None:
    """An agent read every member's record, the generation record and the barriers from its
    cache on every view refresh and parsed them all again: O(N) work per node per second,
    O(N²) for the cluster. An unchanged answer is now the object derived before."""
    a, b = clients(), clients()
    a.follow()
    with pytest.raises(ClusterUnavailableError, match="not cached"):
        a.agent_members(cached=True)  # every member: the leader's cache alone holds them
    a.cache_for_leader(True)
    b.register("n1", {"address": "127.0.0.1:7000", "slots": 2}, ttl_s=2)
    lead = b.campaign("n1", ttl_s=2)
    assert lead is not None
    assert b.write_generation(record(1, "n1"), 0, lead)
    b.arrivals.arrive("drill", "n1", {"at": 1})

    def members_seen() -> bool:
        try:
            return "n1" in a.agent_members(cached=True).nodes
        except ClusterUnavailableError:
            return False

    assert wait_until(members_seen, 10.0, interval_s=0.02)
    assert wait_until(lambda: a.read_generation(cached=True)[0] is not None, 10.0)
    members = a.agent_members(cached=True).nodes
    rec, _ = a.read_generation(cached=True)
    drill, _ = a.arrivals.barrier_state("drill", cached=True)
    assert a.agent_members(cached=True).nodes is members
    assert a.read_generation(cached=True)[0] is rec
    assert a.arrivals.barrier_state("drill", cached=True)[0] is drill
    assert a.agent_members().nodes is not members  # an uncached read is a fresh answer
    # A change elsewhere leaves the members' answer as it was; a member's change renews it.
    b.arrivals.arrive("drill", "n2", {"at": 2})
    assert wait_until(lambda: "n2" in a.arrivals.barrier_state("drill", cached=True)[0], 10.0)
    assert a.agent_members(cached=True).nodes is members
    b.register("n2", {"address": "127.0.0.1:7001", "slots": 1}, ttl_s=2)
    assert wait_until(lambda: "n2" in a.agent_members(cached=True).nodes, 10.0)
    assert a.read_generation(cached=True)[0] is rec
    assert wait_until(lambda: b.write_generation(record(2, "n1"), b.read_generation()[1], lead), 5)
    assert wait_until(lambda: a.read_generation(cached=True)[0].generation == 2, 10.0)  # type: ignore[union-attr]


def test_cached_arrivals_and_members_are_checked_again_only_when_they_changed(
    clients: Callable[[], ClusterClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The leader's view of N arrivals (or members) is rebuilt at each change of one of
    them, and each rebuild checked the shape of all N: O(N) checks per arrival, O(N²) a
    transition (a tenth of the leader's CPU in one at 1,024 nodes). Now a record is checked
    once per revision; one that fails its check is skipped at every rebuild."""
    from elasticpp.cluster import arrivals as arrivals_mod
    from elasticpp.cluster import client as client_mod

    checked: list[str] = []
    real_arrival, real_member = arrivals_mod.check_arrival, client_mod.check_member

    def count_arrival(barrier: str, member: str, value: Any) -> Any:
        checked.append(member)
        return real_arrival(barrier, member, value)

    def count_member(node_id: str, value: Any) -> Any:
        checked.append(node_id)
        return real_member(node_id, value)

    monkeypatch.setattr(arrivals_mod, "check_arrival", count_arrival)
    monkeypatch.setattr(client_mod, "check_member", count_member)
    a, b = clients(), clients()
    a.follow()
    a.cache_for_leader(True)
    for i in range(4):
        b.arrivals.arrive("stopped-3", f"n{i}", {"next_step": 5, "at": 1.0, "holdings": {}})
    b.arrivals.arrive("stopped-3", "bad", "not an object")
    for i in range(3):
        b.register(f"n{i}", {"address": f"127.0.0.1:{7000 + i}", "slots": 1}, ttl_s=5)
    b.register("noaddr", {"slots": 1}, ttl_s=5)

    def arrived() -> set[str]:
        return set(a.arrivals.barrier_state("stopped-3", cached=True)[0])

    assert wait_until(lambda: arrived() == {"n0", "n1", "n2", "n3"}, 10.0)
    assert wait_until(lambda: set(a.agent_members(cached=True).nodes) == {"n0", "n1", "n2"}, 10.0)
    skipped = a.skipped_values
    checked.clear()
    b.arrivals.arrive("stopped-3", "n1", {"next_step": 6, "at": 2.0, "holdings": {}})  # one changes
    assert wait_until(
        lambda: a.arrivals.barrier_state("stopped-3", cached=True)[0]["n1"]["next_step"] == 6, 10.0
    )
    # The changed one, once; the bad one again at each rebuild (how many the cache made is
    # its business); none of the unchanged good ones.
    assert set(checked) == {"bad", "n1"} and checked.count("n1") == 1
    assert "bad" not in arrived() and a.skipped_values > skipped
    checked.clear()
    b.register("n3", {"address": "127.0.0.1:7003", "slots": 1}, ttl_s=5)  # one member joins
    assert wait_until(lambda: "n3" in a.agent_members(cached=True).nodes, 10.0)
    assert set(checked) == {"n3", "noaddr"} and checked.count("n3") == 1
    assert "noaddr" not in a.agent_members(cached=True).nodes


def test_a_follower_reads_the_members_it_needs_by_key_and_its_own_from_its_cache(
    clients: Callable[[], ClusterClient],
) -> None:
    a, b = clients(), clients()
    a.register("n0", {"address": "127.0.0.1:7000", "slots": 1}, ttl_s=5)
    b.register("n1", {"address": "127.0.0.1:7001", "slots": 2}, ttl_s=5)
    b.register("bad", {"slots": 1}, ttl_s=5)  # no address: not usable
    a.follow(own_node="n0")
    before = a.etcd_requests().get("Range", 0)
    found = a.member_records(["n0", "n1", "bad", "ghost"])
    assert {n: r["address"] for n, r in found.items()} == {
        "n0": "127.0.0.1:7000",
        "n1": "127.0.0.1:7001",
    }
    # n0 from the cache; n1, bad and ghost by key: one range request each.
    assert a.etcd_requests().get("Range", 0) - before == 3
    assert a.skipped_values >= 1  # the unusable record is counted, not returned
    a.cache_for_leader(True)  # the leader: every member key from its cache
    before = a.etcd_requests().get("Range", 0)
    assert sorted(a.member_records(["n0", "n1", "ghost"])) == ["n0", "n1"]
    assert a.etcd_requests().get("Range", 0) == before


def test_a_node_whose_member_key_left_its_lease_arrives_and_commits_nowhere(
    clients: Callable[[], ClusterClient],
) -> None:
    """The check is etcd's, in the write's transaction: an agent that checked its lease and
    then wrote late (a stalled process at 256 simulated nodes) arrived after its lapse."""
    a = clients()
    started = {"at": 1.0, "moved_at": 1.0}
    reg = a.register("n1", {}, ttl_s=5)
    lease = reg.lease_id
    a.arrivals.arrive("started-4", "n1", started, lease_id=lease)
    a.commits.record_commit(4, "n1", 7, lease_id=lease)
    assert set(a.arrivals.barrier_state("started-4")[0]) == {"n1"}
    assert a.commits.committed_steps(4) == {"n1": 7}
    reg.close()  # the key leaves with its lease, as at a lapse
    with pytest.raises(MembershipLapsedError, match=r"n1.*lapsed"):
        a.arrivals.arrive("started-5", "n1", started, lease_id=lease)
    with pytest.raises(MembershipLapsedError):
        a.commits.record_commit(4, "n1", 8, lease_id=lease)
    assert a.arrivals.barrier_state("started-5")[0] == {}
    assert a.commits.committed_steps(4) == {"n1": 7}  # the committed record is not overwritten
    # Registered again (a new lease): the old lease's writes stay refused, the new one's land.
    again = a.register("n1", {}, ttl_s=5)
    with pytest.raises(MembershipLapsedError):
        a.arrivals.arrive("started-5", "n1", started, lease_id=lease)
    a.arrivals.arrive("started-5", "n1", started, lease_id=again.lease_id)
    assert set(a.arrivals.barrier_state("started-5")[0]) == {"n1"}
