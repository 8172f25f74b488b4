"""The follower's pure step (elasticpp.agent.follower.step): each phase decided from plain values,
the clock passed in as floats, the results of its actions fed back by hand. No etcd, no
processes, no sleeps."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from elasticpp.agent.actions import (
    ArriveDone,
    ArriveStarted,
    ArriveStepped,
    ArriveStopped,
    AskStop,
    AssignRanks,
    CleanLocal,
    CleanResume,
    DrainWorkerEvents,
    Event,
    KillOld,
    RecordHalt,
    RemoveResumeDir,
    ReportFailure,
    SkipRecord,
    StartFetch,
)
from elasticpp.agent.follower.step import (
    AssignOutcome,
    FetchOutcome,
    FetchStatus,
    FollowerObservation,
    FollowerState,
    GenerationProgress,
    OldWorker,
    follower_arrived,
    follower_assigned,
    follower_fetch_started,
    follower_step,
)
from elasticpp.agent.kernel.decide import MOVING_DEADLINE_FLOOR_S, STARTING_DEADLINE_FLOOR_S, Phase
from elasticpp.agent.kernel.limits import FETCH_STALL_S, STOP_GRACE_S
from elasticpp.cluster.records import GenerationRecord
from elasticpp.plan import Plan
from tests.agents import plan_over as _plan

RESUME: dict[str, Any] = {"step": 4, "fetches": {}}


def _record(generation: int, nodes: tuple[str, ...] = ("n0",), **extra: Any) -> GenerationRecord:
    return GenerationRecord(
        generation, _plan(generation, nodes).to_dict(), "n0", 1000.0, extra=extra
    )


def _obs(now_s: float = 100.0, **fields: Any) -> FollowerObservation:
    base = FollowerObservation(
        now_s=now_s,
        wall_s=5000.0 + now_s,
        node_id="n0",
        record=None,
        plan=None,
        plan_error=None,
        steps=5,
        hang_timeout_s=30.0,
        stop_timeout_s=5.0,
        ready_timeout_s=7.0,
    )
    return replace(base, **fields)


def _following(
    phase: Phase, generation: int = 2, since_s: float = 100.0, **extra: Any
) -> tuple[FollowerState, GenerationProgress]:
    record = _record(generation, **extra)
    gs = GenerationProgress(
        record,
        Plan.from_dict(record.plan),
        phase=phase,
        phase_since_s=since_s,
        stop_began_s=since_s,
    )
    return FollowerState(gen=gs), gs


def test_a_newer_generation_is_entered_and_observed_before_anything_is_done_in_it() -> None:
    state = FollowerState(detected={2: 1.0, 3: 2.0, 4: 3.0})
    rec = _record(3, reason="node n1 lost")
    actions = follower_step(state, _obs(record=rec, plan=_plan(3)))
    assert state.gen is not None and state.gen.generation == 3
    assert state.gen.phase is Phase.STOPPING and state.gen.phase_since_s == 100.0
    assert state.detected == {4: 3.0}  # detection times up to the entered generation go
    [event] = actions  # the old workers are observed relative to the new generation next
    assert isinstance(event, Event) and "stopping now" in event.message


def test_a_generation_whose_plan_cannot_be_read_is_skipped_and_counted() -> None:
    state, gs = _following(Phase.RUNNING)
    actions = follower_step(state, _obs(record=_record(3), plan=None, plan_error="version 99"))
    assert state.gen is gs and gs.phase is Phase.RUNNING
    assert actions == [SkipRecord(3, "version 99")]


def test_old_workers_are_killed_at_once_for_a_loss_and_fail_the_node_if_they_outlive_it() -> None:
    state, gs = _following(Phase.STOPPING)
    old = (OldWorker(100, alive=True, active=True), OldWorker(101, alive=True, active=False))
    assert follower_step(state, _obs(100.0, old_workers=old)) == [KillOld((100, 101))]
    assert gs.killed_at_s == 100.0 and gs.phase is Phase.STOPPING
    assert follower_step(state, _obs(105.0, old_workers=old)) == [KillOld((100, 101))]
    assert gs.phase is Phase.STOPPING  # stop_timeout_s (5 s) not yet past
    actions = follower_step(state, _obs(105.5, old_workers=old))
    assert actions[0] == KillOld((100, 101))
    report = actions[1]
    assert isinstance(report, ReportFailure) and report.culprit and report.severe
    assert "100, 101 still alive 6 s after SIGKILL" in report.reason
    assert gs.phase is Phase.FAILED


def test_a_graceful_stop_asks_once_and_kills_after_the_grace() -> None:
    state, gs = _following(Phase.STOPPING, graceful=True)
    old = (OldWorker(100, alive=True, active=True), OldWorker(101, alive=True, active=False))
    assert follower_step(state, _obs(100.0, old_workers=old)) == [AskStop((100,))]
    assert follower_step(state, _obs(100.0 + STOP_GRACE_S, old_workers=old)) == []
    late = 100.0 + STOP_GRACE_S + 1
    assert follower_step(state, _obs(late, old_workers=old)) == [KillOld((100, 101))]
    assert gs.killed_at_s == late


def test_stopping_becomes_moving_only_once_stopped_is_written() -> None:
    state, gs = _following(Phase.STOPPING)
    gone = (OldWorker(100, alive=False, active=False),)
    actions = follower_step(state, _obs(101.0, old_workers=gone))
    assert actions == [DrainWorkerEvents(), CleanResume(2), ArriveStopped(2, 5101.0)]
    assert gs.phase is Phase.STOPPING  # nothing is in etcd yet
    # etcd refused the write: the phase stays, and the next step writes again.
    assert follower_arrived(state, ArriveStopped(2, 5101.0), False, 101.0) == []
    assert gs.phase is Phase.STOPPING
    assert follower_step(state, _obs(102.0))[-1] == ArriveStopped(2, 5102.0)
    assert follower_arrived(state, ArriveStopped(2, 5102.0), True, 102.5) == []
    assert gs.phase is Phase.MOVING and gs.phase_since_s == 102.5


def test_a_spare_is_idle_only_once_started_is_written() -> None:
    state, gs = _following(Phase.MOVING, generation=2)
    spare = _record(2, ("n1",))
    state.gen = gs = replace(gs, record=spare, plan=Plan.from_dict(spare.plan))
    assert follower_step(state, _obs()) == []  # no resume instruction yet
    [arrive] = follower_step(state, _obs(resume=RESUME))
    assert arrive == ArriveStarted(2, 0.0, 5100.0, spare=True)
    assert follower_arrived(state, arrive, False, 100.0) == [] and gs.phase is Phase.MOVING
    [event] = follower_arrived(state, arrive, True, 100.0)
    assert gs.phase is Phase.IDLE and isinstance(event, Event) and "spare" in event.message


def test_the_fetch_starts_once_for_the_generation_followed() -> None:
    state, gs = _following(Phase.MOVING)
    [start] = follower_step(state, _obs(resume=RESUME))
    assert start == StartFetch(2, RESUME)
    assert follower_fetch_started(state, start) is True
    assert gs.fetch_started and gs.resume == RESUME
    assert follower_fetch_started(state, start) is False  # once
    # A late start of an older generation's fetch changes nothing.
    assert follower_fetch_started(state, StartFetch(1, {"step": 9})) is False
    assert gs.resume == RESUME
    running = FetchStatus(started=True, idle_s=1.0)
    assert follower_step(state, _obs(resume=RESUME, fetch=running)) == []


def test_movings_deadline_is_held_while_bytes_arrive_and_runs_when_they_stop() -> None:
    state, gs = _following(Phase.MOVING, since_s=0.0)
    far = 10_000.0
    receiving = FetchStatus(started=True, idle_s=FETCH_STALL_S)
    assert follower_step(state, _obs(far, resume=RESUME, fetch=receiving)) == []
    assert gs.phase is Phase.MOVING and gs.phase_since_s == far  # held
    stalled = FetchStatus(started=True, idle_s=FETCH_STALL_S + 1)
    deadline = max(MOVING_DEADLINE_FLOOR_S, 30.0)
    assert follower_step(state, _obs(far + deadline, resume=RESUME, fetch=stalled)) == []
    [report] = follower_step(state, _obs(far + deadline + 1, resume=RESUME, fetch=stalled))
    assert isinstance(report, ReportFailure) and f"waited {deadline:.0f} s" in report.reason
    assert gs.phase is Phase.FAILED


def test_a_failed_fetch_fails_the_generation_and_blames_a_full_disk_on_this_node() -> None:
    state, gs = _following(Phase.MOVING)
    outcome = FetchOutcome(error="OSError: [Errno 28] No space left", disk_error=True)
    done = FetchStatus(started=True, outcome=outcome)
    event, report, remove = follower_step(state, _obs(resume=RESUME, fetch=done))
    assert isinstance(event, Event) and "state fetch failed" in event.message
    assert isinstance(report, ReportFailure) and report.culprit and report.severe
    assert remove == RemoveResumeDir(2) and gs.phase is Phase.FAILED


def test_ranks_are_assigned_when_enough_spares_are_ready_and_starting_follows_success() -> None:
    state, gs = _following(Phase.MOVING)
    done = FetchStatus(started=True, outcome=FetchOutcome(done_at=4242.0))
    assert follower_step(state, _obs(resume=RESUME, fetch=done, ready_spares=0)) == []
    assert gs.fetch_done_at == 4242.0
    [assign] = follower_step(state, _obs(resume=RESUME, fetch=done, ready_spares=1))
    assert assign == AssignRanks(2, RESUME)
    # A ready spare died before it was taken: nothing fails, the next step tries again.
    assert follower_assigned(state, assign, AssignOutcome(assigned=False), 100.0) == []
    assert gs.phase is Phase.MOVING
    assert follower_assigned(state, assign, AssignOutcome(assigned=True), 101.0) == []
    assert gs.phase is Phase.STARTING and gs.phase_since_s == 101.0


def test_an_assignment_that_fails_fails_the_generation() -> None:
    state, gs = _following(Phase.MOVING)
    [report] = follower_assigned(
        state, AssignRanks(2, RESUME), AssignOutcome(False, "broken pipe"), 100.0
    )
    assert isinstance(report, ReportFailure) and "broken pipe" in report.reason
    assert gs.phase is Phase.FAILED


def test_a_replaced_spare_that_this_node_waits_for_fails_the_generation() -> None:
    state, gs = _following(Phase.MOVING)
    done = FetchStatus(started=True, outcome=FetchOutcome(done_at=1.0))
    [report] = follower_step(state, _obs(resume=RESUME, fetch=done, spare_replaced=True))
    assert isinstance(report, ReportFailure) and report.culprit and report.severe
    assert "not ready within 7 s" in report.reason and gs.phase is Phase.FAILED


def test_starting_becomes_running_only_once_started_is_written() -> None:
    state, gs = _following(Phase.STARTING)
    gs.fetch_done_at = 4242.0
    assert follower_step(state, _obs(all_started=False)) == []
    [arrive] = follower_step(state, _obs(all_started=True))
    assert arrive == ArriveStarted(2, 4242.0, 5100.0)
    assert follower_arrived(state, arrive, False, 100.0) == []
    assert gs.phase is Phase.STARTING
    assert follower_arrived(state, arrive, True, 100.0) == [CleanLocal(2)]
    assert gs.phase is Phase.RUNNING


def test_stepped_is_written_once_every_rank_here_completed_a_step_of_the_generation() -> None:
    """What the leader clears a node's strikes on: its ranks trained, not only started."""
    state, gs = _following(Phase.STARTING)
    assert follower_step(state, _obs(all_started=True, stepped=4)) == [
        ArriveStarted(2, 5100.0, 5100.0)
    ]
    follower_arrived(state, ArriveStarted(2, 5100.0, 5100.0), True, 100.0)
    assert follower_step(state, _obs(stepped=-1)) == []  # running, no step completed yet
    [arrive] = follower_step(state, _obs(stepped=4))
    assert arrive == ArriveStepped(2, 4, 5100.0)
    assert follower_arrived(state, arrive, False, 100.0) == []  # etcd refused it
    assert follower_step(state, _obs(stepped=5)) == [ArriveStepped(2, 5, 5100.0)]  # again
    assert follower_arrived(state, arrive, True, 100.0) == [] and gs.phase is Phase.RUNNING
    assert follower_step(state, _obs(stepped=6)) == []  # once a generation


def test_startings_deadline_fails_the_generation() -> None:
    state, gs = _following(Phase.STARTING, since_s=0.0)
    deadline = max(STARTING_DEADLINE_FLOOR_S, 2 * 30.0)
    assert follower_step(state, _obs(deadline)) == []
    [report] = follower_step(state, _obs(deadline + 1))
    assert isinstance(report, ReportFailure) and "its ranks to start (starting)" in report.reason
    assert gs.phase is Phase.FAILED


def test_the_job_is_done_here_only_once_done_is_written() -> None:
    state, gs = _following(Phase.RUNNING)
    [arrive] = follower_step(state, _obs(done_ranks=frozenset({0})))
    assert arrive == ArriveDone(2, 5, 5100.0)
    assert follower_arrived(state, arrive, False, 100.0) == [] and gs.phase is Phase.RUNNING
    assert follower_step(state, _obs(done_ranks=frozenset({0}))) == [arrive]  # again
    [event] = follower_arrived(state, arrive, True, 100.0)
    assert isinstance(event, Event) and "finished all 5 steps" in event.message
    assert gs.phase is Phase.DONE
    assert follower_step(state, _obs(done_ranks=frozenset({0}))) == []


def test_a_halt_holds_the_job_and_a_later_finish_is_ignored() -> None:
    state, gs = _following(Phase.RUNNING)
    assert follower_step(state, _obs(halted="loss nan")) == [RecordHalt("loss nan")]
    assert gs.phase is Phase.HALTED
    assert follower_step(state, _obs(halted="loss nan", done_ranks=frozenset({0}))) == []
    assert follower_arrived(state, ArriveDone(2, 5, 1.0), True, 100.0) == []  # ignored
    assert gs.phase is Phase.HALTED


def test_results_of_an_older_generation_or_an_illegal_transition_are_ignored() -> None:
    state, gs = _following(Phase.FAILED, generation=3)
    assert follower_arrived(state, ArriveStopped(2, 1.0), True, 100.0) == []
    assert follower_arrived(state, ArriveStopped(3, 1.0), True, 100.0) == []
    assert follower_assigned(state, AssignRanks(2, RESUME), AssignOutcome(True), 100.0) == []
    assert gs.phase is Phase.FAILED  # FAILED -> MOVING is not a transition: ignored
