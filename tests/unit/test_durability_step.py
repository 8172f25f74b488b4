"""The durability part's pure steps (elasticpp.agent.durability.step): a worker's steps,
snapshots and failed snapshots decided from plain observations, with wall time passed in and
the outcomes of the store's record, commit and drop fed back by hand, as the executor does."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from elasticpp.agent.actions import (
    Action,
    Commit,
    CountSnapshotFailure,
    DropUncommitted,
    Event,
    Persist,
    RecordCommit,
    RecordPieces,
    Replicate,
    StepMetrics,
    WriteMetricsLine,
)
from elasticpp.agent.durability.step import (
    DurabilityState,
    SnapshotFailure,
    SnapshotObservation,
    StepObservation,
    durability_committed,
    durability_dropped,
    durability_on_snapshot,
    durability_on_snapshot_failed,
    durability_on_step,
    durability_recorded,
)
from elasticpp.agent.follower.step import GenerationProgress
from elasticpp.agent.kernel.decide import Phase, WorkerState
from elasticpp.agent.kernel.limits import FENCED_SNAPSHOTS_KEPT
from elasticpp.agent.kernel.pool import Worker
from elasticpp.agent.node import Agent, AgentConfig
from elasticpp.cluster.records import GenerationRecord
from elasticpp.errors import CheckpointError
from elasticpp.plan import Plan
from tests.agents import SPEC
from tests.agents import DeadProc as _Proc
from tests.agents import dp_plan as _plan

MODEL = SPEC.model

SNAP = SnapshotObservation(
    step=10,
    generation=2,
    rank=0,
    pieces=[{"name": "embed.tp0-1.safetensors", "size": 4, "sha256": "00"}],
    writers=frozenset({0, 1}),
    fenced=False,
    model=MODEL,
    replication_copies=1,
    replication_every=3,
    persist_every=0,
    job_steps=100,
)

STEP = StepObservation(
    step=3,
    generation=2,
    loss=2.5,
    lr=0.001,
    grad_norm=1.25,
    step_seconds=0.4,
    layout="pp1-tp1-dp2",
    node_id="n0",
    wall_s=1.7e9,
    samples=8,
    tokens=8 * 64,
)


def _report(
    state: DurabilityState, obs: SnapshotObservation, error: str | None = None
) -> list[Action]:
    """A snapshot report, recorded by the store (or refused with `error`), as the executor
    feeds it back."""
    [record] = durability_on_snapshot(state, obs)
    assert isinstance(record, RecordPieces)
    return durability_recorded(state, record, error)


def _snapshot(state: DurabilityState, obs: SnapshotObservation) -> list[Action]:
    """Every writer of the node reports `obs.step`; the actions of the last report."""
    actions: list[Action] = []
    for rank in sorted(obs.writers):
        actions = _report(state, replace(obs, rank=rank))
    return actions


def test_a_step_is_committed_once_every_snapshot_writer_of_the_node_reported() -> None:
    state = DurabilityState()
    [record] = durability_on_snapshot(state, SNAP)
    assert record == RecordPieces(
        10, 2, 0, SNAP.pieces, frozenset({0, 1}), False, Commit(10, 2, MODEL, False, False)
    )
    assert state.snap_reports == {}  # nothing changes before the store took the report
    assert durability_recorded(state, record, None) == []  # rank 1 has not reported yet
    assert state.snap_reports == {(2, 10): {0}}
    [commit] = _report(state, replace(SNAP, rank=1))
    assert commit == Commit(10, 2, MODEL, replicate=False, persist=False)
    assert state.last_commit_step == -1  # not before the commit succeeded
    assert durability_committed(state, commit, True) == [RecordCommit(2)]
    assert state.last_commit_step == 10 and state.snap_reports == {}


def test_a_refused_report_changes_nothing() -> None:
    state = DurabilityState()
    _report(state, SNAP)
    late = replace(SNAP, rank=1)
    assert _report(state, late, error="step 10 is already committed by generation 3") == []
    assert state.snap_reports == {(2, 10): {0}}  # rank 1 not counted: no commit


def test_a_commit_prunes_the_reports_up_to_its_step_and_keeps_newer_ones() -> None:
    state = DurabilityState()
    _report(state, replace(SNAP, step=9))  # a step whose other writer never reported
    _report(state, replace(SNAP, step=11))
    [commit] = _snapshot(state, SNAP)
    durability_committed(state, commit, True)
    assert state.snap_reports == {(2, 11): {0}}


def test_a_failed_commit_changes_nothing() -> None:
    state = DurabilityState(snap_failures=3, fence_logged=True, last_commit_step=5)
    [commit] = _snapshot(state, replace(SNAP, step=10, replication_every=1, persist_every=1))
    assert durability_committed(state, commit, False) == []
    assert state.last_commit_step == 5
    assert state.snap_reports == {(2, 10): {0, 1}}
    assert state.snap_failures == 3 and state.fence_logged  # nothing announced as recovered


def test_a_fenced_node_commits_nothing_says_so_once_and_drops_old_snapshots() -> None:
    state = DurabilityState()
    fenced = replace(SNAP, fenced=True)
    first = _snapshot(state, fenced)
    assert first[0] == Event(
        "decision",
        "membership lease may have lapsed: step 10 and later are not committed, replicated "
        "or persisted until it is renewed",
    )
    assert first[1:] == [DropUncommitted(FENCED_SNAPSHOTS_KEPT)]
    assert state.fence_logged
    later = _snapshot(state, replace(fenced, step=11))
    assert later == [DropUncommitted(FENCED_SNAPSHOTS_KEPT)]  # no second event
    assert not any(isinstance(a, Commit) for a in first + later)
    assert state.last_commit_step == -1


def test_dropped_snapshots_forget_their_reports_of_the_current_epoch_only() -> None:
    state = DurabilityState()
    for step in (7, 8, 9, 10):
        _snapshot(state, replace(SNAP, step=step, fenced=True))
    # Dropped by the store: steps 7 and 8 of epoch 4 (the current one), and a step 9 of
    # generation 2 of an older epoch, whose generation and step numbers mean other reports.
    assert durability_dropped(state, [(3, 2, 9), (4, 2, 7), (4, 2, 8)], epoch=4) == []
    assert sorted(state.snap_reports) == [(2, 9), (2, 10)]


def test_the_renewed_lease_is_announced_once_with_the_first_commit() -> None:
    state = DurabilityState()
    _snapshot(state, replace(SNAP, step=9, fenced=True))
    [commit] = _snapshot(state, SNAP)
    assert state.fence_logged  # still: the commit has not succeeded yet
    assert durability_committed(state, commit, True) == [
        Event("decision", "membership lease renewed: committing again"),
        RecordCommit(2),
    ]
    [commit] = _snapshot(state, replace(SNAP, step=11))
    assert durability_committed(state, commit, True) == [RecordCommit(2)]


def test_replication_follows_commits_of_every_nth_step_and_never_two_rounds_at_once() -> None:
    state = DurabilityState()

    def committed(step: int, replicating: bool = False, **changes: Any) -> list[Action]:
        [commit] = _snapshot(state, replace(SNAP, step=step, replication_every=5, **changes))
        return durability_committed(state, commit, True, replicating)

    assert Replicate() not in committed(11)  # replicated every 5 steps
    assert Replicate() in committed(15)
    assert Replicate() not in committed(20, replication_copies=0)  # no copies wanted
    assert Replicate() not in committed(25, replicating=True)  # a round is in flight
    assert Replicate() in committed(30)  # it ended: the next commit starts the next round


def test_persistent_checkpoints_follow_every_nth_step_and_the_last_step() -> None:
    state = DurabilityState()

    def persisted(step: int, persist_every: int) -> bool:
        obs = replace(SNAP, step=step, persist_every=persist_every, job_steps=103)
        [commit] = _snapshot(state, obs)
        return Persist(step, MODEL) in durability_committed(state, commit, True)

    assert not persisted(10, persist_every=0)  # no persistent checkpoints
    assert not persisted(11, persist_every=4)
    assert persisted(12, persist_every=4)
    assert persisted(103, persist_every=4)  # the job's last step, off the cadence
    state.last_commit_step = 0
    [commit] = _snapshot(state, replace(SNAP, step=16, persist_every=4))
    assert durability_committed(state, commit, False) == []  # not committed: not persisted


def test_failed_snapshots_are_counted_each_time_and_announced_once_per_run() -> None:
    state = DurabilityState()
    failure = SnapshotFailure(step=4, rank=1, message="No space left on device")
    first = durability_on_snapshot_failed(state, failure)
    assert first[0] == CountSnapshotFailure()
    assert first[1] == Event(
        "worker",
        "rank 1 could not write the snapshot of step 4: No space left on device; training "
        "goes on, steps are not committed here until snapshots can be written again",
    )
    assert durability_on_snapshot_failed(state, failure) == [CountSnapshotFailure()]
    [commit] = _snapshot(state, SNAP)
    assert durability_committed(state, commit, True)[0] == Event(
        "worker", "snapshots are written again: step 10 committed"
    )
    assert state.snap_failures == 0
    assert len(durability_on_snapshot_failed(state, failure)) == 2  # a new run of failures


def test_each_step_is_written_once_per_generation_with_the_wall_time_observed() -> None:
    state = DurabilityState()
    metrics, line = durability_on_step(state, STEP)
    # The gauges and counters of the step: lr, gradient norm, the global batch and its tokens.
    assert metrics == StepMetrics(3, 2.5, 0.4, lr=0.001, grad_norm=1.25, samples=8, tokens=512)
    odd = replace(STEP, lr="0.1", grad_norm=True)
    assert durability_on_step(DurabilityState(), odd)[0].lr is None  # a non-number: not shown
    assert isinstance(line, WriteMetricsLine)
    assert json.loads(line.line) == {
        "step": 3,
        "loss": 2.5,
        "generation": 2,
        "layout": "pp1-tp1-dp2",
        "time": 1.7e9,
        "node": "n0",
        "lr": 0.001,
        "grad_norm": 1.25,
        "step_seconds": 0.4,
    }
    assert durability_on_step(state, replace(STEP, loss=2.6)) == []  # its dp twin
    assert state.last_step == 3 and state.next_step_committed == 4 and state.last_loss == 2.6
    # A new generation resumes from an older step: written again, under its generation.
    assert len(durability_on_step(state, replace(STEP, step=2, generation=3))) == 2
    assert state.last_step == 3 and state.next_step_committed == 4


def test_memory_stays_bounded_over_ten_thousand_steps() -> None:
    state = DurabilityState()
    writers = frozenset({0, 1})
    for step in range(10_000):
        generation = 1 + step // 700  # a re-plan now and then
        twin = replace(STEP, step=step, generation=generation)
        durability_on_step(state, twin)
        durability_on_step(state, twin)
        obs = replace(SNAP, step=step, generation=generation, writers=writers)
        if step % 10 == 3:
            _report(state, obs)  # one writer's report only: never committed
        elif step % 1000 < 50:  # fenced for a while
            for action in _snapshot(state, replace(obs, fenced=True)):
                if isinstance(action, DropUncommitted):
                    kept = sorted(state.snap_reports)[-action.keep :]
                    dropped = [(1, g, s) for g, s in state.snap_reports if (g, s) not in kept]
                    durability_dropped(state, dropped, epoch=1)
        else:
            [commit] = _snapshot(state, obs)
            durability_committed(state, commit, True)
        assert len(state.written_steps) <= 4
        assert len(state.snap_reports) <= FENCED_SNAPSHOTS_KEPT + 1
    assert state.last_commit_step == 9_999


def test_a_commit_that_fails_does_not_announce_that_snapshots_are_written_again(
    tmp_path: Path,
) -> None:
    """The agent around the steps: a commit refused by the store after a failed snapshot
    leaves the failure standing (no "committed" event, nothing reset)."""
    agent = Agent(AgentConfig("n0", ("127.0.0.1:1",), "127.0.0.1:0", 2, tmp_path), SPEC)
    plan = _plan(1)
    record = GenerationRecord(1, plan.to_dict(), "n0", time.time(), resume_step=0)
    agent.follower.state.gen = GenerationProgress(
        record=record, plan=Plan.from_dict(record.plan), phase=Phase.RUNNING
    )
    w = Worker(proc=_Proc(100), rank=0, generation=1, plan=plan, state=WorkerState.RUNNING)  # type: ignore[arg-type]

    def refuse(step: int, units: Any, generation: int = 0) -> Any:
        raise CheckpointError(f"step {step}: the store refuses the commit")

    agent.store.commit = refuse  # type: ignore[method-assign]
    durability = agent.durability
    agent.executor.run(
        durability.on_snapshot_failed(w, {"step": 4, "message": "No space left on device"})
    )
    # rank 0 writes the node's snapshot
    agent.executor.run(durability.on_snapshot(w, {"step": 5, "pieces": []}))
    messages = [message for _, _, message, _ in agent.journal.log]
    assert not any(m.startswith("snapshots are written again") for m in messages), messages
    assert (
        agent.durability.state.snap_failures == 1 and agent.durability.state.last_commit_step == -1
    )


@pytest.mark.parametrize(
    ("pieces", "why"),
    [
        ("unit0.safetensors", "pieces: expected a list, got str"),
        ([7], "pieces[0]: expected an object"),
    ],
)
def test_a_snapshot_report_whose_pieces_are_not_objects_is_refused_by_name(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, pieces: Any, why: str
) -> None:
    """A worker's report is JSON from another process: pieces that are not a list of
    objects are refused with a message that says so, and nothing is committed."""
    agent = Agent(AgentConfig("n0", ("127.0.0.1:1",), "127.0.0.1:0", 2, tmp_path), SPEC)
    plan = _plan(1)
    record = GenerationRecord(1, plan.to_dict(), "n0", time.time(), resume_step=0)
    agent.follower.state.gen = GenerationProgress(
        record=record, plan=Plan.from_dict(record.plan), phase=Phase.RUNNING
    )
    w = Worker(proc=_Proc(100), rank=0, generation=1, plan=plan, state=WorkerState.RUNNING)  # type: ignore[arg-type]
    with caplog.at_level(logging.INFO, logger="elasticpp.agent"):
        agent.executor.run(agent.durability.on_snapshot(w, {"step": 5, "pieces": pieces}))
    assert any(why in r.getMessage() and "not recorded" in r.getMessage() for r in caplog.records)
    assert agent.durability.state.last_commit_step == -1 and agent.store.committed_steps() == []
