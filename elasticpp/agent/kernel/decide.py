"""Pure decisions of the agent and its leader loop: given what was observed and a clock,
say what to do. No I/O here, so every case is unit-tested with plain values.

- `decide_replan`: does the leader need a new plan generation, and why?
- `is_hung`: has a worker made no step progress for too long?
- `WorkerState` and its `TRANSITIONS`: the life of one supervised worker.
- `Phase` and its `PHASE_TRANSITIONS`: one agent's way through one generation, with a
  deadline for every phase that waits on someone else (`phase_deadline_s`).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Set
from dataclasses import dataclass


class WorkerState(enum.Enum):
    WARM = "warm"  # torch imported, idle, waiting for an assignment
    STARTING = "starting"  # assigned: forming process groups, loading state
    RUNNING = "running"  # reported "started"
    STOPPING = "stopping"  # asked to stop at the next step boundary
    STOPPED = "stopped"  # stopped at a boundary, snapshot written
    DONE = "done"  # trained every step of the job
    FAILED = "failed"  # exited non-zero, hung, or killed for a new generation


TRANSITIONS: dict[WorkerState, frozenset[WorkerState]] = {
    WorkerState.WARM: frozenset({WorkerState.STARTING, WorkerState.FAILED}),
    WorkerState.STARTING: frozenset(
        {
            WorkerState.RUNNING,
            WorkerState.STOPPING,
            WorkerState.STOPPED,
            WorkerState.FAILED,
            WorkerState.DONE,
        }
    ),
    WorkerState.RUNNING: frozenset(
        {WorkerState.STOPPING, WorkerState.DONE, WorkerState.FAILED, WorkerState.STOPPED}
    ),
    WorkerState.STOPPING: frozenset({WorkerState.STOPPED, WorkerState.DONE, WorkerState.FAILED}),
    WorkerState.STOPPED: frozenset(),
    WorkerState.DONE: frozenset(),
    WorkerState.FAILED: frozenset(),
}


class TransitionError(RuntimeError):
    pass


def transition(current: WorkerState, new: WorkerState) -> WorkerState:
    if new is current:
        return current
    if new not in TRANSITIONS[current]:
        raise TransitionError(f"worker cannot go from {current.value} to {new.value}")
    return new


class Phase(enum.StrEnum):
    """Where this agent is in the current generation (DESIGN.md, "Recovery, step by step")."""

    STOPPING = "stopping"  # old workers stop (at a boundary, or killed)
    MOVING = "moving"  # holdings reported; waiting for the resume instruction, fetching state
    STARTING = "starting"  # ranks handed to warm workers; waiting for their "started"
    RUNNING = "running"  # every rank of this node trains
    IDLE = "idle"  # no rank on this node in this plan (a spare)
    DONE = "done"  # this node's ranks trained every step
    HALTED = "halted"  # a step's loss or gradient norm was not finite: training holds
    FAILED = "failed"  # this generation cannot go on here; a failure was reported


PHASE_TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.STOPPING: frozenset({Phase.MOVING, Phase.FAILED}),
    Phase.MOVING: frozenset({Phase.STARTING, Phase.IDLE, Phase.FAILED}),
    Phase.STARTING: frozenset({Phase.RUNNING, Phase.DONE, Phase.HALTED, Phase.FAILED}),
    Phase.RUNNING: frozenset({Phase.DONE, Phase.HALTED, Phase.FAILED}),
    Phase.IDLE: frozenset({Phase.DONE}),
    Phase.DONE: frozenset(),
    Phase.HALTED: frozenset(),
    # A node that reported its generation failed (a deadline fired) whose ranks then trained
    # every step after all: the job is finished, whatever the report said.
    Phase.FAILED: frozenset({Phase.DONE}),
}

# Floors of the phase deadlines: the rendezvous of a generation times out after 60 s, and
# a warm worker that is still importing torch on a loaded node may take tens of seconds.
MOVING_DEADLINE_FLOOR_S = 60.0
STARTING_DEADLINE_FLOOR_S = 90.0


def phase_transition(current: Phase, new: Phase) -> Phase:
    if new is current:
        return current
    if new not in PHASE_TRANSITIONS[current]:
        raise TransitionError(f"generation phase cannot go from {current.value} to {new.value}")
    return new


def may_enter(current: Phase, new: Phase) -> bool:
    """Whether `current -> new` is written down (staying is always allowed). Callers that
    observe something late or out of order ignore the event instead of raising."""
    return new is current or new in PHASE_TRANSITIONS[current]


def phase_deadline_s(phase: Phase, hang_timeout_s: float) -> float | None:
    """How long an agent may wait in `phase` before it escalates (reports the generation
    failed, so the leader re-plans); None for phases that wait on nobody. STOPPING has its
    own grace (a graceful stop turns into a kill); MOVING's clock is held while a state
    transfer is receiving bytes, and runs when it stalls."""
    if phase is Phase.MOVING:
        return max(MOVING_DEADLINE_FLOOR_S, hang_timeout_s)
    if phase is Phase.STARTING:
        return max(STARTING_DEADLINE_FLOOR_S, 2 * hang_timeout_s)
    return None


def is_hung(last_progress_s: float, now_s: float, timeout_s: float) -> bool:
    """A worker is hung when it reported nothing for `timeout_s` (monotonic seconds)."""
    return timeout_s > 0 and now_s - last_progress_s > timeout_s


@dataclass(frozen=True)
class Replan:
    reason: str
    graceful: bool  # True: stop at a step boundary (join, drain); False: stop at once (loss)
    nodes: tuple[str, ...]  # the nodes the new plan may use, sorted


@dataclass(frozen=True)
class Wait:
    reason: str


@dataclass(frozen=True)
class ClusterView:
    """What the leader sees now. Times are monotonic seconds."""

    members: Mapping[str, Mapping[str, object]]  # registered nodes -> their info
    dead: Set[str]  # confirmed dead by a failed probe (their lease may not have lapsed yet)
    current_nodes: tuple[str, ...] | None  # nodes of the current generation; None before any
    failed: Set[str]  # nodes that reported a worker failure in the current generation
    now_s: float
    last_join_s: float  # when the newest member registered
    job_done: bool = False
    restarted: Set[str] = frozenset()  # nodes of the generation whose agent restarted since
    quarantined: Set[str] = frozenset()  # set aside by the leader (elasticpp.agent.sick)
    cordoned: Set[str] = frozenset()  # set aside by an operator (`job cordon`)
    # `live_nodes` and `candidates` of this view when the caller knows them already (the
    # leader keeps them while members, dead and quarantined nodes stay the same:
    # `NodeLists`); None: computed when asked
    lists: NodeLists | None = None


@dataclass(frozen=True)
class NodeLists:
    """A view's live nodes and candidates, both sorted, and the live nodes that drain (see
    `node_lists`)."""

    live: tuple[str, ...]
    usable: tuple[str, ...]
    draining: frozenset[str]


def node_lists(
    members: Mapping[str, Mapping[str, object]],
    dead: Set[str],
    quarantined: Set[str],
    cordoned: Set[str] = frozenset(),
) -> NodeLists:
    """The live members (not dead), of them the ones that may receive work (not draining,
    not quarantined, not cordoned), and the draining ones. O(N log N): the leader keeps the
    result while its inputs are the same (at 2,048 nodes this was ~4 ms of CPU of every
    leader turn)."""
    live = tuple(sorted(n for n in members if n not in dead))
    draining = frozenset(n for n in live if members[n].get("draining"))
    usable = tuple(
        n for n in live if n not in draining and n not in quarantined and n not in cordoned
    )
    return NodeLists(live, usable, draining)


def _lists(view: ClusterView) -> NodeLists:
    return view.lists or node_lists(view.members, view.dead, view.quarantined, view.cordoned)


def live_nodes(view: ClusterView) -> list[str]:
    return list(_lists(view).live)


def candidates(view: ClusterView) -> list[str]:
    """Live nodes that may receive work: not draining, not quarantined."""
    return list(_lists(view).usable)


def lost_nodes(view: ClusterView) -> list[str]:
    """Nodes of the current generation that are gone: dead, lease lapsed, or restarted."""
    if view.current_nodes is None:
        return []
    # O(nodes of the generation), not a sort of every member: the leader asks every tick.
    members, dead, restarted = view.members, view.dead, view.restarted
    return sorted(
        {n for n in view.current_nodes if n not in members or n in dead or n in restarted}
    )


def _short_of(view: ClusterView, usable: list[str], min_nodes: int) -> str:
    held = sorted(view.quarantined & set(view.members))
    aside = f" ({len(held)} quarantined: {', '.join(held)})" if held else ""
    return f"only {len(usable)} usable node(s){aside}, min_nodes is {min_nodes}"


def decide_replan(
    view: ClusterView, *, min_nodes: int, max_nodes: int, settle_s: float
) -> Replan | Wait | None:
    """Whether the leader must write a new generation now; None means nothing to do."""
    if view.job_done:
        return None
    usable = candidates(view)
    chosen = tuple(usable[:max_nodes])
    if view.current_nodes is None:
        if len(usable) < min_nodes:
            return Wait(_short_of(view, usable, min_nodes))
        if view.now_s - view.last_join_s < settle_s:
            return Wait("waiting for joins to settle")
        return Replan(f"initial plan for {len(chosen)} node(s)", graceful=False, nodes=chosen)
    current = set(view.current_nodes)
    lost = lost_nodes(view)
    sick = sorted((current & set(view.quarantined)) - set(lost))
    if lost or sick or view.failed & current:
        if len(usable) < min_nodes:
            return Wait(_short_of(view, usable, min_nodes))
        if lost:
            reason = f"lost node(s) {', '.join(lost)}"
        elif sick:
            reason = f"quarantined node(s) {', '.join(sick)}"
        else:
            reason = f"worker failure on {', '.join(sorted(view.failed & current))}"
        return Replan(reason, graceful=False, nodes=chosen)
    # Every node of `current` is a live member here (else it was lost, above). A drained or
    # cordoned node is left at a step boundary; a cordoned one's agent stays (a spare).
    draining = sorted(current & _lists(view).draining)
    cordoned = sorted((current & set(view.cordoned)) - set(draining))
    if draining or cordoned:
        if len(usable) < min_nodes:
            verbs = [f"drain {', '.join(draining)}"] * bool(draining) + [
                f"cordon off {', '.join(cordoned)}"
            ] * bool(cordoned)
            return Wait(f"cannot {' or '.join(verbs)}: would go below min_nodes")
        what = [f"drain of {', '.join(draining)}"] * bool(draining) + [
            f"cordon of {', '.join(cordoned)}"
        ] * bool(cordoned)
        return Replan(", ".join(what), graceful=True, nodes=chosen)
    joined = sorted(set(chosen) - current)
    if joined:
        if view.now_s - view.last_join_s < settle_s:
            return Wait("waiting for joins to settle")
        return Replan(f"join of {', '.join(joined)}", graceful=True, nodes=chosen)
    return None
