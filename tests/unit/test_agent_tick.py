"""The decision loop's pace: a quiet tick on a follower, whose phases move on events, short
ticks while the node polls: leading a transition, a failure of its own unanswered, a drain,
no etcd (limits.QUIET_TICK_S); a training tick in between while its workers train, leader
or not. Twenty ticks a second of every idle agent cost 10-17 ms of CPU a second each: the
reason a simulated cluster of 64 agents filled a core and 2,048 could not run on one
machine; while training they cost 2-2.5 % of a core each, taken from the workers."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from elasticpp.agent.follower.step import GenerationProgress
from elasticpp.agent.kernel.decide import Phase, WorkerState
from elasticpp.agent.kernel.limits import (
    BUSY_TICK_S,
    LEADER_TURN_GAP_MAX_S,
    LEADER_TURN_SHARE,
    QUIET_TICK_S,
    RESTING_TICK_S,
    STATUS_EVERY_S,
    TRAINING_TICK_S,
)
from elasticpp.agent.kernel.pool import Worker
from elasticpp.agent.node import Agent, AgentConfig
from elasticpp.cluster.records import EventType, GenerationRecord, WatchEvent
from elasticpp.plan import Plan
from elasticpp.waiting import wait_until
from tests.agents import SPEC
from tests.agents import pp_plan as _plan
from tests.fakes import Term


class _Proc:
    pid = 12345


def _quiet_agent(tmp_path: Path) -> Agent:
    """A follower training in the generation etcd holds, nothing pending."""
    agent = Agent(AgentConfig("n0", ("127.0.0.1:1",), "127.0.0.1:0", 1, tmp_path), SPEC)
    record = GenerationRecord(3, _plan(3).to_dict(), "n1", time.time(), resume_step=0)
    agent.view.state.record = record
    agent.view.state.etcd_ok = True
    agent.view.state.leader = "n1"
    agent.follower.state.gen = GenerationProgress(
        record=record, plan=Plan.from_dict(record.plan), phase=Phase.RUNNING
    )
    agent.membership.joined = True
    return agent


@pytest.mark.parametrize("phase", list(Phase))
def test_a_follower_ticks_quietly_in_every_phase(tmp_path: Path, phase: Phase) -> None:
    """Its phases move on events (watch events, its workers' events, the fetch's future wakes
    the loop) and deadlines of seconds; a failed one reported its failure (below)."""
    agent = _quiet_agent(tmp_path)
    _set_phase(phase)(agent)
    assert agent.rest_s() == QUIET_TICK_S
    agent.liveness.close()


def _newer_record(a: Agent) -> None:
    assert a.view.state.record is not None
    a.view.state.record = replace(a.view.state.record, generation=4)


def _set_phase(phase: Phase) -> Callable[[Agent], None]:
    def apply(a: Agent) -> None:
        assert a.follower.state.gen is not None
        a.follower.state.gen = replace(a.follower.state.gen, phase=phase)

    return apply


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(_newer_record, id="a newer generation in etcd"),
        pytest.param(lambda a: setattr(a.view.state, "etcd_ok", False), id="etcd unreachable"),
        pytest.param(lambda a: a.leader.begin_term(Term(), None), id="leading"),
        pytest.param(
            lambda a: a.follower.state.pending_failures.__setitem__(3, {"reason": "x"}),
            id="a failure report pending",
        ),
        pytest.param(
            lambda a: setattr(a.follower.state, "reported", 3),
            id="its failure reported, no new plan yet",
        ),
        pytest.param(
            lambda a: a.liveness.state.suspect_since.__setitem__(3, 0.0), id="the leader suspected"
        ),
        pytest.param(lambda a: setattr(a.control.state, "draining", True), id="draining"),
        pytest.param(lambda a: setattr(a.membership, "joined", False), id="not joined"),
        pytest.param(
            lambda a: setattr(a.follower.state, "gen", None), id="a generation not followed yet"
        ),
    ],
)
def test_anything_in_motion_makes_the_ticks_short(
    tmp_path: Path, change: Callable[[Agent], None]
) -> None:
    agent = _quiet_agent(tmp_path)
    change(agent)
    assert agent.rest_s() == BUSY_TICK_S
    if agent.leader.leadership is None:  # a leader whose workers train ticks at their pace
        agent.pool.deliver(_Proc(), {"event": "step", "step": 5})  # nothing else calms
        assert agent.rest_s() == BUSY_TICK_S
    agent.liveness.close()


@pytest.mark.parametrize("kind", ["step", "snapshot"])
@pytest.mark.parametrize("leading", [False, True], ids=["follower", "leader"])
def test_a_node_whose_workers_train_ticks_at_the_training_pace(
    tmp_path: Path, kind: str, leading: bool
) -> None:
    """Between the quiet and the busy tick: every worker event, commit, replication round and
    watch event wakes the loop anyway; the safe step (every 0.5 s) and the status (every
    0.2 s) need no more. A leader in steady training too: its transition waits are over."""
    agent = _quiet_agent(tmp_path)
    if leading:
        agent.leader.begin_term(Term(), None)
    agent.pool.deliver(_Proc(), {"event": kind, "step": 5})
    assert agent.rest_s() == TRAINING_TICK_S
    assert BUSY_TICK_S < TRAINING_TICK_S < QUIET_TICK_S
    agent.liveness.close()


def test_a_leader_whose_transition_is_over_ticks_at_the_training_pace(tmp_path: Path) -> None:
    """Its waits come as watch events now; its deadlines need no more than a training
    leader's pace. While the generation's transition runs (its timeline not yet written),
    or once a newer generation is in etcd, it polls again."""
    agent = _quiet_agent(tmp_path)
    agent.leader.begin_term(Term(), None)
    ls = agent.leader.state.at(3, 0.0)
    assert agent.rest_s() == BUSY_TICK_S  # leading generation 3's transition
    ls.resume_written = ls.timeline_written = True
    assert agent.rest_s() == TRAINING_TICK_S
    agent.leader.state.at(2, 0.0).timeline_written = True  # the transition it knows is an older one
    assert agent.rest_s() == BUSY_TICK_S
    agent.leader.state.at(3, 0.0)
    assert agent.rest_s() == BUSY_TICK_S  # a new term: generation 3's transition unknown
    agent.leader.state.timeline_written = True
    assert agent.rest_s() == TRAINING_TICK_S
    _newer_record(agent)
    assert agent.rest_s() == BUSY_TICK_S
    agent.liveness.close()


@pytest.mark.parametrize("kind", ["ready", "started", "stopped", "exited"])
def test_a_worker_event_that_is_not_training_wakes_the_loop_once(tmp_path: Path, kind: str) -> None:
    """The loop takes it at once; the ticks after it stay quiet. Before, any event kept a
    node's ticks short for a second: every node of a simulated 256-node cluster ticked 20
    times a second after its workers started."""
    agent = _quiet_agent(tmp_path)
    agent.wake.clear()
    agent.pool.deliver(_Proc(), {"event": kind})
    assert agent.wake.is_set()
    assert agent.rest_s() == QUIET_TICK_S
    agent.liveness.close()


def test_a_leaderless_node_ticks_when_its_campaign_is_due_not_before(tmp_path: Path) -> None:
    """Every node of a job sees a leader's key go at once; ticking busy while leaderless,
    512 simulated nodes ticked 20 times a second each until a leader was known, and the load
    made more leases lapse. A node wakes for its own campaign's turn (`campaign_delay_s`),
    and the new leader's key (a watch event) wakes it before that."""
    agent = _quiet_agent(tmp_path)
    agent.view.state.leader = None
    assert agent.rest_s() == QUIET_TICK_S  # no campaign drawn yet: the tick draws it
    agent.leader.state.campaign_at_s = agent.clock.monotonic() + 0.7
    assert 0.6 < agent.rest_s() <= 0.7
    agent.leader.state.campaign_at_s = agent.clock.monotonic() - 1.0  # overdue (not yet taken)
    assert agent.rest_s() == BUSY_TICK_S  # polls for it; never a wait of 0 (a spin)
    agent.view.state.leader = "n1"  # a leader is known: its draw no longer counts
    assert agent.rest_s() == QUIET_TICK_S
    agent.liveness.close()


def test_a_turn_that_did_not_publish_the_status_brings_the_next_turn_forward(
    tmp_path: Path,
) -> None:
    """The status the RPCs read is published at most every STATUS_EVERY_S: a turn too soon
    after the last publication leaves it to the next turn, which a quiet follower would
    take QUIET_TICK_S later (`ctl status` up to 5 s behind after a burst of events)."""
    agent = _quiet_agent(tmp_path)
    agent.tick = lambda: None  # type: ignore[method-assign]
    agent.turn()  # publishes
    assert agent.idle_for() == QUIET_TICK_S
    agent.turn()  # too soon: not published
    assert agent.pace.status_stale
    assert 0.0 <= agent.idle_for() <= STATUS_EVERY_S
    agent.pace.status_at_s -= STATUS_EVERY_S  # the last publication is STATUS_EVERY_S older
    agent.turn()  # publishes
    assert not agent.pace.status_stale and agent.idle_for() == QUIET_TICK_S
    agent.liveness.close()


def test_a_node_waiting_for_the_first_plan_ticks_quietly(tmp_path: Path) -> None:
    """Before the leader's first generation every node waits for a watch event; 2,048 nodes
    ticking 20 times a second while they join filled the machine."""
    agent = _quiet_agent(tmp_path)
    agent.view.state.record, agent.follower.state.gen = None, None
    assert agent.rest_s() == QUIET_TICK_S
    agent.liveness.close()


def test_a_watch_event_wakes_the_loop_and_tells_the_part_whose_keys_changed(
    tmp_path: Path,
) -> None:
    """The quarantine records, the job's end and the epoch had watches of their own (three
    streams' watchers and threads an agent): their events now come with the cached ranges'
    and raise their parts' signals. A follower sees no other node's member key at all (the
    leader alone caches them): when a job starts, N registrations each woke N agents."""
    agent = _quiet_agent(tmp_path)
    keys = agent.cluster.keys

    def taken() -> tuple[bool, bool, bool]:
        woke = agent.wake.is_set()
        agent.wake.clear()
        return (agent.view.reread.take() and woke, agent.health.changed.take(),
                agent.view.epoch_changed.take())  # fmt: skip

    taken()
    agent.on_watch(WatchEvent(EventType.PUT, keys.generation, "{}", 12, 12, 0))
    assert taken() == (True, False, False)
    agent.on_watch(WatchEvent(EventType.PUT, keys.quarantine("n3"), "{}", 13, 13, 0))
    assert taken() == (True, True, False)
    agent.on_watch(WatchEvent(EventType.PUT, keys.ended, "{}", 14, 14, 0))
    assert taken() == (True, True, False)
    agent.on_watch(WatchEvent(EventType.DELETE, keys.epoch, None, 15))
    assert taken() == (True, False, True)
    agent.on_watch(WatchEvent(EventType.RESYNC, keys.root, None, 16))  # events lost
    assert taken() == (True, True, True)
    agent.on_watch(WatchEvent(EventType.PUT, keys.node("n1"), "{}", 17, 17, 0))  # its own
    assert taken() == (True, False, False)
    agent.liveness.close()


class _Spare:
    def __init__(self, pid: int) -> None:
        self.pid = pid


def _at_rest(agent: Agent) -> None:
    """Its slots' spares all started and ready: the supervisor has nothing to poll for."""
    for i in range(agent.cfg.slots):
        agent.pool.add_spare(_Spare(20_000 + i))  # type: ignore[arg-type]
        agent.pool.mark_ready(20_000 + i)


@pytest.mark.parametrize("phase", list(Phase))
def test_a_follower_at_rest_sleeps_longer_only_while_its_ranks_run_or_it_has_none(
    tmp_path: Path, phase: Phase
) -> None:
    """Running or a spare (IDLE), its spares ready, its workers silent: nothing but events
    and the supervisor's deadlines can move it, so it ticks every RESTING_TICK_S. In a phase
    with a deadline of its own (MOVING, STARTING, ...) it keeps the quiet tick."""
    agent = _quiet_agent(tmp_path)
    _set_phase(phase)(agent)
    _at_rest(agent)
    resting = phase in (Phase.RUNNING, Phase.IDLE)
    assert agent.rest_s() == (RESTING_TICK_S if resting else QUIET_TICK_S)
    assert QUIET_TICK_S < RESTING_TICK_S
    agent.liveness.close()


def test_a_spare_not_ready_or_missing_keeps_the_quiet_tick(tmp_path: Path) -> None:
    """The supervisor polls a starting spare's readiness deadline and starts missing ones."""
    agent = _quiet_agent(tmp_path)
    assert agent.rest_s() == QUIET_TICK_S  # no spare yet: one is to be started
    agent.pool.add_spare(_Spare(30_000))  # type: ignore[arg-type]
    assert agent.rest_s() == QUIET_TICK_S  # started, not ready
    agent.pool.mark_ready(30_000)
    assert agent.rest_s() == RESTING_TICK_S
    agent.liveness.close()


def test_a_silent_running_worker_brings_the_tick_forward_to_its_hang_deadline(
    tmp_path: Path,
) -> None:
    """A worker that stopped reporting steps is killed at its hang deadline, not up to a
    resting tick later; past the deadline the loop polls (never a wait of 0)."""
    agent = _quiet_agent(tmp_path)
    _at_rest(agent)
    now = agent.clock.monotonic()
    assert agent.follower.state.gen is not None
    worker = Worker(
        _Proc(),  # type: ignore[arg-type]
        rank=0,
        generation=3,
        plan=agent.follower.state.gen.plan,
        state=WorkerState.RUNNING,
        last_progress_s=now - SPEC.hang_timeout_s + 7.0,
    )
    agent.pool.add_worker(worker)
    assert 6.0 < agent.rest_s() <= 7.0
    worker.last_progress_s = now - SPEC.hang_timeout_s - 1.0
    assert agent.rest_s() == BUSY_TICK_S
    agent.liveness.close()


def _leading_agent(tmp_path: Path) -> Agent:
    agent = _quiet_agent(tmp_path)
    agent.leader.begin_term(Term(), None)
    agent.view.state.leader = "n0"
    agent.view.state.members = {"n0": {"incarnation": agent.incarnation}}
    assert agent.leader.acting()
    return agent


def _burning_tick(agent: Agent, cpu_s: float) -> list[float]:
    """Make `agent`'s tick burn `cpu_s` of CPU; returns the list its ticks' times go to."""
    ticks: list[float] = []

    def tick() -> None:
        ticks.append(time.monotonic())
        end = time.thread_time() + cpu_s
        while time.thread_time() < end:
            pass

    agent.tick = tick  # type: ignore[method-assign]
    return ticks


def test_a_leader_woken_again_within_its_pace_takes_the_next_turn_once_it_allows(
    tmp_path: Path,
) -> None:
    """A leader's turn reads all N members and arrivals: woken by every arrival of a
    transition, a 2,048-node leader took a turn per arrival or two and spent 9-18 s of a
    core a transition. A wake within c * (1 / share - 1) of a turn of c seconds of CPU is
    deferred, and the loop's wait ends when the pace allows the turn."""
    agent = _leading_agent(tmp_path)
    ticks = _burning_tick(agent, 0.02)
    agent.turn()
    gap_s = 0.02 * (1 / LEADER_TURN_SHARE - 1)
    assert len(ticks) == 1
    agent.turn()  # woken at once (an arrival): deferred
    assert len(ticks) == 1
    wait_s = agent.idle_for()
    assert 0.0 < wait_s <= gap_s + 0.01  # the deferred turn is taken then, not at the tick
    assert wait_until(lambda: time.monotonic() >= agent.pace.next_turn_s, 5, interval_s=0.005)
    agent.turn()
    assert len(ticks) == 2 and ticks[1] - ticks[0] >= gap_s
    agent.liveness.close()


def test_a_leader_not_woken_waits_its_tick_and_never_less_than_its_pace(
    tmp_path: Path,
) -> None:
    """Without a deferred turn the loop waits its tick as before, and never less than the
    pace's gap: an overdue status (a wait of 0) does not make it spin on deferred turns."""
    agent = _leading_agent(tmp_path)
    _burning_tick(agent, 0.02)
    agent.turn()
    agent.pace.status_stale, agent.pace.status_at_s = True, 0.0  # overdue: 0 without the pace
    assert 0.02 < agent.idle_for() <= LEADER_TURN_GAP_MAX_S
    agent.liveness.close()


def test_a_leaders_pace_is_capped_and_a_stop_is_never_deferred(tmp_path: Path) -> None:
    agent = _leading_agent(tmp_path)
    agent.tick = lambda: None  # type: ignore[method-assign]
    agent.pace.after_turn(10.0, True, time.monotonic())  # 10 s of CPU (a plan at a huge scale)
    assert agent.pace.next_turn_s - time.monotonic() <= LEADER_TURN_GAP_MAX_S
    assert agent.pace.deferred(agent.stopping(), time.monotonic())
    agent.request_stop()
    assert not agent.pace.deferred(agent.stopping(), time.monotonic())
    agent.liveness.close()


def test_a_followers_turns_are_not_paced(tmp_path: Path) -> None:
    """Each reads its own records: its turns cost the same at 4 nodes and at 2,048."""
    agent = _quiet_agent(tmp_path)
    ticks = _burning_tick(agent, 0.02)
    agent.turn()
    agent.turn()
    assert len(ticks) == 2
    assert not agent.pace.deferred(agent.stopping(), time.monotonic())
    agent.liveness.close()
