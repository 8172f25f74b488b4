"""The leader's pure step (elasticpp.agent.leader.step): plain observations with the clock in
them, actions as data, and the outcomes of writes and reads fed back by hand, as the
executor feeds them. No etcd, no files, no sleeps: deadlines pass by moving `now_s`."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from elasticpp.agent.actions import (
    CheckNeverCommitted,
    CleanRendezvous,
    CompactHistory,
    ConfirmDead,
    CountRecovery,
    Event,
    Housekeep,
    PublishResumeWait,
    ReadCommitRecords,
    ReadSafe,
    RecordTimeline,
    Reread,
    ResolveResume,
    SetAside,
    WriteGeneration,
    WriteResume,
    WriteSafe,
)
from elasticpp.agent.kernel.limits import COMPACT_EVERY_S, SAFE_EVERY_S, STOPPED_WAIT_MARGIN_S
from elasticpp.agent.leader.resume import WAIT_REPULL_EVERY_S
from elasticpp.agent.leader.state import LeaderState
from elasticpp.agent.leader.step import (
    LeaderObservation,
    leader_fresh_checked,
    leader_generation_written,
    leader_resume_resolved,
    leader_resume_wait_published,
    leader_resume_written,
    leader_safe_check,
    leader_safe_read,
    leader_safe_step,
    leader_step,
    leader_timeline_recorded,
)
from elasticpp.agent.sick import Quarantine
from elasticpp.cluster.barriers import RESUME_MEMBER
from elasticpp.cluster.records import (
    CommitRecord,
    SafeStep,
    incarnation_tag,
)
from elasticpp.store.instruction import node_fetches
from tests.leaders import LEADER_SPEC as SPEC
from tests.leaders import MEMBERS, WALL
from tests.leaders import holdings_of as _holdings
from tests.leaders import leader_obs as _obs
from tests.leaders import leader_record as _record
from tests.leaders import leader_state as _state


def _stopped(step: int | None, next_step: int = 0) -> dict[str, Any]:
    empty = {"format_version": 4, "node_id": "x", "steps": []}
    return {
        n: {"holdings": empty if step is None else _holdings(n, step), "next_step": next_step}
        for n in ("n0", "n1")
    }


def test_a_generation_is_written_by_compare_and_swap_and_counted_only_once_written() -> None:
    state = _state()
    [write] = leader_step(state, _obs(100.0))
    assert isinstance(write, WriteGeneration)
    assert (write.record.generation, write.record.leader, write.expected_rev) == (1, "n0", 7)
    # The planned nodes and their incarnations' tags; addresses are in the member keys.
    assert write.record.planned_nodes == ("n0", "n1")
    assert write.record.incarnation_tags == {n: incarnation_tag(f"i-{n}") for n in ("n0", "n1")}
    assert not {"nodes", "sources"} & set(write.record.extra)
    assert write.record.extra["planned_at"] == write.record.created_at == WALL + 100.0
    assert write.record.store_address == "h:1" and not write.graceful
    # Refused (the record changed since it was read, or the term is over): nothing moves.
    assert leader_generation_written(state, write, False) == []
    assert (state.replan_failures, state.replan_not_before_s) == (0, 0.0)
    assert leader_generation_written(state, write, True) == [
        Event("decision", write.message),
        Reread(),
    ]
    assert state.replan_failures == 1 and state.replan_not_before_s == 100.0
    assert "generation 1 = " in write.message


def test_generations_that_keep_failing_are_backed_off_and_one_that_trains_resets_it() -> None:
    state = _state()
    for g in (1, 2, 3):  # each generation fails as it starts
        failing = _obs(100.0, record=_record(g), failed=frozenset({"n1"}), follows=False)
        [write] = leader_step(state, failing)
        assert isinstance(write, WriteGeneration) and write.record.generation == g + 1
        leader_generation_written(state, write, True)
    assert state.replan_failures == 3 and state.replan_not_before_s == 100.25
    failing = _obs(100.0, record=_record(4), failed=frozenset({"n1"}), follows=False)
    assert leader_step(state, replace(failing, now_s=100.2)) == []  # within the backoff
    [write] = leader_step(state, replace(failing, now_s=100.25))
    leader_generation_written(state, write, True)
    assert state.replan_not_before_s == 100.25 + 0.5  # doubles
    record = _record(5)  # the one just written, as the view holds it
    # Every planned node started: not trained yet, the count stays (a generation whose
    # workers die in their first step is one more failure, not a fresh start).
    state.at(5, 101.0).resume_written = True
    started = {n: {"at": WALL, "moved_at": WALL} for n in ("n0", "n1")}
    [timeline] = leader_timeline_step_of(
        state, _obs(101.0, record=record, barriers={"started-5": started})
    )
    assert isinstance(timeline, RecordTimeline) and state.replan_failures == 4
    # A node's ranks completed a step of it: the generation trained, the count starts again.
    stepped = {"n0": {"step": 9, "at": WALL}}
    leader_step(
        state, _obs(102.0, record=record, barriers={"started-5": started, "stepped-5": stepped})
    )
    assert state.replan_failures == 0


def test_nothing_is_decided_again_until_the_view_holds_the_terms_own_write() -> None:
    """The leader re-planned the change it had just written, 3 to 6 times a transition at 64
    nodes, until its write's watch event reached its view: each a plan and a refused
    compare-and-swap (a read of the generation record)."""
    state = _state()
    lost = _obs(100.0, record=_record(1), members={"n0": MEMBERS["n0"]})  # n1 lost
    [write] = leader_step(state, lost)
    assert isinstance(write, WriteGeneration) and write.record.generation == 2
    leader_generation_written(state, write, True)
    assert leader_step(state, replace(lost, now_s=101.0)) == []  # the view still says 1
    refused = _state()
    [again] = leader_step(refused, lost)
    leader_generation_written(refused, again, False)  # a write that lost: decide again
    assert isinstance(leader_step(refused, replace(lost, now_s=101.0))[0], WriteGeneration)
    # The view holds generation 2 (without n1): the leader carries it on, re-plans nothing.
    caught_up = _obs(101.0, record=_record(2, ("n0",)), members={"n0": MEMBERS["n0"]})
    assert not [a for a in leader_step(state, caught_up) if isinstance(a, WriteGeneration)]


def leader_timeline_step_of(state: LeaderState, obs: LeaderObservation) -> list[Any]:
    """The timeline part of the leader's step (a running generation, nothing to re-plan)."""
    return [a for a in leader_step(state, obs) if isinstance(a, RecordTimeline)]


def test_a_wait_and_a_layout_that_cannot_be_planned_are_told_once() -> None:
    state = _state()
    short = replace(SPEC, min_nodes=3)
    [told] = leader_step(state, _obs(100.0, spec=short))
    assert told == Event("decision", "waiting: only 2 usable node(s), min_nodes is 3")
    assert leader_step(state, _obs(101.0, spec=short)) == []
    tiny = replace(
        SPEC,
        device={
            "memory_gib": 1e-6,
            "peak_tflops": 1.0,
            "intra_node_gbps": 1.0,
            "inter_node_gbps": 1.0,
        },
    )  # nothing fits
    [told] = leader_step(state, _obs(102.0, spec=tiny))
    assert isinstance(told, Event) and told.message.startswith("cannot plan for ['n0', 'n1']")
    assert leader_step(state, _obs(103.0, spec=tiny)) == []


def test_a_graceful_change_waits_for_the_current_transitions_resume_instruction() -> None:
    state = _state()
    record = _record(1)
    joined = {**MEMBERS, "n2": {"address": "n2:1", "slots": 1, "incarnation": "i-n2"}}
    stopped = {**_stopped(None), "n2": _stopped(None)["n0"]}
    obs = _obs(100.0, record=record, members=joined, barriers={"stopped-1": stopped})
    actions = leader_step(state, obs)  # n2 joined; generation 1 still moves
    assert not any(isinstance(a, WriteGeneration) for a in actions)
    assert [type(a) for a in actions] == [ResolveResume]
    resumed = {"resume-1": {RESUME_MEMBER: {"step": 0}}}
    [write] = leader_step(state, replace(obs, barriers=resumed))
    assert isinstance(write, WriteGeneration) and write.graceful
    assert write.record.extra["reason"] == "join of n2"


def test_the_resume_waits_for_a_node_missing_at_stopped_probing_it_every_two_seconds() -> None:
    state = _state()
    record = _record(2)
    stopped = {"stopped-2": {"n0": _stopped(None)["n0"]}}
    obs = _obs(100.0, record=record, barriers=stopped)
    assert leader_step(state, obs) == []  # the wait starts
    assert leader_step(state, replace(obs, now_s=101.0)) == []
    assert leader_step(state, replace(obs, now_s=102.5)) == [ConfirmDead(("n1",))]
    assert leader_step(state, replace(obs, now_s=103.0)) == []
    deadline_s = 100.0 + SPEC.stop_timeout_s + STOPPED_WAIT_MARGIN_S
    not_yet = leader_step(state, replace(obs, now_s=deadline_s))
    assert not_yet == [ConfirmDead(("n1",))]  # probed again, not set aside yet
    [aside] = leader_step(state, replace(obs, now_s=deadline_s + 0.5))  # probed 0.5 s ago
    assert isinstance(aside, SetAside)
    [quarantine] = aside.decisions
    assert isinstance(quarantine, Quarantine)
    assert (quarantine.entry.node, quarantine.entry.incarnation) == ("n1", "i-n1")
    assert "did not arrive at stopped-2 within 15 s" in quarantine.entry.reason
    # n1 is in the plan: no resume; the next plan goes without it.
    assert not state.resume_written


def test_a_node_outside_the_plan_missing_at_stopped_is_set_aside_and_the_others_resume() -> None:
    state = _state()
    record = _record(2)
    spare = {**MEMBERS, "n2": {"address": "n2:1", "slots": 1, "incarnation": "i-n2"}}
    short = replace(SPEC, max_nodes=2)  # n2 is a spare, not a join
    obs = _obs(100.0, record=record, members=spare, barriers={"stopped-2": _stopped(8)}, spec=short)
    assert leader_step(state, obs) == []
    *_, aside, resolve = leader_step(state, replace(obs, now_s=116.0))
    assert isinstance(aside, SetAside) and isinstance(resolve, ResolveResume)
    assert resolve.live_nodes == ("n0", "n1") and sorted(resolve.holdings) == ["n0", "n1"]


def test_the_resume_is_resolved_from_what_the_nodes_hold_and_on_record_only_once_written() -> None:
    state = _state()
    record = _record(2)
    obs = _obs(100.0, record=record, barriers={"stopped-2": _stopped(8, next_step=10)})
    [resolve] = leader_step(state, obs)
    assert isinstance(resolve, ResolveResume) and resolve.persist_dir is None
    [write] = leader_resume_resolved(state, resolve, None)
    assert isinstance(write, WriteResume) and write.generation == 2
    assert (write.value["step"], write.value["recomputed"], write.value["at"]) == (8, 2, WALL + 100)
    # Each piece once, each node taking its own: every node derives its fetches with the plan.
    assert write.value["format_version"] == 2 and write.value["by_node"] == {}
    plan = resolve.plan
    [fetch, *_] = node_fetches(write.value, plan, "n1")
    assert (fetch.origin_node, fetch.source_node, fetch.size) == ("n1", "n1", 10)
    assert leader_resume_written(state, write, False) == []  # written before, or term over
    assert not state.resume_written
    told = leader_resume_written(state, write, True)
    assert told == [Event("decision", "leader: generation 2 resumes at step 8")]
    assert state.resume_written
    assert [a for a in leader_step(state, obs) if isinstance(a, ResolveResume)] == []


def test_a_fresh_job_starts_at_step_0_and_one_that_committed_before_does_not_start_over() -> None:
    state = _state()
    record = _record(1)
    [resolve] = leader_step(
        state, _obs(100.0, record=record, barriers={"stopped-1": _stopped(None)})
    )
    assert isinstance(resolve, ResolveResume)
    [check] = leader_resume_resolved(state, resolve, None)  # nothing held anywhere
    assert isinstance(check, CheckNeverCommitted) and "no committed state" in check.why
    [write] = leader_fresh_checked(state, check, False)
    assert isinstance(write, WriteResume) and write.value["step"] == 0
    assert write.value["pieces"] == {} and node_fetches(write.value, resolve.plan, "n0") == ()
    # etcd says the job committed before: it waits and says why, once in the log, and in
    # etcd until etcd has it (its followers wait with it instead of failing the generation).
    [told, wait] = leader_fresh_checked(state, check, True)
    assert isinstance(told, Event) and "does not start over" in told.message
    assert isinstance(wait, PublishResumeWait) and wait.generation == 1
    assert "does not start over" in wait.why and "no committed state" in wait.why
    assert leader_fresh_checked(state, check, True) == [wait]  # not in etcd yet: asked again
    assert leader_resume_wait_published(state, wait, True) == []
    assert leader_fresh_checked(state, check, True) == []
    assert not state.resume_written


def test_a_job_whose_state_is_held_but_does_not_resolve_waits_without_asking_etcd() -> None:
    state = _state()
    record = _record(1)
    partial = {
        n: {"holdings": _holdings(n, 5, SPEC.model.units[:1]), "next_step": 6} for n in ("n0", "n1")
    }
    obs = _obs(100.0, record=record, barriers={"stopped-1": partial})
    [resolve] = leader_step(state, obs)
    assert isinstance(resolve, ResolveResume)
    [told, wait] = leader_resume_resolved(state, resolve, None)
    assert isinstance(told, Event) and "cannot resume" in told.message
    assert isinstance(wait, PublishResumeWait)
    assert "does not start over" in state.last_wait
    # Waiting: the same arrivals are not resolved again every turn; the checkpoint is looked
    # at again (persist_dir read by the executor) every WAIT_REPULL_EVERY_S.
    leader_resume_wait_published(state, wait, True)
    assert leader_step(state, replace(obs, now_s=101.0)) == []
    assert leader_step(state, replace(obs, now_s=100.9 + WAIT_REPULL_EVERY_S)) == []
    [again] = leader_step(state, replace(obs, now_s=101.0 + WAIT_REPULL_EVERY_S))
    assert isinstance(again, ResolveResume)


def test_an_earlier_leaders_resume_instruction_is_taken_and_stale_results_are_ignored() -> None:
    state = _state()
    record = _record(2)
    barriers = {"resume-2": {RESUME_MEMBER: {"step": 4, "fetches": {}}}}
    actions = leader_step(state, _obs(100.0, record=record, barriers=barriers))
    assert not any(isinstance(a, (ResolveResume, WriteResume)) for a in actions)
    assert state.resume_written
    # A result of generation 2 that comes back once the state is on generation 3.
    state.at(3, 101.0)
    assert leader_resume_written(state, WriteResume(2, {"step": 4}), True) == []
    assert not state.resume_written


def test_the_timeline_is_written_once_every_planned_node_started() -> None:
    state = _state()
    record = _record(2, previous_layout="pp1 tp1 dp1", detected_at=WALL - 3.0)
    state.at(2, 100.0).resume_written = True
    state.sick.strikes["n1"] = 2
    barriers: dict[str, dict[str, Any]] = {
        "resume-2": {RESUME_MEMBER: {"step": 8, "recomputed": 2}},
        "stopped-2": {n: {"at": WALL - 2.0} for n in ("n0", "n1")},
        "started-2": {"n0": {"at": WALL, "moved_at": WALL - 1.0}},
    }
    assert leader_timeline_step_of(state, _obs(100.0, record=record, barriers=barriers)) == []
    barriers["started-2"]["n1"] = {"at": WALL + 1.0, "moved_at": WALL - 0.5}
    [record_it] = leader_timeline_step_of(state, _obs(101.0, record=record, barriers=barriers))
    assert isinstance(record_it, RecordTimeline) and record_it.recovery
    t = record_it.timeline
    assert (t["resume_step"], t["steps_recomputed"], t["stopped_s"]) == (8, 2, 1.0)
    assert (t["moved_s"], t["resumed_s"]) == (2.5, 4.0)
    assert state.sick.strikes == {"n1": 2}  # started, not trained: n1's strikes stay
    assert leader_timeline_recorded(state, record_it, False) == []  # the term is over
    assert not state.timeline_written
    housekeep, clean, count, told = leader_timeline_recorded(state, record_it, True)
    assert (housekeep, clean, count) == (Housekeep(2), CleanRendezvous(2), CountRecovery(4.0))
    assert isinstance(told, Event) and told.kind == "recovery"
    assert state.timeline_written
    assert leader_timeline_step_of(state, _obs(102.0, record=record, barriers=barriers)) == []


def test_a_timeline_an_earlier_leader_wrote_is_not_written_again() -> None:
    state = _state()
    state.sick.seed({"n1": 2})  # carried by the record this term started from
    record = _record(2)
    state.at(2, 100.0).resume_written = True
    barriers = {
        "timelines": {"gen-2": {"generation": 2}},
        "started-2": {n: {"at": WALL, "moved_at": WALL} for n in ("n0", "n1")},
    }
    assert leader_timeline_step_of(state, _obs(100.0, record=record, barriers=barriers)) == []
    assert state.timeline_written
    assert state.sick.strikes == {"n1": 2}  # it started; whether it trained, stepped-2 says


def test_strikes_are_cleared_only_for_the_nodes_whose_ranks_completed_a_step() -> None:
    """Before, every node that arrived at `started-G` had its strikes cleared: a node whose
    workers die in their first step was struck, cleared at the next start, struck again, and
    never quarantined (7 failed generations with quarantine_after: 2), while the failed
    generations spent the job's failure budget. Now only a node at `stepped-G` is cleared,
    whoever leads (a term that starts from the record's strikes reads the same barrier)."""
    state = _state()
    state.sick.seed({"n0": 1, "n1": 2})  # carried by the record this term started from
    record = _record(2)
    state.at(2, 100.0).resume_written = True
    barriers: dict[str, dict[str, Any]] = {
        "started-2": {n: {"at": WALL, "moved_at": WALL} for n in ("n0", "n1")},
        "stepped-2": {"n0": {"step": 5, "at": WALL + 1.0}},
    }
    leader_step(state, _obs(101.0, record=record, barriers=barriers))
    assert state.sick.strikes == {"n1": 2}  # n0's ranks trained; n1's have not (yet)
    state.sick.strikes["n0"] = 1  # (a stale look at the same arrivals clears nothing again)
    leader_step(state, _obs(101.5, record=record, barriers=barriers))
    assert state.sick.strikes == {"n0": 1, "n1": 2}
    barriers["stepped-2"] = {**barriers["stepped-2"], "n1": {"step": 5, "at": WALL + 1.0}}
    leader_step(state, _obs(102.0, record=record, barriers=barriers))
    assert state.sick.strikes == {"n0": 1}  # only the newcomer at stepped-2 is cleared


def test_a_generation_record_carries_the_strikes_into_the_next_term() -> None:
    state = _state()
    [plain] = leader_step(state, _obs(100.0))
    assert isinstance(plain, WriteGeneration) and "strikes" not in plain.record.extra
    state = _state()
    state.sick.strikes = {"n1": 2}
    [write] = leader_step(state, _obs(100.0))
    assert isinstance(write, WriteGeneration)
    assert write.record.extra["strikes"] == {"n1": 2}


def test_the_safe_step_is_computed_every_safe_period_and_written_only_when_it_rises() -> None:
    state = _state()
    record = _record(3)
    obs = _obs(100.0, record=record)
    assert leader_safe_check(state, obs) == []  # not resumed yet
    state.at(3, 100.0).resume_written = True
    [read] = leader_safe_check(state, obs)
    assert read == ReadCommitRecords(3, ("n0", "n1"), 1)
    assert leader_safe_check(state, replace(obs, now_s=100.0 + 0.9 * SAFE_EVERY_S)) == []
    assert leader_safe_check(state, replace(obs, now_s=100.0 + SAFE_EVERY_S)) == [read]
    records = {
        "n0": CommitRecord("n0", 3, 8, (8, 7, 6), {"n1": (7, 6)}),
        "n1": CommitRecord("n1", 3, 8, (8, 7, 6), {"n0": (6,)}),
    }
    [ask] = leader_safe_step(read, records)
    assert ask == ReadSafe(SafeStep(3, 6), 1)
    assert leader_safe_step(read, {}) == []  # no anchor everywhere yet
    assert leader_safe_read(ask, None, 0) == [WriteSafe(SafeStep(3, 6), 0, 1, None)]
    assert leader_safe_read(ask, SafeStep(3, 5), 9) == [
        WriteSafe(SafeStep(3, 6), 9, 1, SafeStep(3, 5))
    ]
    assert leader_safe_read(ask, SafeStep(3, 6), 9) == []  # the same: no write
    assert leader_safe_read(ask, SafeStep(4, 1), 9) == []  # a newer generation's: no lower
    off = replace(SPEC, replication_copies=0)
    assert leader_safe_check(state, _obs(200.0, record=record, spec=off)) == []


def test_a_member_whose_slots_cannot_be_used_is_a_plan_that_cannot_be_made_said_once() -> None:
    state = _state()
    for bad in ("two", -1, None):
        members = {**MEMBERS, "n1": {**MEMBERS["n1"], "slots": bad}}
        first = leader_step(state, _obs(100.0, members=members))
        assert [type(a) for a in first] == [Event], bad
        assert "cannot plan for ['n0', 'n1']" in first[0].message
        assert leader_step(state, _obs(101.0, members=members)) == []  # told once


def test_etcd_history_is_compacted_every_period_of_a_term_while_a_generation_runs() -> None:
    state = _state()
    rec = _record(1)
    barriers = {"resume-1": {RESUME_MEMBER: {"step": 0, "fetches": {}}}}
    assert CompactHistory() not in leader_step(state, _obs(100.0, record=rec, barriers=barriers))
    later = 100.0 + COMPACT_EVERY_S
    assert CompactHistory() not in leader_step(
        state, _obs(later - 1, record=rec, barriers=barriers)
    )
    assert CompactHistory() in leader_step(state, _obs(later, record=rec, barriers=barriers))
    assert CompactHistory() not in leader_step(
        state, _obs(later + 1, record=rec, barriers=barriers)
    )
    # A new term starts its own period.
    fresh = _state()
    assert CompactHistory() not in leader_step(
        fresh, _obs(later + 2, record=rec, barriers=barriers)
    )
