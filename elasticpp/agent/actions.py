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
    """Report a generation failed on this node (the follower publishes it, level-triggered)."""

    generation: int
    reason: str


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
)
