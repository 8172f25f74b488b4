"""A job's stop (`elasticpp job stop`), pure: what every agent does once an operator asked
the job to stop, and how the leader ends it.

Every agent, from the turn it reads the request (`stop_step`): its workers stop at the next
step boundary (the ranks agree on it, so every node stops at the same step and writes it),
are killed if they have not stopped within `grace_s`, and once they are gone the step is
committed (their last events) and this node's pieces of it persisted (`PersistFinal`, with a
persist directory); then it arrives at barrier `stop` with that step and where its
checkpoint stands. Nothing is planned or followed meanwhile: no generation starts during a
stop. The leader (`stop_lead_step`) ends the job as `stopped` once every member arrived, or
once `end_after_s` passed (a node that never says so is named in the end's reason). The
end then reaches every agent through the health part (elasticpp.agent.health): its workers
are gone, it exits 0 or idles.

The steps write only `StopState`; no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from elasticpp.agent.actions import (
    Action,
    ArriveStop,
    AskStop,
    EndStopped,
    Event,
    KillOld,
    PersistFinal,
)
from elasticpp.agent.kernel.records import Record
from elasticpp.agent.kernel.summaries import WorkerSeen
from elasticpp.cluster.records import StopRequest

# Workers in these states train, or are about to: they are asked to stop at a boundary.
_TRAINING = ("starting", "running")


@dataclass
class StopState:
    """The stop as this agent carries it out, plain data: written on the loop by the `Stop`
    object (the request, read from etcd) and the steps here."""

    request: StopRequest | None = None  # the operator's request, once on record
    began_s: float | None = None  # monotonic: this agent read the request
    asked: set[int] = field(default_factory=set)  # workers asked to stop at a boundary
    killed_s: float | None = None  # monotonic: the workers left were killed
    persist_asked: int | None = None  # the step PersistFinal was asked for
    arrived: bool = False  # this node's arrival at `stop` was written
    ended: bool = False  # (leader) the end was asked for


@dataclass(frozen=True)
class StopObservation:
    """What every agent's stop step sees."""

    now_s: float
    workers: tuple[WorkerSeen, ...]  # the workers with a rank that have not exited
    committed: int  # this node's newest own committed step; -1 if none
    checkpoint: str  # its persist outcome (Durability.persist_outcome)
    grace_s: float  # workers still training this long after the request are killed
    stuck_s: float  # killed workers not gone this long after: arrive without them
    persist_s: float  # a final checkpoint still pending this long: arrive without it


@dataclass(frozen=True)
class StopLeadObservation:
    """What the leader's stop step sees."""

    now_s: float
    members: frozenset[str]  # the job's registered agents
    arrivals: Mapping[str, Record]  # barrier `stop`: node -> {step, checkpoint}
    end_after_s: float  # the end is written this long after the request at the latest


def stop_step(state: StopState, obs: StopObservation) -> list[Action]:
    """Every agent's part of a stop (see the module)."""
    request = state.request
    if request is None or state.arrived:
        return []
    actions: list[Action] = []
    if state.began_s is None:
        state.began_s = obs.now_s
        actions.append(
            Event(
                "decision",
                f"job stop requested by {request.by} ({request.reason}): the workers stop at "
                "the next step boundary; the step is committed and persisted, then the job "
                "ends",
            )
        )
    since_s = obs.now_s - state.began_s
    new = tuple(w.pid for w in obs.workers if w.state in _TRAINING and w.pid not in state.asked)
    if new:
        state.asked.update(new)
        actions.append(AskStop(new))
    if obs.workers:
        if since_s > obs.grace_s and state.killed_s is None:
            state.killed_s = obs.now_s
            pids = tuple(w.pid for w in obs.workers)
            actions += [
                Event(
                    "decision",
                    f"job stop: worker(s) {', '.join(map(str, pids))} did not stop within "
                    f"{obs.grace_s:.0f} s; killed (the job ends at the step committed before)",
                ),
                KillOld(pids),
            ]
        if state.killed_s is None or obs.now_s - state.killed_s <= obs.stuck_s:
            return actions
    checkpoint = obs.checkpoint
    if obs.committed >= 0 and checkpoint in ("unknown", "pending"):
        if checkpoint == "unknown" and state.persist_asked != obs.committed:
            state.persist_asked = obs.committed  # (a periodic persist may be pending already)
            return [*actions, PersistFinal(obs.committed)]
        if checkpoint == "pending" and since_s <= obs.persist_s:
            return actions  # the persister writes it
        checkpoint = (
            f"failed: not persisted within {obs.persist_s:.0f} s"
            if checkpoint == "pending"
            else "failed: not submitted (the step is no commit held here)"
        )
    if obs.committed < 0:
        checkpoint = "none"  # no ranks here, or nothing committed yet
    state.arrived = True
    return [*actions, ArriveStop(obs.committed, checkpoint)]


def stop_lead_step(state: StopState, obs: StopLeadObservation) -> list[Action]:
    """The leader ends a stopped job: at the lowest step the nodes committed (every node
    holds it), once every member arrived at `stop` or `end_after_s` passed."""
    request = state.request
    if request is None or state.ended or state.began_s is None:
        return []
    missing = sorted(obs.members - set(obs.arrivals))
    if missing and obs.now_s - state.began_s <= obs.end_after_s:
        return []
    steps: dict[str, int] = {}
    checkpoints: dict[str, str] = {}
    for node, value in obs.arrivals.items():
        step, checkpoint = value.get("step"), value.get("checkpoint")
        if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
            steps[node] = step
        checkpoints[node] = checkpoint if isinstance(checkpoint, str) else "?"
    step = min(steps.values(), default=-1)
    state.ended = True
    reason = f"stopped by {request.by} ({request.reason}); "
    reason += f"step {step} committed" if step >= 0 else "no step committed"
    failed = {n: c for n, c in sorted(checkpoints.items()) if c.startswith("failed")}
    if any(c == "persisted" for c in checkpoints.values()) and not failed:
        reason += ", checkpoint persisted"
    for node, why in failed.items():
        reason += f"; {node}: checkpoint {why}"
    if missing:
        reason += f"; not heard from: {', '.join(missing)}"
    return [
        EndStopped(reason, step),
        Event("decision", f"leader: the job ends: {reason}"),
    ]
