"""What a part's pure step asks the executor to do: actions as data.

A part that is a pure step (`control.control_step` so far) reads an immutable observation
and its own state and returns a list of these; it does no I/O. The agent's executor
(`node.Agent._execute`) applies them in order, each in the error boundary of the part that
asked. Adding an action means adding its case to the executor; an action the executor does
not know is a programming error and raises.
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


Action = Event | PublishMemberInfo | StepDown | ReleaseSpares
