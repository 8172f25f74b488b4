"""What a part's pure step asks the executor to do: actions as data.

A part that is a pure step (so far `control.control_step`, `quarantine.job_end_step`,
`supervisor.supervisor_step`, `liveness.leader_watch_step` and `view.view_step`) reads an immutable
observation and its own state and returns a list of these; it does no I/O. The agent's
executor (`node.Agent._execute`) applies them in order, in the error boundary of the part
that asked; an action whose result matters (a probe, a deposition) has it fed back to the
part's own function (`liveness.leader_probed`, `liveness.leader_deposed`), which returns the
next actions. Adding an action means adding its
case to the executor; an action the executor does not know is a programming error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Event:
    """Log a decision or an observation (`ctl events`, and the log)."""

    kind: str
    message: str


@dataclass(frozen=True)
class PublishMemberInfo:
    """Write this node's member key again (what changed: draining, slots)."""


@dataclass(frozen=True)
class StepDown:
    """Resign the leadership, if this node holds it."""

    why: str


@dataclass(frozen=True)
class ReleaseSpares:
    """Stop the warm workers: nothing will be assigned to them any more."""


@dataclass(frozen=True)
class StopWorkers:
    """Kill every worker still alive (without waiting) and stop the warm ones."""


@dataclass(frozen=True)
class JobEndedGauge:
    """Show the job's end in the metrics (`elasticpp_job_ended{status}`)."""

    status: str


@dataclass(frozen=True)
class KillWorker:
    """SIGKILL one worker (by pid) without waiting; its reader thread reports the exit."""

    pid: int


@dataclass(frozen=True)
class ReplaceSpare:
    """Kill a warm worker that never became ready and drop it from the pool (counted)."""

    pid: int


@dataclass(frozen=True)
class SpawnWarm:
    """Start warm workers until the pool holds one per slot."""


@dataclass(frozen=True)
class ReportFailure:
    """Report a generation failed on this node (the follower publishes it, level-triggered).
    `culprit`: this node is the cause, not a victim of a peer's failure; `severe`: the leader
    quarantines it at once (elasticpp.agent.sick)."""

    generation: int
    reason: str
    culprit: bool = False
    severe: bool = False


@dataclass(frozen=True)
class ProbeLeader:
    """Probe the leader's agent; the result goes back to the liveness part
    (`liveness.leader_probed`)."""

    leader: str
    address: str
    incarnation: str


@dataclass(frozen=True)
class DeposeLeader:
    """Delete the leader key of `leader`'s term (a follower's verdict after a failed probe);
    whether it was deleted goes back to the liveness part (`liveness.leader_deposed`)."""

    leader: str
    why: str
    dead_incarnation: str | None  # the leader's incarnation if the probe found it dead


@dataclass(frozen=True)
class Reread:
    """Read etcd again on the next tick (the view)."""


@dataclass(frozen=True)
class SetFloor:
    """The published safe step: the store keeps anchors at or above it (it only rises)."""

    step: int
    generation: int


@dataclass(frozen=True)
class UpdateGauges:
    """Set the agent's gauges from the parts' state (members, leader, generation, workers)."""


# --- the follower's actions
@dataclass(frozen=True)
class SkipRecord:
    """Count a generation record whose plan this build cannot read (it is not followed)."""

    generation: int
    error: str


@dataclass(frozen=True)
class AskStop:
    """Ask old workers (by pid) to stop at the next step boundary."""

    pids: tuple[int, ...]


@dataclass(frozen=True)
class KillOld:
    """SIGKILL old workers (by pid) without waiting; their reader threads report the exits."""

    pids: tuple[int, ...]


@dataclass(frozen=True)
class DrainWorkerEvents:
    """Hand the queued worker events to the supervisor now (the old workers' last steps and
    exits), before what this node holds is reported."""


@dataclass(frozen=True)
class CleanResume:
    """Delete the resume directories of generations older than `generation`."""

    generation: int


@dataclass(frozen=True)
class CleanLocal:
    """Bound local leftovers: older resume directories and all but the newest worker logs."""

    generation: int


@dataclass(frozen=True)
class RemoveResumeDir:
    """Delete `generation`'s own resume directory (its fetch failed; no worker reads it)."""

    generation: int


@dataclass(frozen=True)
class ArriveStopped:
    """Arrive at `stopped-G` with the store's holdings and the next step committed here; the
    result goes back to the follower (`follower.follower_arrived`)."""

    generation: int
    at_s: float  # wall time


@dataclass(frozen=True)
class StartFetch:
    """Fetch this node's state of `generation` on a thread of its own; its future goes back
    to the follower (`follower.follower_fetch_started`)."""

    generation: int
    resume: dict[str, Any]


@dataclass(frozen=True)
class AssignRanks:
    """Hand this node's ranks of `generation` to ready warm workers, all or none; the
    outcome goes back to the follower (`follower.follower_assigned`)."""

    generation: int
    resume: dict[str, Any]


@dataclass(frozen=True)
class ArriveStarted:
    """Arrive at `started-G` (every rank here left STARTING, or none is here: `spare`); the
    result goes back to the follower (`follower.follower_arrived`)."""

    generation: int
    moved_s: float  # wall time this node's state was in place (0 for a spare)
    at_s: float
    spare: bool = False


@dataclass(frozen=True)
class ArriveDone:
    """Arrive at `done`: this node's ranks trained every step; the result goes back to the
    follower (`follower.follower_arrived`)."""

    generation: int
    step: int
    at_s: float


@dataclass(frozen=True)
class RecordHalt:
    """Record the job's halt in etcd (held and retried by the health part), show it in the
    metrics and say what is committed."""

    message: str


Action = (
    Event
    | PublishMemberInfo
    | StepDown
    | ReleaseSpares
    | StopWorkers
    | JobEndedGauge
    | KillWorker
    | ReplaceSpare
    | SpawnWarm
    | ReportFailure
    | ProbeLeader
    | DeposeLeader
    | Reread
    | SetFloor
    | UpdateGauges
    | SkipRecord
    | AskStop
    | KillOld
    | DrainWorkerEvents
    | CleanResume
    | CleanLocal
    | RemoveResumeDir
    | ArriveStopped
    | StartFetch
    | AssignRanks
    | ArriveStarted
    | ArriveDone
    | RecordHalt
)
