"""The follower's pure step: one node's way through a generation's phases, decided.

`follower_step(state, obs)` reads a `FollowerObservation` (the clock, the view's newest
record with its plan already parsed, the old workers, this generation's resume instruction,
the fetch's status, the warm pool, the workers' halts and finishes) and writes only
`FollowerState`; it does no I/O and reads no clock. Its actions (elasticpp.agent.actions:
SkipRecord, AskStop, KillOld, DrainWorkerEvents, CleanResume, ArriveStopped, StartFetch,
AssignRanks, ArriveStarted, ArriveStepped, ArriveDone, RecordHalt, ReportFailure,
RemoveResumeDir, CleanLocal, Event) are applied by the handlers the `Follower` (`shell`) registers.

Invariants:
- a phase that depends on an etcd write changes only in the write's feedback
  (`follower_arrived`), after it succeeded: stopping -> moving once `stopped-G` is in etcd,
  moving -> idle and starting -> running once `started-G` is, -> done once `done` is; a
  write that fails (etcd unreachable) leaves the phase, and the next step writes again;
  `stepped-G` (every rank here completed a step of G) is written once in running, the same
  way;
- a generation's fetch starts once (`follower_fetch_started` says whether it may), and its
  outcome comes back in the observation (`FetchStatus`); the assignment's outcome comes back
  through `follower_assigned`; an assignment is all or nothing, and its error fails the
  generation;
- failure reports (ReportFailure) are level-triggered by the follower part, pending until
  etcd has them, so a phase that fails (-> failed) does not wait for that write;
- a transition not written down (`decide.PHASE_TRANSITIONS`) is ignored and logged
  (`GenerationProgress.enter` returns False), never raised; a result for a generation no longer
  followed is ignored.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from elasticpp.agent.actions import (
    Action,
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
from elasticpp.agent.kernel.decide import (
    Phase,
    may_enter,
    phase_deadline_s,
    phase_transition,
)
from elasticpp.agent.kernel.limits import FETCH_STALL_S, STOP_GRACE_S
from elasticpp.agent.kernel.records import JSONValue, Record
from elasticpp.cluster.records import GenerationRecord
from elasticpp.errors import causes
from elasticpp.plan import Plan

log = logging.getLogger("elasticpp.agent")


@dataclass(frozen=True)
class FetchOutcome:
    """What a state fetch came to, handed back to the loop."""

    done_at: float | None = None  # wall time the last piece was in place
    error: str | None = None
    disk_error: bool = False  # the error was this node's own disk (full, read-only, failing)


def fetch_addresses(record: GenerationRecord, members: Mapping[str, Record]) -> dict[str, str]:
    """Where each source of generation `record`'s state is served: the address in its member
    key (a source may lie outside the plan: a draining node hands its state over). Not a
    planned node registered again under another incarnation since: the agent there now is not
    the one whose holdings the resume instruction counted on."""
    moved = record.reregistered(members)
    return {n: str(i.get("address")) for n, i in members.items() if n not in moved}


# Errors of this node's own disk: full (ENOSPC, EDQUOT), read-only, or failing (EIO).
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG})


def is_disk_error(exc: BaseException | None) -> bool:
    """Whether `exc` (or what caused it) is an error of the local disk."""
    return any(isinstance(e, OSError) and e.errno in DISK_ERRNOS for e in causes(exc))


# Steps of the follower in one tick at most: a step whose actions moved the phase (or
# entered a generation) is followed by another on a fresh observation, as far as the
# phases can go in one tick (enter, stopped, moved, started, done; phases only go forward).
STEPS_PER_TICK = 6


@dataclass
class GenerationProgress:
    """This agent's progress through one generation."""

    record: GenerationRecord
    # The record's plan with this node's own job spec's model (`JobSpec.plan_of`): what
    # the workers are handed; the record itself names no model.
    plan: Plan
    phase: Phase = Phase.STOPPING
    phase_since_s: float = field(default_factory=time.monotonic)
    stop_sent: bool = False
    stop_began_s: float = field(default_factory=time.monotonic)
    killed_at_s: float | None = None  # when the old workers were first sent SIGKILL
    # The state fetch runs on a thread of its own that writes nothing here (the shell
    # holds its future and byte count): the step sees it through `FetchStatus`.
    fetch_started: bool = False
    fetch_done_at: float | None = None
    resume: dict[str, JSONValue] | None = None
    waiting_said: str = ""  # the leader's wait for state (why) while this node waits with it
    stepped_arrived: bool = False  # `stepped-G` is in etcd (this node's ranks trained in G)

    @property
    def generation(self) -> int:
        return self.record.generation

    def allows(self, phase: Phase) -> bool:
        """Whether `phase` may follow the current one; a transition not written down (a
        late or reordered observation) is logged as ignored."""
        if may_enter(self.phase, phase):
            return True
        log.info(
            "generation %d: %s -> %s ignored (not a transition of a generation)",
            self.generation,
            self.phase.value,
            phase.value,
        )
        return False

    def enter(self, phase: Phase, now_s: float) -> bool:
        """Move to `phase` at monotonic `now_s`; a transition not written down is ignored
        and reported as False, never raised in the loop."""
        if not self.allows(phase):
            return False
        self.phase = phase_transition(self.phase, phase)
        self.phase_since_s = now_s
        return True

    def overdue(self, now_s: float, hang_timeout_s: float) -> float | None:
        """The deadline of the current phase if it has passed, else None."""
        deadline = phase_deadline_s(self.phase, hang_timeout_s)
        if deadline is None or now_s - self.phase_since_s <= deadline:
            return None
        return deadline

    @property
    def graceful(self) -> bool:
        return bool(self.record.extra.get("graceful"))


@dataclass
class FollowerState:
    """The follower part's state: one object, written by this module's functions on the
    loop (the fetch thread hands its outcome back through a future)."""

    gen: GenerationProgress | None = (
        None  # this node's way through the newest generation it follows
    )
    pending_failures: dict[int, dict[str, JSONValue]] = field(default_factory=dict)  # gen -> report
    failures_held: set[int] = field(default_factory=set)  # reports etcd refused (logged once)
    reported: int = 0  # the newest generation this node reported failed (etcd has it)
    detected: dict[int, float] = field(default_factory=dict)  # generation -> wall time a
    # failure here that calls for it was first seen (the recovery timeline)


@dataclass(frozen=True)
class OldWorker:
    """A worker of a generation older than the one followed."""

    pid: int
    alive: bool
    active: bool  # starting, running or stopping: it can be asked to stop at a boundary


@dataclass(frozen=True)
class FetchStatus:
    """The state fetch of the followed generation: not started, running (`idle_s`: seconds
    since bytes last arrived, None before any progress record), or over (`outcome`)."""

    started: bool = False
    idle_s: float | None = None
    outcome: FetchOutcome | None = None

    @property
    def running(self) -> bool:
        return self.started and self.outcome is None


@dataclass(frozen=True)
class FollowerObservation:
    """What the follower's step sees. `now_s` is monotonic, `wall_s` wall time; the rest is
    of the generation followed now (`FollowerState.gen`), except `record` and `plan`."""

    now_s: float
    wall_s: float
    node_id: str
    record: GenerationRecord | None  # the view's, when newer than the one followed
    plan: Plan | None  # `record`'s plan, parsed; None when it cannot be read
    plan_error: str | None  # why `record`'s plan cannot be read
    old_workers: tuple[OldWorker, ...] = ()
    resume: dict[str, JSONValue] | None = None  # the generation's resume instruction, once written
    resume_wait: str | None = None  # why the leader cannot resume the generation yet (etcd)
    fetch: FetchStatus = FetchStatus()
    ready_spares: int = 0
    spare_replaced: bool = False  # a never-ready spare was replaced since the stop began
    all_started: bool = False  # this generation's workers here all left STARTING
    stepped: int = -1  # the step every worker of this generation here completed (-1: not yet)
    halted: str | None = None  # why a rank of the generation halted (a non-finite step)
    done_ranks: frozenset[int] = frozenset()
    steps: int = 0  # the job's
    hang_timeout_s: float = 0.0
    stop_timeout_s: float = 0.0
    ready_timeout_s: float = 0.0


def follower_step(state: FollowerState, obs: FollowerObservation) -> list[Action]:
    """One step of the follower: enter a newer generation (or skip one whose plan cannot be
    read), then the current phase's work, a halt, the job's end and the phase's deadline.
    Writes only `state`; no I/O."""
    actions: list[Action] = []
    current = state.gen.generation if state.gen else 0
    if obs.record is not None and obs.record.generation > current:
        if obs.plan is None:
            # A plan this build cannot read (a newer leader in a rolling upgrade): following
            # a guess could break the fencing. Keep the current generation, count the value.
            actions.append(SkipRecord(obs.record.generation, obs.plan_error or "unreadable"))
        else:
            return _enter(state, obs.record, obs.plan, obs)
    gs = state.gen
    if gs is None:
        return actions
    if gs.phase is Phase.STOPPING:
        actions += _stop(gs, obs)
    elif gs.phase is Phase.MOVING:
        actions += _move(gs, obs)
    elif gs.phase is Phase.STARTING and obs.all_started:
        moved = gs.fetch_done_at or obs.wall_s
        actions.append(ArriveStarted(gs.generation, moved, obs.wall_s))
    if gs.phase is Phase.RUNNING and obs.stepped >= 0 and not gs.stepped_arrived:
        # Trained, not only started: the leader clears this node's strikes on this arrival.
        actions.append(ArriveStepped(gs.generation, obs.stepped, obs.wall_s))
    # A halt: the workers wrote nothing from the non-finite step on; the job holds at the
    # last finite state instead of replicating poison or re-planning into the same step.
    if (
        obs.halted is not None
        and gs.phase is not Phase.HALTED
        and gs.enter(Phase.HALTED, obs.now_s)
    ):
        actions.append(RecordHalt(obs.halted))  # held in etcd and retried if etcd is down
    mine = {s.rank for s in gs.plan.ranks_on(obs.node_id)}
    if mine and mine <= obs.done_ranks and gs.phase is not Phase.DONE and gs.allows(Phase.DONE):
        actions.append(ArriveDone(gs.generation, obs.steps, obs.wall_s))
    return actions + _deadline(gs, obs)


def _enter(
    state: FollowerState, record: GenerationRecord, plan: Plan, obs: FollowerObservation
) -> list[Action]:
    state.gen = GenerationProgress(record, plan, phase_since_s=obs.now_s, stop_began_s=obs.now_s)
    # Detection times of generations up to this one are of no use now (the leader drops
    # them when it writes a generation; every agent drops them here).
    for g in [g for g in state.detected if g <= record.generation]:
        del state.detected[g]
    how = "stopping at the next step boundary" if state.gen.graceful else "stopping now"
    return [
        Event(
            "decision",
            f"generation {record.generation}: layout {plan.layout} on "
            f"{len(record.planned_nodes)} node(s) ({record.extra.get('reason', '')}); " + how,
        )
    ]


def _stop(gs: GenerationProgress, obs: FollowerObservation) -> list[Action]:
    """Old workers stop: at a boundary for a graceful plan (killed after STOP_GRACE_S), at
    once otherwise; once they are gone, their events are drained and the holdings reported.
    Workers that outlive SIGKILL for `stop_timeout_s` fail the node (severe: it cannot take
    ranks until they are gone)."""
    actions: list[Action] = []
    old = [w for w in obs.old_workers if w.alive]
    active = tuple(w.pid for w in old if w.active)
    if gs.graceful and active and not gs.stop_sent:
        actions.append(AskStop(active))
        gs.stop_sent = True
    elif (not gs.graceful or obs.now_s - gs.stop_began_s > STOP_GRACE_S) and old:
        if gs.killed_at_s is None:
            gs.killed_at_s = obs.now_s
        actions.append(KillOld(tuple(w.pid for w in old)))  # never waits on a process
    if old:
        stuck_s = obs.now_s - (gs.killed_at_s if gs.killed_at_s is not None else obs.now_s)
        if stuck_s > obs.stop_timeout_s:
            pids = ", ".join(str(w.pid) for w in old)
            actions.append(
                ReportFailure(
                    gs.generation,
                    f"old worker(s) {pids} still alive {stuck_s:.0f} s after SIGKILL "
                    "(uninterruptible sleep: a driver or file system hang?); this node "
                    "cannot take ranks until they are gone",
                    culprit=True,
                    severe=True,
                )
            )
            gs.enter(Phase.FAILED, obs.now_s)
        return actions
    # Old workers are gone: no one reads an older generation's resume directory now; their
    # exits and last steps are handled before the holdings are reported.
    return [
        DrainWorkerEvents(),
        CleanResume(gs.generation),
        ArriveStopped(gs.generation, obs.wall_s),
    ]


def _move(gs: GenerationProgress, obs: FollowerObservation) -> list[Action]:
    """Wait for the resume instruction (whoever leads now may have written it), fetch this
    node's state, then hand its ranks to ready warm workers."""
    if obs.resume is None:
        return []
    mine = gs.plan.ranks_on(obs.node_id)
    if not mine:
        return [ArriveStarted(gs.generation, 0.0, obs.wall_s, spare=True)]
    if not obs.fetch.started:
        return [StartFetch(gs.generation, obs.resume)]
    outcome = obs.fetch.outcome
    if outcome is None:
        return []  # running; its deadline is held while bytes arrive (_deadline)
    gs.fetch_done_at = outcome.done_at
    if outcome.error is not None:
        gs.enter(Phase.FAILED, obs.now_s)
        return [
            Event("decision", f"generation {gs.generation}: state fetch failed: {outcome.error}"),
            # This node's own disk (full, read-only, failing) cannot hold its state: it is
            # the cause, and a re-plan onto it would fail the same way.
            ReportFailure(
                gs.generation,
                f"state fetch failed: {outcome.error}",
                culprit=outcome.disk_error,
                severe=outcome.disk_error,
            ),
            # No worker was given it and the fetch is over: what it fetched is of no use.
            RemoveResumeDir(gs.generation),
        ]
    if obs.ready_spares >= len(mine):
        return [AssignRanks(gs.generation, obs.resume)]
    if obs.spare_replaced:
        # A spare this node needs did not become ready within ready_timeout_s.
        gs.enter(Phase.FAILED, obs.now_s)
        return [
            ReportFailure(
                gs.generation,
                f"warm worker(s) not ready within {obs.ready_timeout_s:.0f} s "
                "(replaced, but this node's ranks cannot start)",
                culprit=True,
                severe=True,
            )
        ]
    return []  # warm workers still importing torch


def _deadline(gs: GenerationProgress, obs: FollowerObservation) -> list[Action]:
    """Every phase that waits on someone else has a deadline; past it, the node reports the
    generation failed so that the leader re-plans, instead of waiting for good."""
    idle_s = obs.fetch.idle_s
    if (
        gs.phase is Phase.MOVING
        and obs.fetch.running
        and (idle_s is None or idle_s <= FETCH_STALL_S)
    ):
        # Held only while bytes arrive: a stalled or trickling fetch runs out of time.
        gs.phase_since_s = obs.now_s
        return []
    if not obs.resume_wait or obs.resume is not None:
        gs.waiting_said = ""  # not waiting (any more): a wait said again is told again
    elif gs.phase is Phase.MOVING:
        # The leader found no state to resume from and said so: held while it waits for a
        # node that holds the state, or a checkpoint, to come back. Failing the generation
        # would only get this node blamed for the wait.
        gs.phase_since_s = obs.now_s
        if gs.waiting_said == obs.resume_wait:
            return []
        gs.waiting_said = obs.resume_wait
        return [
            Event(
                "decision",
                f"generation {gs.generation}: waiting for state, without a deadline: the "
                f"leader cannot resume: {obs.resume_wait}",
            )
        ]
    deadline = gs.overdue(obs.now_s, obs.hang_timeout_s)
    if deadline is None:
        return []
    waited = (
        "the resume instruction or a warm worker"
        if gs.phase is Phase.MOVING
        else "its ranks to start"
    )
    phase = gs.phase.value
    gs.enter(Phase.FAILED, obs.now_s)
    return [ReportFailure(gs.generation, f"waited {deadline:.0f} s for {waited} ({phase})")]


def follower_arrived(
    state: FollowerState,
    action: ArriveStopped | ArriveStarted | ArriveStepped | ArriveDone,
    ok: bool,
    now_s: float,
) -> list[Action]:
    """An arrival's result: the phase that depends on it changes now, after the write; a
    failed write (etcd unreachable) leaves the phase, and the next step writes again. A
    result for a generation no longer followed is ignored."""
    gs = state.gen
    if not ok or gs is None or gs.generation != action.generation:
        return []
    if isinstance(action, ArriveStopped):
        if gs.enter(Phase.MOVING, now_s):
            log.info("generation %d: old workers stopped; holdings reported", gs.generation)
        return []
    if isinstance(action, ArriveStepped):
        gs.stepped_arrived = True
        return []
    if isinstance(action, ArriveStarted):
        if action.spare:
            if not gs.enter(Phase.IDLE, now_s):
                return []
            return [Event("decision", f"generation {gs.generation}: no ranks on this node (spare)")]
        # The pool is refilled once they run (the supervisor's refill).
        return [CleanLocal(gs.generation)] if gs.enter(Phase.RUNNING, now_s) else []
    if not gs.enter(Phase.DONE, now_s):
        return []  # e.g. halted: the halt, not a finish, is this job's end
    return [Event("decision", f"job finished all {action.step} steps")]


def follower_fetch_started(state: FollowerState, action: StartFetch) -> bool:
    """Whether the fetch `action` asks for is to start now: once a generation, for the one
    followed. Its outcome comes back through `FetchStatus`."""
    gs = state.gen
    if gs is None or gs.generation != action.generation or gs.fetch_started:
        return False
    gs.resume, gs.fetch_started = action.resume, True
    return True


@dataclass(frozen=True)
class AssignOutcome:
    """What handing the ranks to workers came to: `assigned`; or not, for want of ready
    workers (the next step tries again), or for `error` (the generation fails here)."""

    assigned: bool
    error: str | None = None


def follower_assigned(
    state: FollowerState, action: AssignRanks, outcome: AssignOutcome, now_s: float
) -> list[Action]:
    """All or nothing: on an error no rank of this generation runs here, so a re-plan never
    meets a rank started twice."""
    gs = state.gen
    if gs is None or gs.generation != action.generation:
        return []
    if outcome.assigned:
        gs.enter(Phase.STARTING, now_s)
        return []
    if outcome.error is None:
        return []  # a ready spare died in the meantime: the next step waits or fails
    gs.enter(Phase.FAILED, now_s)
    return [
        ReportFailure(action.generation, f"ranks could not be handed to workers: {outcome.error}")
    ]


def halt_message(message: str, newest_step: int | None) -> str:
    newest = f"step {newest_step}" if newest_step is not None else "none"
    return (
        f"training halted: {message}. Nothing after the last finite state "
        f"is committed (the newest committed step here: {newest}); fix the job (learning "
        "rate, data) and start it again from that step"
    )
