"""The pace of the agent's decision loop: how long it may sleep when nothing wakes it.

The loop (elasticpp.agent.node) takes a turn when woken (watch events, worker events,
futures' results) or when its tick is due. The tick is BUSY_TICK_S while something polls
(a transition led here, a failure of this node's waiting for a plan, a drain, an
unreachable etcd, joining), TRAINING_TICK_S while workers train or a leader's transition
is over, QUIET_TICK_S for a quiet follower and up to RESTING_TICK_S for one at rest (never
past its supervisor's next deadline); a due campaign and a stale status snapshot shorten
it. `tick_s` decides it, pure, from a `PaceObservation` the agent's loop takes of the parts'
summaries (elasticpp.agent.node, `Agent.rest_s`); nothing here writes a part's state.
`TurnPace` is the loop's own state: when it takes its next turn and publishes its status.
"""

from __future__ import annotations

from dataclasses import dataclass

from elasticpp.agent.kernel.decide import Phase
from elasticpp.agent.kernel.limits import (
    BUSY_TICK_S,
    LEADER_TURN_GAP_MAX_S,
    LEADER_TURN_SHARE,
    QUIET_TICK_S,
    RESTING_TICK_S,
    STATUS_EVERY_S,
    TRAINING_TICK_S,
)


@dataclass(frozen=True)
class PaceObservation:
    """What the loop's pace depends on, read from the parts once before the loop waits."""

    joined: bool
    etcd_ok: bool
    current: int  # the newest generation record's (0: none)
    followed: int  # the generation this node follows (0: none)
    follower_settled: bool  # no failure report of its own waits (`Follower.settled`)
    suspecting: bool  # this follower suspects the leader (liveness)
    draining: bool
    training: bool  # a worker reported a step within a quiet tick
    leading: bool  # this agent holds the leader's term
    led_generation: int  # the generation its term last led
    timeline_written: bool  # ... and whose transition is over
    phase: Phase | None  # this node's phase in the generation it follows
    rest_s: float | None  # the supervisor's rest until its next deadline (None: it polls)
    campaign_in_s: float | None  # until this node's campaign is due, while none leads


def tick_s(obs: PaceObservation) -> float:
    """How long the loop may sleep when nothing wakes it (see limits.QUIET_TICK_S). A
    follower's way through a generation is driven by events (the records' watch events, its
    workers' events, the fetch's future) and deadlines of seconds, so it ticks quietly in
    every phase while its workers are silent (a spare, a node waiting for a plan, the
    simulated workers of bench/scale.py). What polls at BUSY_TICK_S: leading a transition
    (its waits read its cache), a failure of this node's until a new plan answers it (the
    leader is suspected after LEADER_SUSPECT_S), a drain, an unreachable etcd and joining.
    Training (workers that reported a step within a quiet tick), the steady state of a job,
    ticks at TRAINING_TICK_S, leader or not, and so does a leader whose transition is over.
    A quiet follower at rest (its ranks running or none planned here) ticks up to
    RESTING_TICK_S, never past the supervisor's next deadline; a due campaign shortens the
    tick (an overdue one polls, never spins)."""
    settled = (
        obs.joined
        and obs.etcd_ok
        and obs.current == obs.followed  # a record not yet followed is taken next tick
        and obs.follower_settled
        and not obs.suspecting
        and not obs.draining
    )
    if not settled:
        return BUSY_TICK_S
    if obs.training:
        tick = TRAINING_TICK_S
    elif not obs.leading:
        tick = _quiet_tick_s(obs.phase, obs.rest_s)
    elif obs.current and obs.led_generation == obs.current and obs.timeline_written:
        # Its transition is over: it waits for watch events now, and its deadlines (a
        # join's settling, a quarantine's end) need no more than a training leader's pace.
        tick = TRAINING_TICK_S
    else:
        tick = BUSY_TICK_S
    if obs.campaign_in_s is not None:
        tick = min(tick, max(BUSY_TICK_S, obs.campaign_in_s))
    return tick


def _quiet_tick_s(phase: Phase | None, rest_s: float | None) -> float:
    if phase not in (Phase.RUNNING, Phase.IDLE) or rest_s is None:
        return QUIET_TICK_S
    return max(BUSY_TICK_S, min(RESTING_TICK_S, rest_s))


@dataclass
class TurnPace:
    """When the loop takes its next turn and publishes the status the RPCs read: the loop's
    own state (plain data; the agent passes the time in, so nothing here reads a clock).

    A leader's turn of c seconds of CPU makes its next turn wait c * (1 / LEADER_TURN_SHARE
    - 1), at most LEADER_TURN_GAP_MAX_S (limits): the wakes of a transition's N arrivals are
    taken a batch a turn, not a turn each. A follower's turns are not paced. The status is
    published at most every STATUS_EVERY_S, and soon after a turn that changed it."""

    status_at_s: float = 0.0  # when the status was last published
    status_stale: bool = False  # a turn ran since
    next_turn_s: float = 0.0  # no turn before (a leader's pace)
    turn_waits: bool = False  # a turn was deferred: the loop takes it at next_turn_s

    def status_due(self, now_s: float) -> bool:
        """A turn ran: whether its status is to be published now (then it counts as
        published), or later, by a turn when STATUS_EVERY_S is up."""
        if now_s - self.status_at_s >= STATUS_EVERY_S:
            self.status_at_s = now_s
            self.status_stale = False
            return True
        self.status_stale = True
        return False

    def after_turn(self, cpu_s: float, leading: bool, now_s: float) -> None:
        """A turn of `cpu_s` seconds of CPU ended (as the leader, or not)."""
        self.turn_waits = False
        if leading:
            gap_s = min(LEADER_TURN_GAP_MAX_S, cpu_s * (1.0 / LEADER_TURN_SHARE - 1.0))
            self.next_turn_s = now_s + gap_s
        else:
            self.next_turn_s = 0.0

    def deferred(self, stopping: bool, now_s: float) -> bool:
        """Whether a woken turn comes before the pace allows (then it is taken when it
        does); a stop is never deferred."""
        if stopping or now_s >= self.next_turn_s:
            return False
        self.turn_waits = True
        return True

    def idle_for(self, tick: float, now_s: float) -> float:
        """How long the loop may wait, its tick being `tick`: less when a stale status is
        due, and no turn before the leader's pace allows (a deferred one right then)."""
        if self.status_stale:
            tick = min(tick, max(0.0, self.status_at_s + STATUS_EVERY_S - now_s))
        gap_s = self.next_turn_s - now_s
        if gap_s > 0:
            tick = gap_s if self.turn_waits else max(tick, gap_s)
        return tick
