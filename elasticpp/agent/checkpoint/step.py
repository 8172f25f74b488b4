"""A checkpoint now (`elasticpp job checkpoint`), pure: what every agent does with the
operator's request.

The command writes a request (`checkpoint`: an id, who, why); every agent reports the
committed steps it holds of its own (`ReportHeld`, barrier `checkpoint`); the command picks
the newest step every planned node holds and writes it into the request; every agent then
persists its pieces of that step into the job's persist_dir off the training path
(`PersistStep`: training goes on), and reports where they stand (`ReportCheckpoint`:
`persisted`, or why not). The checkpoint is complete, its manifest written, when the last
node's pieces are in (elasticpp.store.persist). A new request replaces the one before.

The step writes only `CheckpointState`; no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from elasticpp.agent.actions import Action, Event, PersistStep, ReportCheckpoint, ReportHeld
from elasticpp.cluster.records import CheckpointRequest

_UNDER_WAY = ("pending", "unknown")  # a persist submitted, not finished (or not seen yet)


@dataclass
class CheckpointState:
    """The operator's newest request as this agent carries it out, plain data: written on
    the loop by the `JobCheckpoint` object (the request, read from etcd) and the step."""

    request: CheckpointRequest | None = None
    reported: str | None = None  # the request whose held steps were reported
    asked: tuple[str, int] | None = None  # (request, step) whose persist was asked for
    asked_s: float = 0.0  # monotonic: when
    answered: str | None = None  # the request whose outcome was reported


@dataclass(frozen=True)
class CheckpointObservation:
    now_s: float
    held: tuple[int, ...]  # this node's own committed steps, newest first
    outcome: str  # where the request's step stands (Durability.persist_outcome); "" if none
    persist_s: float  # a persist still under way this long after it was asked: reported so


def checkpoint_step(state: CheckpointState, obs: CheckpointObservation) -> list[Action]:
    """Every agent's part of a checkpoint now (see the module)."""
    request = state.request
    if request is None:
        return []
    if state.reported != request.id:
        state.reported, state.asked, state.answered = request.id, None, None
        return [
            Event("decision", f"checkpoint asked by {request.by} ({request.reason}): "
                  f"committed steps held here: {list(obs.held) or 'none'}"),
            ReportHeld(request.id, obs.held),
        ]  # fmt: skip
    step = request.step
    if step is None or state.answered == request.id:
        return []
    outcome = obs.outcome
    if state.asked != (request.id, step):
        if step not in obs.held and outcome not in ("persisted", "pending"):
            state.answered = request.id
            why = f"failed: step {step} is not a commit held here (held: {list(obs.held)})"
            return [ReportCheckpoint(request.id, step, why)]
        state.asked, state.asked_s = (request.id, step), obs.now_s
        if outcome in ("persisted", "pending"):
            return []  # a periodic persist of the same step has it
        return [
            Event("decision", f"checkpoint: persisting step {step} (asked by {request.by})"),
            PersistStep(request.id, step),
        ]
    if outcome in _UNDER_WAY and obs.now_s - state.asked_s <= obs.persist_s:
        return []
    if outcome in _UNDER_WAY:
        outcome = f"failed: not persisted within {obs.persist_s:.0f} s"
    state.answered = request.id
    return [
        Event("decision", f"checkpoint of step {step}: {outcome}"),
        ReportCheckpoint(request.id, step, outcome),
    ]
