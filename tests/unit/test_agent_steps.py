"""The pure steps of the agent's parts: the end of a job and of a drain (control), the job's
end on every agent (health), the supervisor's deadlines, a follower's watch on the leader
(liveness) and the view of etcd. Each is decided from plain observations with the clock
passed in, and its actions are data (elasticpp.agent.actions)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from elasticpp.agent.actions import (
    DeposeLeader,
    Event,
    JobEndedGauge,
    KillWorker,
    PingTemplate,
    ProbeLeader,
    PublishMemberInfo,
    ReleaseSpares,
    ReplaceSpare,
    ReplaceTemplate,
    ReportFailure,
    Reread,
    SetFloor,
    SpawnWarm,
    StepDown,
    StopWorkers,
    UpdateGauges,
)
from elasticpp.agent.control.step import ControlObservation, ControlState, control_step
from elasticpp.agent.health.step import EXIT_FAILED, HealthState, job_end_step
from elasticpp.agent.kernel.limits import (
    LEADER_SUSPECT_S,
    TEMPLATE_PING_EVERY_S,
    TEMPLATE_RESTART_MIN_S,
)
from elasticpp.agent.liveness.step import (
    LeaderWatch,
    LivenessState,
    leader_deposed,
    leader_probed,
    leader_watch_step,
)
from elasticpp.agent.probe import ProbeResult
from elasticpp.agent.supervisor.step import (
    SupervisorObservation,
    TemplateObservation,
    supervisor_step,
    template_step,
)
from elasticpp.agent.view.step import EtcdRead, ViewState, view_step
from elasticpp.cluster.health import JobEnd
from elasticpp.cluster.records import GenerationRecord, SafeStep

OBS = ControlObservation(
    now_s=100.0,
    node_id="n1",
    generation=3,
    plan_nodes=frozenset({"n0", "n1"}),
    started_everywhere=True,
    finished_here=False,
    done_reported=False,
    job_ended=False,
    workers_alive=True,
    has_spares=True,
    drain_timeout_s=None,
    exit_on_end=True,
)


def test_a_drain_is_announced_once_and_ends_when_a_later_plan_without_the_node_started() -> None:
    state = ControlState()
    first = control_step(state, replace(OBS, drain_timeout_s=60.0))
    assert first[:2] == [PublishMemberInfo(), StepDown("draining")]
    assert isinstance(first[2], Event) and "announced" in first[2].message
    assert state.draining and state.drain_deadline_s == 160.0 and state.exit_code is None
    # Still in the plan, then a plan without it that has not started everywhere yet.
    assert control_step(state, replace(OBS, now_s=101.0)) == []
    later = replace(OBS, now_s=102.0, generation=4, plan_nodes=frozenset({"n0"}))
    assert control_step(state, replace(later, started_everywhere=False)) == []
    assert state.exit_code is None
    [event] = control_step(state, replace(later, started_everywhere=True))
    assert event == Event("decision", "drained") and state.exit_code == 0
    assert control_step(state, later) == []  # decided once


def test_a_plan_without_the_node_of_the_drains_own_generation_is_no_hand_off() -> None:
    state = ControlState()
    control_step(state, replace(OBS, plan_nodes=frozenset({"n0"}), drain_timeout_s=60.0))
    assert state.exit_code is None  # that plan was written before the drain: a spare node


def test_a_drain_ends_at_its_deadline_and_a_second_request_does_not_move_it() -> None:
    state = ControlState()
    control_step(state, replace(OBS, drain_timeout_s=10.0))
    control_step(state, replace(OBS, now_s=105.0, drain_timeout_s=600.0))
    assert state.drain_deadline_s == 110.0
    assert control_step(state, replace(OBS, now_s=110.0)) == []
    [event] = control_step(state, replace(OBS, now_s=110.5))
    assert event.message == "drain timed out" and state.exit_code == 0


def test_a_drain_that_leaves_an_unfinished_job_exits_with_the_unfinished_code() -> None:
    # Under a Kubernetes Job a pod that exits 0 completes its index: only a finished job's
    # agent may say 0.
    job = replace(OBS, unfinished_exit_code=143)
    for ends_with in (
        replace(job, now_s=102.0, generation=4, plan_nodes=frozenset({"n0"})),  # handed off
        replace(job, now_s=200.0),  # timed out
    ):
        state = ControlState()
        control_step(state, replace(job, drain_timeout_s=60.0))
        control_step(state, ends_with)
        assert state.exit_code == 143, ends_with
    finished = ControlState()
    control_step(finished, replace(job, drain_timeout_s=60.0))
    control_step(finished, replace(job, done_reported=True))
    assert finished.exit_code == 0


def test_a_drain_of_a_job_that_is_over_ends_at_once() -> None:
    for over in (
        replace(OBS, job_ended=True),
        replace(OBS, plan_nodes=None, generation=0),
        replace(OBS, done_reported=True, exit_on_end=False),
    ):
        state = ControlState()
        actions = control_step(state, replace(over, drain_timeout_s=60.0))
        assert Event("decision", "drained") in actions and state.exit_code == 0


def test_a_finished_job_exits_once_its_workers_are_gone_or_idles_without_spares() -> None:
    state = ControlState()
    # Shown once in the metrics (elasticpp_job_finished: the alerts stay quiet after it).
    assert control_step(state, replace(OBS, finished_here=True)) == [JobEndedGauge("finished")]
    assert state.job_done and state.exit_code is None  # its workers still exit
    assert control_step(state, replace(OBS, finished_here=True)) == []
    control_step(state, replace(OBS, workers_alive=False))
    assert state.exit_code == 0
    idle = ControlState()
    actions = control_step(
        idle, replace(OBS, done_reported=True, workers_alive=False, exit_on_end=False)
    )
    assert actions[:2] == [JobEndedGauge("finished"), ReleaseSpares()]
    assert idle.exit_code is None
    quiet = replace(OBS, workers_alive=False, has_spares=False, exit_on_end=False)
    assert control_step(idle, quiet) == []  # released: nothing more to do, no exit


def test_an_ended_job_is_told_once_stops_its_workers_every_step_and_exits_with_its_status() -> None:
    end = JobEnd("failed", "failure budget spent", "n0", 1.7e9)
    state = HealthState()
    assert job_end_step(state, None, any_alive=True, exit_on_end=True) == []
    first = job_end_step(state, end, any_alive=True, exit_on_end=True)
    assert first[0] == JobEndedGauge("failed") and first[-1] == StopWorkers()
    assert isinstance(first[1], Event) and f"exits with code {EXIT_FAILED}" in first[1].message
    assert state.exit_code is None  # its workers are still going
    assert job_end_step(state, end, any_alive=False, exit_on_end=True) == [StopWorkers()]
    assert state.exit_code == EXIT_FAILED
    idle = HealthState()
    told = job_end_step(idle, replace(end, status="halted"), any_alive=False, exit_on_end=False)
    assert "idles until it is removed" in told[1].message  # type: ignore[union-attr]
    assert idle.exit_code is None


SUPERVISED = SupervisorObservation(
    now_s=100.0,
    running=((11, 0, 4, 99.0, True), (12, 1, 4, 80.0, True)),  # rank 1's last progress: 20 s ago
    overdue_spares=(),
    spares=2,
    slots=2,
    may_refill=True,
    hang_timeout_s=15.0,
    ready_timeout_s=30.0,
)


def test_a_hung_worker_is_killed_and_its_generation_reported_failed() -> None:
    actions = supervisor_step(SUPERVISED)
    assert actions[1:] == [KillWorker(12), ReportFailure(4, "worker rank 1 hung")]
    assert isinstance(actions[0], Event) and "no progress for 15 s" in actions[0].message
    assert supervisor_step(replace(SUPERVISED, now_s=94.0)) == []  # 14 s: not yet


def test_a_first_step_has_its_own_deadline_a_compiling_worker_is_not_hung() -> None:
    """`compile: true` can take minutes over the first step: until a worker completed its
    generation's first step, the hang rule waits `first_step_timeout_s`."""
    compiling = replace(SUPERVISED, running=((12, 1, 4, 80.0, False),), first_step_timeout_s=120.0)
    assert supervisor_step(compiling) == []  # 20 s into its first step
    assert supervisor_step(replace(compiling, now_s=199.0)) == []  # 119 s
    actions = supervisor_step(replace(compiling, now_s=201.0))
    assert actions[1:] == [KillWorker(12), ReportFailure(4, "worker rank 1 hung")]
    assert "no first step for 120 s" in actions[0].message  # type: ignore[union-attr]
    # Never shorter than the hang rule, and off with it.
    short = replace(compiling, first_step_timeout_s=5.0, now_s=94.0)
    assert supervisor_step(short) == []
    assert supervisor_step(replace(compiling, hang_timeout_s=0.0, now_s=1e6)) == []
    # The spec's deadline: a compiling job's first step gets minutes, any other the hang rule.
    from elasticpp.agent.jobspec import FIRST_STEP_COMPILE_S, parse_job_spec

    base = {"name": "j", "model": "tiny", "global_batch": 4, "micro_batch": 2, "steps": 2,
            "seed": 0, "min_nodes": 1, "max_nodes": 1}  # fmt: skip
    assert parse_job_spec(base).first_step_deadline_s == 30.0
    assert parse_job_spec({**base, "compile": True}).first_step_deadline_s == FIRST_STEP_COMPILE_S
    assert parse_job_spec({**base, "first_step_timeout_s": 90}).first_step_deadline_s == 90.0


def test_a_spare_not_ready_in_time_is_replaced_and_the_pool_refilled_when_spares_are_wanted() -> (
    None
):
    late = replace(SUPERVISED, running=(), overdue_spares=((21, 31.0),))
    actions = supervisor_step(late)
    assert actions[1:] == [ReplaceSpare(21), SpawnWarm()]
    assert "not ready 31 s after its start" in actions[0].message  # type: ignore[union-attr]
    assert supervisor_step(replace(late, may_refill=False))[1:] == [ReplaceSpare(21)]
    assert supervisor_step(replace(SUPERVISED, running=(), spares=1)) == [SpawnWarm()]


TEMPLATE = TemplateObservation(
    pid=7,
    usable=True,
    lost=False,
    why_not="",
    unanswered_s=None,
    since_ping_s=TEMPLATE_PING_EVERY_S,
    age_s=100.0,
    answer_timeout_s=10.0,
)


def test_a_worker_template_is_pinged_between_forks_and_replaced_when_it_does_not_answer() -> None:
    assert template_step(TEMPLATE) == [PingTemplate(7)]
    assert template_step(replace(TEMPLATE, since_ping_s=None)) == [PingTemplate(7)]
    assert template_step(replace(TEMPLATE, since_ping_s=0.5)) == []  # not due yet
    assert template_step(replace(TEMPLATE, unanswered_s=9.0)) == []  # one waits, in time
    late = template_step(replace(TEMPLATE, unanswered_s=10.5))
    assert late[1:] == [ReplaceTemplate(7, "no answer to a ping in 10 s (stopped or hung)")]
    assert "killing it with the workers it forked" in late[0].message  # type: ignore[union-attr]
    # Part of the supervisor's step, besides the workers' deadlines and the refill.
    assert supervisor_step(replace(SUPERVISED, running=(), template=TEMPLATE)) == [PingTemplate(7)]


def test_a_template_that_served_and_died_is_replaced_but_one_that_never_could_is_not() -> None:
    gone = replace(TEMPLATE, usable=False, lost=True, why_not="its process exited")
    assert template_step(gone)[1:] == [ReplaceTemplate(7, "its process exited")]
    # Not again at every tick for a template that dies as soon as it starts, even with a
    # ping of it left unanswered.
    assert template_step(replace(gone, age_s=TEMPLATE_RESTART_MIN_S - 1)) == []
    assert template_step(replace(gone, age_s=1.0, unanswered_s=60.0)) == []
    # Still importing torch, or never able to fork (a second thread): nothing to ask.
    assert template_step(replace(TEMPLATE, usable=False)) == []
    refused = replace(TEMPLATE, usable=False, why_not="the template cannot fork: 2 threads")
    assert template_step(refused) == []


WATCH = LeaderWatch(
    now_s=100.0,
    node_id="n1",
    generation=5,
    leader="n0",
    failure_reported=True,
    address="n0:7430",
    incarnation="i0",
)


def test_a_follower_probes_a_leader_that_leaves_a_failure_unanswered_once_per_recheck() -> None:
    state = LivenessState()
    assert leader_watch_step(state, WATCH) == []  # suspicion starts now
    soon = replace(WATCH, now_s=100.0 + LEADER_SUSPECT_S / 2)
    assert leader_watch_step(state, soon) == []
    later = replace(WATCH, now_s=100.0 + LEADER_SUSPECT_S + 0.01)
    assert leader_watch_step(state, later) == [ProbeLeader("n0", "n0:7430", "i0")]
    assert leader_watch_step(state, replace(later, now_s=later.now_s + 0.1)) == []  # recheck
    # Answered (a new plan, no failure): suspicion ends; and no probe of a leader without an
    # address, nor of itself.
    assert leader_watch_step(state, replace(WATCH, failure_reported=False)) == []
    assert state.suspect_since == {}
    fresh = LivenessState()
    leader_watch_step(fresh, replace(WATCH, address=""))
    assert leader_watch_step(fresh, replace(WATCH, address="", now_s=200.0)) == []
    assert leader_watch_step(LivenessState(), replace(WATCH, node_id="n0", now_s=200.0)) == []


def test_a_leader_that_fails_its_probe_is_deposed_and_a_dead_one_recorded_dead() -> None:
    probed = ProbeLeader("n0", "n0:7430", "i0")
    state = LivenessState()
    assert leader_probed(state, probed, ProbeResult.SERVING) == []
    [stalled] = leader_probed(state, probed, ProbeResult.NOT_SERVING)
    assert stalled == DeposeLeader("n0", "not serving (its loop stalled)", None)
    [dead] = leader_probed(state, probed, ProbeResult.DEAD)
    assert dead == DeposeLeader("n0", "dead", "i0")
    # Silence: the first probe only says so; a second silence deposes, an answer forgets it.
    [said] = leader_probed(state, probed, ProbeResult.SILENT)
    assert said == Event("decision", "leader n0 silent to a probe: probed again")
    assert leader_probed(state, probed, ProbeResult.SERVING) == []
    assert leader_probed(state, probed, ProbeResult.SILENT) == [said]
    [silent] = leader_probed(state, probed, ProbeResult.SILENT)
    assert silent == DeposeLeader("n0", "silent to two probes", "i0")
    assert state.leader_silent is None
    # Another incarnation's silence is a first one.
    assert leader_probed(state, probed, ProbeResult.SILENT) == [said]
    other = ProbeLeader("n0", "n0:7430", "i1")
    assert leader_probed(state, other, ProbeResult.SILENT) == [said]
    # Suspicion that ends (a new plan) forgets a silence.
    leader_watch_step(state, replace(WATCH, failure_reported=False))
    assert state.leader_silent is None
    state = LivenessState()
    assert leader_deposed(state, dead, done=False) == [] and state.dead == {}
    event, reread = leader_deposed(state, dead, done=True)
    assert state.dead == {"n0": "i0"} and reread == Reread()
    assert event == Event("decision", "leader n0 confirmed dead by probe: deposed")
    leader_deposed(state := LivenessState(), stalled, done=True)
    assert state.dead == {}  # alive: never recorded dead


AT: dict[str, Any] = {"dead": frozenset(), "now_s": 50.0, "wall_s": 1.7e9}


def _read(members: dict[str, str], **changes: Any) -> EtcdRead:
    record = GenerationRecord(
        4, {}, "n0", 1.7e9, extra={"nodes": {"n0": "a", "n1": "b", "n2": "c"}}
    )
    read = EtcdRead(
        members={n: {"incarnation": inc} for n, inc in members.items()},
        record=record,
        record_rev=7,
        leader="n0",
        barriers={},
        safe=None,
    )
    return replace(read, **changes)


def test_the_view_notes_joins_and_lapses_of_planned_nodes_for_the_recovery_timeline() -> None:
    state = ViewState(last_join_s=0.0)
    first = view_step(state, _read({"n0": "a", "n1": "b", "n2": "c"}), **AT)
    assert Event("membership", "member(s) joined: n0, n1, n2") in first
    assert state.detected == {5: 1.7e9} and state.last_join_s == 50.0
    assert first[-1] == UpdateGauges() and state.record_rev == 7
    # n2's lease lapses (a detection); n1 comes back as a new agent (a join).
    state.detected.clear()
    later = view_step(state, _read({"n0": "a", "n1": "b2"}), **{**AT, "wall_s": 1.8e9})
    assert Event("membership", "member(s) joined: n1") in later
    assert Event("membership", "member(s) left: n2") in later
    assert state.detected == {5: 1.8e9}
    # A node already found dead by probe was detected then: its lapse is no new detection.
    state.detected.clear()
    view_step(state, _read({"n0": "a", "n1": "b2", "n2": "c"}), **AT)
    state.detected.clear()
    gone = view_step(state, _read({"n0": "a", "n1": "b2"}), **{**AT, "dead": frozenset({"n2"})})
    assert Event("membership", "member(s) left: n2") in gone and state.detected == {}


def test_a_followers_members_note_no_joins_and_a_new_leader_lets_unplanned_ones_settle() -> None:
    # A follower reads only itself and the leader: its members change with the leader, and
    # none of that is a join or a departure.
    state = ViewState(last_join_s=0.0)
    view_step(state, _read({"n1": "b", "n0": "a"}, complete=False), **AT)
    assert not state.members_complete
    moved = view_step(state, _read({"n1": "b", "n2": "c"}, complete=False, leader="n2"), **AT)
    assert not [a for a in moved if isinstance(a, Event) and a.kind == "membership"]
    assert state.last_join_s == 0.0 and state.detected == {}
    # It becomes the leader: its first complete read has nothing to compare with. The
    # planned nodes (n0, n1, n2) are no joins; n3, registered but not planned, is one, so
    # the new leader lets it settle before re-planning, as the leader before it did.
    first = view_step(state, _read({"n0": "a", "n1": "b", "n2": "c", "n3": "d"}), **AT)
    assert Event("membership", "member(s) joined: n3") in first
    assert state.members_complete and state.last_join_s == 50.0 and state.detected == {5: 1.7e9}
    # With no generation yet (a job starting), every member counts as joined.
    state = ViewState(last_join_s=0.0)
    view_step(state, _read({"n1": "b"}, complete=False, record=None), **AT)
    start = view_step(state, _read({"n0": "a", "n1": "b"}, record=None), **AT)
    assert Event("membership", "member(s) joined: n0, n1") in start and state.last_join_s == 50.0


def test_the_view_says_when_etcd_is_back_and_hands_the_safe_step_to_the_store() -> None:
    state = ViewState(etcd_ok=False)
    actions = view_step(state, _read({}, safe=SafeStep(3, 120)), **AT)
    assert actions[0] == Event("decision", "etcd reachable again") and state.etcd_ok
    assert SetFloor(120, 3) in actions
    assert SetFloor(120, 3) not in view_step(state, _read({}), **AT)  # not read this time


def test_every_action_has_a_handler(tmp_path: Path) -> None:
    """An action a step may return but the executor cannot apply would fail only when the
    step first returns it, perhaps weeks into a job: every member of the union has a
    handler, registered on the one executor by the part that carries it out (there is no
    other chain of cases left)."""
    import typing

    from elasticpp.agent import actions
    from elasticpp.agent.node import Agent, AgentConfig
    from tests.agents import SPEC

    agent = Agent(AgentConfig("n0", ("127.0.0.1:1",), "127.0.0.1:0", 1, tmp_path), SPEC)
    members = typing.get_args(actions.Action)
    assert len(members) > 20
    assert [m.__name__ for m in members if not agent.executor.handles(m.__new__(m))] == []
    agent.liveness.close()
