"""The checkpoint part's pure step (elasticpp.agent.checkpoint.step): report what is held,
persist the chosen step once, say how it ended; a step no longer held, a persist that never
ends and a new request each get their answer. End to end: test_job_checkpoint.py."""

from __future__ import annotations

from elasticpp.agent.actions import Event, PersistStep, ReportCheckpoint, ReportHeld
from elasticpp.agent.checkpoint.step import (
    CheckpointObservation,
    CheckpointState,
    checkpoint_step,
)
from elasticpp.cluster.records import CheckpointRequest

ASKED = CheckpointRequest("r1", "ops@host", "before the upgrade", 100.0)


def _obs(
    now_s: float = 0.0, held: tuple[int, ...] = (20, 10), outcome: str = ""
) -> CheckpointObservation:
    return CheckpointObservation(now_s=now_s, held=held, outcome=outcome, persist_s=60.0)


def _plain(actions: list[object]) -> list[object]:
    return [a for a in actions if not isinstance(a, Event)]


def test_held_steps_are_reported_then_the_chosen_step_is_persisted_once_and_answered() -> None:
    state = CheckpointState(request=ASKED)
    assert _plain(checkpoint_step(state, _obs())) == [ReportHeld("r1", (20, 10))]
    assert checkpoint_step(state, _obs()) == []  # no step chosen yet: nothing more
    state.request = CheckpointRequest("r1", "ops@host", "before the upgrade", 100.0, step=20)
    assert _plain(checkpoint_step(state, _obs(1.0, outcome="unknown"))) == [PersistStep("r1", 20)]
    assert checkpoint_step(state, _obs(2.0, outcome="pending")) == []
    done = _plain(checkpoint_step(state, _obs(3.0, outcome="persisted")))
    assert done == [ReportCheckpoint("r1", 20, "persisted")]
    assert checkpoint_step(state, _obs(4.0, outcome="persisted")) == []  # answered once


def test_a_step_not_held_any_more_and_a_persist_that_never_ends_are_reported_failed() -> None:
    state = CheckpointState(request=ASKED)
    checkpoint_step(state, _obs())
    state.request = CheckpointRequest("r1", "ops@host", "why", 100.0, step=5)
    [report] = _plain(checkpoint_step(state, _obs(1.0, held=(30, 20), outcome="unknown")))
    assert isinstance(report, ReportCheckpoint) and "not a commit held here" in report.outcome
    slow = CheckpointState(request=CheckpointRequest("r2", "ops", "why", 1.0, step=20))
    checkpoint_step(slow, _obs())  # reported
    checkpoint_step(slow, _obs(0.0, outcome="unknown"))  # asked
    assert checkpoint_step(slow, _obs(59.0, outcome="pending")) == []
    [late] = _plain(checkpoint_step(slow, _obs(61.0, outcome="pending")))
    assert (
        isinstance(late, ReportCheckpoint) and late.outcome == "failed: not persisted within 60 s"
    )


def test_a_persist_under_way_is_not_asked_again_and_a_new_request_starts_over() -> None:
    state = CheckpointState(request=CheckpointRequest("r1", "ops", "why", 1.0, step=20))
    checkpoint_step(state, _obs())
    assert checkpoint_step(state, _obs(1.0, outcome="pending")) == []  # a periodic persist has it
    assert _plain(checkpoint_step(state, _obs(2.0, outcome="persisted"))) == [
        ReportCheckpoint("r1", 20, "persisted")
    ]
    state.request = CheckpointRequest("r2", "ops", "again", 5.0)
    assert _plain(checkpoint_step(state, _obs(3.0, held=(30, 20)))) == [ReportHeld("r2", (30, 20))]
