"""Quarantine and the job's end, as the agent carries them out.

The decisions are `elasticpp.agent.sick.SickNodes` (pure, owned by the leader); this part
executes its actions against etcd and carries their outcome to every agent:

- The leader judges each failed generation once (strikes, quarantine, the failure budget),
  quarantines a node that did not arrive at `stopped-G` within `stop_timeout_s`, re-admits
  nodes whose quarantine is over (as a join), and ends the job when the budget is spent.
- Every agent reads the quarantines and the job's end when their keys change (a watch), not
  on every refresh. A quarantined node keeps its registration and idles (no ranks); it says
  so in its status, events and metrics. A job that ended (`failed`, `halted`, or finished)
  stays ended: its agents stop their workers and warm pool, then exit (code 0 finished, 3
  failed, 4 halted: systemd's `RestartPreventExitStatus` keeps them down) or, with
  `--on-job-end idle` (the Helm chart's choice), stay up, healthy and idle until removed, so
  that a StatefulSet does not restart them into a crash loop.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from elasticpp.agent.actions import Action, Event, JobEndedGauge, StopWorkers
from elasticpp.agent.deadlines import stop_wait_s
from elasticpp.agent.decide import ClusterView, lost_nodes
from elasticpp.agent.leaderstate import LeaderState
from elasticpp.agent.sick import EndJob, Quarantine, Quarantined, Readmit, Report
from elasticpp.cluster.health import JobEnd, QuarantineRecord

log = logging.getLogger("elasticpp.agent")


@dataclass
class HealthState:
    """Quarantines and the job's end as this agent knows them: one object, written by this
    module's code on the loop (watches only raise the agent's `health_changed` signal)."""

    quarantines: dict[str, QuarantineRecord] = field(default_factory=dict)  # from etcd
    job_end: JobEnd | None = None  # the job ended without finishing
    end_handled: bool = False
    halt_pending: tuple[str, int] | None = None  # (message, step) not yet on record
    readmitted_s: float = 0.0  # monotonic: a node was last re-admitted (planned again)
    exit_code: int | None = None  # the job ended and on_job_end is "exit"


EXIT_FINISHED = 0
EXIT_FAILED = 3  # the failure budget was spent
EXIT_HALTED = 4  # a step's loss or gradient norm was not finite
EXIT_CODES = {"failed": EXIT_FAILED, "halted": EXIT_HALTED}


def _report(node: str, value: Any) -> Report:
    v = value if isinstance(value, dict) else {}
    at = v.get("at")
    return Report(
        node=node,
        reason=str(v.get("reason", "")),
        at=float(at) if isinstance(at, (int, float)) and not isinstance(at, bool) else 0.0,
        culprit=v.get("culprit") is True,
        severe=v.get("severe") is True,
    )


def job_end_step(
    state: HealthState, end: JobEnd | None, *, any_alive: bool, exit_on_end: bool
) -> list[Action]:
    """A job that ended stays ended: its workers and warm pool are stopped (every step, so
    that nothing started late survives), the end is told once, and the agent exits with the
    end's status once its workers are gone, or idles (`AgentConfig.on_job_end`). Writes only
    `state`; no I/O."""
    if end is None:
        return []
    actions: list[Action] = []
    if not state.end_handled:
        state.end_handled = True
        actions += [
            JobEndedGauge(end.status),
            Event(
                "decision",
                f"job ended ({end.status}, by {end.by}): {end.reason}; "
                + (
                    f"this agent exits with code {EXIT_CODES[end.status]}"
                    if exit_on_end
                    else "this agent idles until it is removed"
                ),
            ),
        ]
    actions.append(StopWorkers())
    if exit_on_end and not any_alive:
        state.exit_code = EXIT_CODES[end.status]
    return actions


def stop_wait_step(
    state: LeaderState,
    generation: int,
    missing: Sequence[str],
    incarnations: Mapping[str, str],
    *,
    now_s: float,
    wall_s: float,
    stop_timeout_s: float,
    nodes: int = 0,
) -> tuple[bool, list[Any]]:
    """The leader's deadline on `stopped-G`: nodes that did not arrive within
    `stop_timeout_s` (a wedged agent, workers that will not die) are quarantined, and the
    job goes on without them. Returns whether the deadline has passed (the missing nodes are
    set aside) and the sick decisions to carry out (`_act_sick`). Writes only `state`."""
    ls = state.at(generation, now_s)
    if ls.stop_wait_since_s is None:
        ls.stop_wait_since_s = now_s
        return False, []
    waited_s = stop_wait_s(stop_timeout_s, nodes)  # grows with the nodes waited for
    if now_s - ls.stop_wait_since_s <= waited_s:
        return False, []
    decisions: list[Any] = []
    for node in missing:
        why = (
            f"did not arrive at stopped-{generation} within {waited_s:.0f} s "
            "(a wedged agent, or workers that will not stop)"
        )
        decisions += state.sick.exclude(node, why, incarnations.get(node, ""), wall_s)
    return True, decisions


class QuarantinePart:
    """Methods of `Agent` (elasticpp.agent.node); the state they use is set up there."""

    # ------------------------------------------------------------------ every agent
    def _read_health(self) -> None:
        """Read the quarantines and the job's end (called by the refresh when a watch said
        they changed, and once at the start)."""
        if not self._health_changed.take():
            return
        try:
            # From the job's cache, which the watch event that raised the signal updated
            # first: a quarantine made every node read etcd twice (2,048 reads at 1,024 nodes).
            records = self.cluster.quarantined(cached=True)
            ended = self.cluster.job_end(cached=True)
        except BaseException:
            self._health_changed.raise_()  # read again on the next tick
            raise
        mine = records.get(self.node_id)
        was = self._hs.quarantines.get(self.node_id)
        if mine is not None and (was is None or was.since != mine.since):
            self.journal.write(
                "decision",
                f"node {self.node_id} is quarantined for {mine.until - mine.since:.0f} s "
                f"(the {mine.count}. time): {mine.reason}",
            )
        elif mine is None and was is not None:
            self.journal.write("decision", f"node {self.node_id} is no longer quarantined")
        self._hs.quarantines = records
        if ended is not None and self._hs.job_end is None:
            self._hs.job_end = ended
        m, lbl = self.metrics, self.metrics.labels
        m.quarantined_nodes.labels(**lbl).set(len(records))
        m.quarantined.labels(**lbl).set(1 if mine is not None else 0)

    def _check_job_end(self) -> None:
        """The health part's every-agent step on the job's end (`job_end_step`, pure)."""
        self._execute(
            job_end_step(
                self._hs,
                self._hs.job_end,
                any_alive=self.pool.any_alive(),
                exit_on_end=self.cfg.on_job_end == "exit",
            )
        )

    def _record_halt(self, message: str) -> None:
        """A halt is the job's, not this node's: recorded in etcd so that no later plan
        (a join, a restarted node) resumes into the same non-finite step again."""
        own = self.store.committed_steps(self.node_id)
        self._hs.halt_pending = (message, own[-1] if own else -1)
        self._publish_halt()

    def _publish_halt(self) -> None:
        if self._hs.halt_pending is None or self._closed:
            return
        message, step = self._hs.halt_pending
        end = self.cluster.end_job("halted", message, by=self.node_id, step=step)
        self._hs.halt_pending = None
        self._health_changed.raise_()
        log.info("job end on record: %s (%s)", end.status, end.reason)

    def quarantine_status(self) -> dict[str, dict[str, Any]]:
        return {
            n: {"reason": q.reason, "until": q.until, "count": q.count}
            for n, q in sorted(self._hs.quarantines.items())
        }

    def lift_quarantine(self, node_id: str) -> tuple[bool, str]:
        """An operator lifts a quarantine (`elasticpp ctl lift NODE`, from any agent)."""
        if not self.cluster.lift_quarantine(node_id):
            return False, f"node {node_id} is not quarantined"
        # The deletion reaches every agent's loop, this one's too, through its watch.
        return True, f"quarantine of {node_id} lifted; the leader plans it again as a join"

    # ------------------------------------------------------------------ the leader
    def _lead_health(self, view: ClusterView) -> ClusterView:
        """Judge the current generation's failure (once), re-admit nodes whose quarantine
        is over; returns the view with the quarantines applied."""
        sick = self._ls.sick
        published = {n: _as_quarantined(r) for n, r in self._hs.quarantines.items()}
        if published != sick.quarantined:
            for n in set(sick.quarantined) - set(published):
                sick.lifted(n)  # an operator lifted it, or a new term reads etcd
            sick.load(published)
        members = self.view.snapshot.members
        memo = self._ls.incarnations_memo
        if memo is not None and memo[0] is members:
            incarnations = memo[1]
        else:
            incarnations = {n: str(i.get("incarnation", "")) for n, i in members.items()}
            self._ls.incarnations_memo = (members, incarnations)
        now = self._clock.time()
        actions = sick.expire(incarnations, now)
        rec = self.view.snapshot.record
        if rec is not None and view.current_nodes is not None:
            current = set(view.current_nodes)
            lost = lost_nodes(view)
            failed = self.view.snapshot.barriers.get(f"failed-{rec.generation}", {})
            reports = [_report(n, v) for n, v in failed.items() if n in current]
            if lost or reports:
                actions += sick.judge(rec.generation, reports, incarnations, now, lost=lost)
            # A node of the generation that answered a probe NOT_SERVING has a stalled
            # decision loop (elasticpp.agent.liveness): it would fail every plan it is in.
            unhealthy = self.liveness.summary().unhealthy
            for node in sorted(current & set(unhealthy)):
                if unhealthy[node] == incarnations.get(node):
                    actions += sick.not_serving(node, incarnations[node], now)
        self._act_sick(actions)
        return self._view()

    def _act_sick(self, actions: list[Any]) -> None:
        for action in actions:
            if isinstance(action, Quarantine):
                q = action.entry
                record = QuarantineRecord(
                    q.node, q.reason, q.since, q.until, q.count, q.incarnation
                )
                if not self.cluster.quarantine(record, self._ls.leadership):
                    return  # the term is over; the next leader judges again
                self.metrics.quarantines_total.labels(**self.metrics.labels).inc()
                self._hs.quarantines = {**self._hs.quarantines, q.node: record}
                self.journal.write(
                    "decision",
                    f"leader: node {q.node} quarantined for {q.until - q.since:.0f} s "
                    f"(the {q.count}. time): {q.reason}",
                )
            elif isinstance(action, Readmit):
                self.cluster.lift_quarantine(action.node)
                self._hs.quarantines = {
                    n: r for n, r in self._hs.quarantines.items() if n != action.node
                }
                self._hs.readmitted_s = (
                    self._clock.monotonic()
                )  # planned again after the settle window
                self.journal.write(
                    "decision", f"leader: node {action.node} re-admitted ({action.reason})"
                )
            elif isinstance(action, EndJob):
                end = self.cluster.end_job(
                    "failed", action.reason, by=self.node_id, step=self.durability.state.last_step
                )
                self._hs.job_end = end
                self.journal.write("decision", f"leader: the job ends: {end.reason}")
            self.view.reread.raise_()


def _as_quarantined(r: QuarantineRecord) -> Quarantined:
    return Quarantined(r.node_id, r.reason, r.since, r.until, r.count, r.incarnation)


def ended_phase(end: JobEnd | None) -> str | None:
    return None if end is None else f"ended ({end.status})"
