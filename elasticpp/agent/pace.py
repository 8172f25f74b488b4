"""The pace of the agent's decision loop: how long it may sleep when nothing wakes it.

The loop (elasticpp.agent.node) takes a turn when woken (watch events, worker events,
futures' results) or when its tick is due. The tick is BUSY_TICK_S while something polls
(a transition led here, a failure of this node's waiting for a plan, a drain, an
unreachable etcd, joining), TRAINING_TICK_S while workers train or a leader's transition
is over, QUIET_TICK_S for a quiet follower and up to RESTING_TICK_S for one at rest (never
past its supervisor's next deadline); a due campaign and a stale status snapshot shorten
it. Reads the parts' state only; writes nothing of theirs (the loop heartbeat's idle mark
is the loop's own).
"""

from __future__ import annotations

import time

from elasticpp.agent.decide import Phase
from elasticpp.agent.limits import (
    BUSY_TICK_S,
    QUIET_TICK_S,
    RESTING_TICK_S,
    STATUS_EVERY_S,
    TRAINING_TICK_S,
)


class PacePart:
    """Methods of `Agent` (elasticpp.agent.node); the state they use is set up there."""

    def idle_for(self) -> float:
        """The loop is about to wait: the longest it may (`_tick_s`); from now on it counts
        as idle, not stalled (`clock.LoopHeartbeat`)."""
        tick_s = self._tick_s()
        if self._status_stale:  # a turn changed what the RPCs read: publish it soon
            due_s = self._status_at_s + STATUS_EVERY_S - time.monotonic()
            tick_s = min(tick_s, max(0.0, due_s))
        gap_s = self._next_turn_s - time.monotonic()
        if gap_s > 0:  # no turn before the leader's pace allows; a deferred one right then
            tick_s = gap_s if self._turn_waits else max(tick_s, gap_s)
        self._heartbeat.idle()
        return tick_s

    def _tick_s(self) -> float:
        """How long the loop may sleep when nothing wakes it (see limits.QUIET_TICK_S). A
        follower's way through a generation is driven by events (the records' watch events,
        its workers' events, the fetch's future) and deadlines of seconds, so it ticks
        quietly in every phase while its workers are silent (a spare, a node waiting for a
        plan, the simulated workers of bench/scale.py). What polls at BUSY_TICK_S: leading
        a transition (its waits read its cache), a failure of this node's until a new plan
        answers it (the leader is suspected after LEADER_SUSPECT_S), a drain, an unreachable
        etcd and joining. Training (workers that
        reported a step within a quiet tick), the steady state of a job, ticks at
        TRAINING_TICK_S, leader or not, and so does a leader whose transition is over."""
        follower, rec = self.follower.summary(), self.view.snapshot.record
        followed = follower.generation
        current = rec.generation if rec is not None else 0
        # A step reported within a quiet tick keeps the training tick: that every part of its
        # durability work (commits, replication, the safe step) wakes the loop is not
        # established. Other worker events (ready, started, an exit) wake it once.
        training = time.monotonic() - self.pool.trained_at_s < QUIET_TICK_S
        settled = (
            self._joined
            and self.view.snapshot.etcd_ok
            and current == followed  # a record not yet followed is taken at the next tick
            and self.follower.settled(current)
            and not self.liveness.summary().suspecting
            and not self.control.summary().draining
        )
        if not settled:
            return BUSY_TICK_S
        ls = self._ls
        if training:
            tick_s = TRAINING_TICK_S
        elif ls.leadership is None:
            tick_s = self._quiet_tick_s(follower.phase)
        elif current and ls.generation == current and ls.timeline_written:
            # Its transition is over: it waits for watch events now, and its deadlines (a
            # join's settling, a quarantine's end) need no more than a training leader's pace.
            tick_s = TRAINING_TICK_S
        else:
            tick_s = BUSY_TICK_S
        campaign_at_s = self._ls.campaign_at_s  # leaderless: this node's campaign is due then
        if campaign_at_s is not None and self.view.snapshot.leader is None:
            due_s = campaign_at_s - self._clock.monotonic()
            tick_s = min(tick_s, max(BUSY_TICK_S, due_s))  # overdue: polls, never spins
        return tick_s

    def _quiet_tick_s(self, phase: Phase | None) -> float:
        """A quiet follower's tick: QUIET_TICK_S, or up to RESTING_TICK_S at rest (its ranks
        running or none planned here, the supervisor with no poll of its own), never past
        the supervisor's next deadline."""
        if phase not in (Phase.RUNNING, Phase.IDLE):
            return QUIET_TICK_S
        rest_s = self.supervisor.rest_for_s(self._clock.monotonic())
        if rest_s is None:
            return QUIET_TICK_S
        return max(BUSY_TICK_S, min(RESTING_TICK_S, rest_s))
