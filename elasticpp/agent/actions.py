"""What a part's pure step asks the executor to do: actions as data.

A part that is a pure step (so far `control.control_step` and `quarantine.job_end_step`)
reads an immutable observation and its own state and returns a list of these; it does no
I/O. The agent's executor (`node.Agent._execute`) applies them in order, in the error
boundary of the part that asked. Adding an action means adding its case to the executor;
an action the executor does not know is a programming error and raises.
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


Action = Event | PublishMemberInfo | StepDown | ReleaseSpares | StopWorkers | JobEndedGauge
