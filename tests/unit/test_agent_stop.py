"""The stop part's pure steps (elasticpp.agent.stop.step): what every agent does once an
operator asked the job to stop, and when and how the leader ends it. End to end, with real
agents, etcd and workers: tests/integration/test_job_stop.py."""

from __future__ import annotations

from elasticpp.agent.actions import ArriveStop, AskStop, EndStopped, Event, KillOld, PersistFinal
from elasticpp.agent.kernel.summaries import WorkerSeen
from elasticpp.agent.stop.step import (
    StopLeadObservation,
    StopObservation,
    StopState,
    stop_lead_step,
    stop_step,
)
from elasticpp.cluster.records import StopRequest

REQUEST = StopRequest(by="ops@host", reason="maintenance", at=1.0)


def observe(
    now_s: float,
    workers: tuple[WorkerSeen, ...] = (),
    committed: int = 7,
    checkpoint: str = "unknown",
) -> StopObservation:
    return StopObservation(
        now_s=now_s,
        workers=workers,
        committed=committed,
        checkpoint=checkpoint,
        grace_s=20.0,
        stuck_s=10.0,
        persist_s=900.0,
    )


def worker(pid: int, state: str = "running") -> WorkerSeen:
    return WorkerSeen(rank=pid % 10, pid=pid, state=state, last_step=6, generation=2)


def requested() -> StopState:
    return StopState(request=REQUEST)


def test_without_a_request_nothing_happens() -> None:
    state = StopState()
    assert stop_step(state, observe(0.0, (worker(101),))) == []
    assert stop_lead_step(state, StopLeadObservation(0.0, frozenset({"a"}), {}, 60.0)) == []


def test_training_workers_are_asked_once_to_stop_at_a_boundary_and_the_node_waits_for_them() -> (
    None
):
    state = requested()
    first = stop_step(state, observe(0.0, (worker(101), worker(102, "starting"))))
    assert isinstance(first[0], Event) and "requested by ops@host (maintenance)" in first[0].message
    assert first[1:] == [AskStop((101, 102))]
    # The same workers, now stopping, and a new one handed a rank meanwhile: only it is asked.
    again = stop_step(
        state, observe(5.0, (worker(101, "stopping"), worker(102, "stopping"), worker(103)))
    )
    assert again == [AskStop((103,))]
    assert stop_step(state, observe(6.0, (worker(103, "stopping"),))) == []  # no arrival yet
    assert not state.arrived


def test_workers_that_do_not_stop_within_the_grace_are_killed_and_then_left_behind() -> None:
    state = requested()
    stop_step(state, observe(0.0, (worker(101),)))
    assert stop_step(state, observe(20.0, (worker(101, "stopping"),))) == []
    killed = stop_step(state, observe(20.5, (worker(101, "stopping"),)))
    assert killed[-1] == KillOld((101,)) and "did not stop within 20 s" in killed[0].message
    assert stop_step(state, observe(30.0, (worker(101, "failed"),))) == []  # not yet stuck_s
    # Still there (uninterruptible sleep) stuck_s after the kill: the node says where it is.
    assert stop_step(state, observe(31.0, (worker(101, "failed"),)))[-1] == PersistFinal(7)


def test_once_the_workers_are_gone_the_newest_commit_is_persisted_then_the_node_arrives() -> None:
    state = requested()
    assert stop_step(state, observe(0.0))[-1] == PersistFinal(7)
    assert stop_step(state, observe(1.0, checkpoint="pending")) == []
    assert stop_step(state, observe(2.0, checkpoint="persisted")) == [ArriveStop(7, "persisted")]
    assert state.arrived
    assert stop_step(state, observe(3.0, checkpoint="persisted")) == []  # once


def test_a_periodic_persist_of_the_same_step_already_pending_is_not_asked_again() -> None:
    state = requested()
    actions = stop_step(state, observe(0.0, checkpoint="pending"))
    assert not any(isinstance(a, PersistFinal) for a in actions)
    assert stop_step(state, observe(1.0, checkpoint="persisted")) == [ArriveStop(7, "persisted")]


def test_a_checkpoint_that_does_not_come_is_reported_failed_not_waited_for_forever() -> None:
    slow = requested()
    stop_step(slow, observe(0.0))
    assert stop_step(slow, observe(900.0, checkpoint="pending")) == []
    assert stop_step(slow, observe(901.0, checkpoint="pending")) == [
        ArriveStop(7, "failed: not persisted within 900 s")
    ]
    refused = requested()  # the durability part refused the persist: it stays unknown
    stop_step(refused, observe(0.0))
    arrived = stop_step(refused, observe(1.0))
    assert arrived == [ArriveStop(7, "failed: not submitted (the step is no commit held here)")]
    failed = requested()
    stop_step(failed, observe(0.0))
    assert stop_step(failed, observe(1.0, checkpoint="failed: ENOSPC")) == [
        ArriveStop(7, "failed: ENOSPC")
    ]


def test_without_a_persist_dir_or_a_commit_the_node_arrives_at_once() -> None:
    off = requested()
    assert stop_step(off, observe(0.0, checkpoint="off"))[-1] == ArriveStop(7, "off")
    spare = requested()
    assert stop_step(spare, observe(0.0, committed=-1, checkpoint="none"))[-1] == ArriveStop(
        -1, "none"
    )


def test_the_leader_ends_the_job_once_every_member_arrived_at_the_lowest_step() -> None:
    state = requested()
    stop_step(state, observe(0.0, checkpoint="off"))
    members = frozenset({"a", "b", "c"})
    some = {"a": {"step": 7, "checkpoint": "persisted"}, "c": {"step": -1, "checkpoint": "none"}}
    assert stop_lead_step(state, StopLeadObservation(5.0, members, some, 60.0)) == []
    every = {**some, "b": {"step": 6, "checkpoint": "persisted"}}
    actions = stop_lead_step(state, StopLeadObservation(6.0, members, every, 60.0))
    assert actions[0] == EndStopped(
        "stopped by ops@host (maintenance); step 6 committed, checkpoint persisted", 6
    )
    assert stop_lead_step(state, StopLeadObservation(7.0, members, every, 60.0)) == []  # once


def test_past_its_deadline_the_leader_ends_the_job_naming_the_silent_and_the_failed() -> None:
    state = requested()
    stop_step(state, observe(0.0, checkpoint="off"))
    members = frozenset({"a", "b", "c"})
    arrivals = {
        "a": {"step": 7, "checkpoint": "persisted"},
        "b": {"step": 7, "checkpoint": "failed: ENOSPC"},
    }
    assert stop_lead_step(state, StopLeadObservation(60.0, members, arrivals, 60.0)) == []
    end = stop_lead_step(state, StopLeadObservation(60.5, members, arrivals, 60.0))[0]
    assert isinstance(end, EndStopped) and end.step == 7
    assert end.reason == (
        "stopped by ops@host (maintenance); step 7 committed; b: checkpoint failed: ENOSPC; "
        "not heard from: c"
    )
