"""Quarantine and the job's end, as the agent carries them out.

The decisions are `elasticpp.agent.sick.SickNodes` (pure, owned by the leader); this part
executes its actions against etcd and carries their outcome to every agent:

- The leader judges each failed generation once (strikes, quarantine, the failure budget),
  quarantines a node that did not arrive at `stopped-G` within `stop_timeout_s`, re-admits
  nodes whose quarantine is over (as a join), and ends the job when the budget is spent:
  its decisions come here as one `SetAside` action, carried out in order until etcd refuses
  a write fenced by the term (the next leader judges again).
- Every agent reads the quarantines and the job's end when their keys change (a watch
  raises `changed`), not on every refresh. A quarantined node keeps its registration and
  idles (no ranks); it says so in its status, events and metrics. A job that ended
  (`failed`, `halted`, or finished) stays ended: its agents stop their workers and warm
  pool, then exit (code 0 finished, 3 failed, 4 halted: systemd's `RestartPreventExitStatus`
  keeps them down) or, with `--on-job-end idle` (the Helm chart's choice), stay up, healthy
  and idle until removed, so that a StatefulSet does not restart them into a crash loop.
- A halt (a step whose loss or gradient norm was not finite) is the job's: recorded in
  etcd, held and retried until etcd has it.

`Health` is built with its ports: the etcd calls it makes (`HealthCluster`), the clock, the
journal, the metrics, the pool (whether workers are alive), this node's newest own commit,
the leader's term and a way to have the view read again. It owns a plain `HealthState`;
other parts read `summary()`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from elasticpp.agent.actions import Action, RecordHalt, SetAside
from elasticpp.agent.follower.step import halt_message
from elasticpp.agent.health.step import HealthState, job_end_step
from elasticpp.agent.kernel.clock import Clock
from elasticpp.agent.kernel.executor import Executor
from elasticpp.agent.kernel.inbox import Signal
from elasticpp.agent.kernel.journal import Journal
from elasticpp.agent.kernel.metrics import AgentMetrics
from elasticpp.agent.kernel.ports import PoolPort
from elasticpp.agent.kernel.summaries import HealthSummary
from elasticpp.agent.sick import Action as SickAction
from elasticpp.agent.sick import EndJob, Quarantine, Readmit
from elasticpp.cluster.errors import ClusterUnavailableError
from elasticpp.cluster.leases import Leadership
from elasticpp.cluster.records import CordonRecord, JobEnd, QuarantineRecord

log = logging.getLogger("elasticpp.agent")


class HealthRequests(Protocol):
    """The operator's cordons in etcd (elasticpp.cluster.requests.Requests, a
    `ClusterClient`'s `requests`): the health part publishes them with the quarantines."""

    def cordoned(self, *, cached: bool = ...) -> dict[str, CordonRecord]: ...


class HealthRecords(Protocol):
    """The etcd calls of the health part: what the job's health in etcd answers
    (elasticpp.cluster.health.Health, a `ClusterClient`'s `health`)."""

    def quarantined(self, *, cached: bool = ...) -> dict[str, QuarantineRecord]: ...
    def job_end(self, *, cached: bool = ...) -> JobEnd | None: ...
    def end_job(self, status: str, reason: str, by: str, step: int = ...) -> JobEnd: ...
    def quarantine(self, record: QuarantineRecord, leader: Leadership) -> bool: ...
    def lift_quarantine(self, node_id: str) -> bool: ...


@dataclass(frozen=True)
class HealthConfig:
    node_id: str
    exit_on_end: bool  # on_job_end "exit": leave once the job ended; else idle


class Health:
    """The health part: quarantines, the job's end, halts."""

    def __init__(
        self,
        config: HealthConfig,
        *,
        clock: Clock,
        journal: Journal,
        metrics: AgentMetrics,
        records: HealthRecords,
        requests: HealthRequests,
        pool: PoolPort,
        own_step: Callable[[], int | None],
        last_step: Callable[[], int],
        leadership: Callable[[], Leadership | None],
        reread: Callable[[], None],
    ) -> None:
        self.config = config
        self.state = HealthState()
        # Raised by the watches (the quarantine or end keys changed) and at the start.
        self.changed = Signal(raised=True)
        self._clock = clock
        self._journal = journal
        self._metrics = metrics
        self._records = records
        self._requests = requests
        self._pool = pool
        self._own_step = own_step  # this node's newest own committed step, if any
        self._last_step = last_step  # the newest step this node's ranks trained
        self._leadership = leadership  # the leader's term, while this agent leads
        self._reread = reread
        self._closed = False

    def register(self, executor: Executor) -> None:
        """The handlers of the actions only this part carries out."""
        executor.register(RecordHalt, self._record_halt)
        executor.register(SetAside, lambda a: self.carry_out(a.decisions))

    def close(self) -> None:
        """Write nothing more (the agent's etcd client is closing)."""
        self._closed = True

    def summary(self) -> HealthSummary:
        end = self.state.job_end
        return HealthSummary(
            ended=(end.status, end.reason) if end is not None else None,
            quarantined=self.state.quarantines,
            cordoned=self.state.cordoned,
            readmitted_s=self.state.readmitted_s,
            exit_code=self.state.exit_code,
        )

    def quarantines(self) -> Mapping[str, QuarantineRecord]:
        """The quarantine records as this agent knows them (replaced whole on each change:
        read them, never write)."""
        return self.state.quarantines

    # ------------------------------------------------------------------ every agent
    def read(self) -> None:
        """Read the quarantines, the cordons and the job's end (when a watch said they
        changed, and once at the start)."""
        if not self.changed.take():
            return
        try:
            # From the job's cache, which the watch event that raised the signal updated
            # first: a quarantine made every node read etcd twice (2,048 reads at 1,024 nodes).
            records = self._records.quarantined(cached=True)
            cordons = self._requests.cordoned(cached=True)
            ended = self._records.job_end(cached=True)
        except BaseException:
            self.changed.raise_()  # read again on the next tick
            raise
        node_id, state = self.config.node_id, self.state
        mine = records.get(node_id)
        was = state.quarantines.get(node_id)
        if mine is not None and (was is None or was.since != mine.since):
            self._journal.write(
                "decision",
                f"node {node_id} is quarantined for {mine.until - mine.since:.0f} s "
                f"(the {mine.count}. time): {mine.reason}",
            )
        elif mine is None and was is not None:
            self._journal.write("decision", f"node {node_id} is no longer quarantined")
        state.quarantines = records
        cordoned = frozenset(cordons)
        if cordoned != state.cordoned:
            for node in sorted(cordoned - state.cordoned):
                c = cordons[node]
                self._journal.write("decision", f"node {node} cordoned by {c.by}: {c.reason}")
            for node in sorted(state.cordoned - cordoned):
                self._journal.write("decision", f"node {node} uncordoned")
            state.cordoned = cordoned
        if ended is not None and state.job_end is None:
            state.job_end = ended
        m, lbl = self._metrics, self._metrics.labels
        m.quarantined_nodes.labels(**lbl).set(len(records))
        m.quarantined.labels(**lbl).set(1 if mine is not None else 0)

    def check_job_end(self) -> list[Action]:
        """The every-agent step on the job's end (`job_end_step`, pure)."""
        return job_end_step(
            self.state,
            self.state.job_end,
            any_alive=self._pool.any_alive(),
            exit_on_end=self.config.exit_on_end,
        )

    def _record_halt(self, action: RecordHalt) -> None:
        """A halt is the job's, not this node's: recorded in etcd so that no later plan (a
        join, a restarted node) resumes into the same non-finite step again; held and
        retried (`publish_halt`) while etcd is down."""
        self._metrics.halted.labels(**self._metrics.labels).set(1)
        own = self._own_step()
        self.state.halt_pending = (action.message, own if own is not None else -1)
        with contextlib.suppress(ClusterUnavailableError):
            self.publish_halt()
        self._journal.write("decision", halt_message(action.message, own))

    def publish_halt(self) -> None:
        state = self.state
        if state.halt_pending is None or self._closed:
            return
        message, step = state.halt_pending
        end = self._records.end_job("halted", message, by=self.config.node_id, step=step)
        state.halt_pending = None
        self.changed.raise_()
        log.info("job end on record: %s (%s)", end.status, end.reason)

    def lift(self, node_id: str) -> tuple[bool, str]:
        """An operator lifts a quarantine (`elasticpp ctl lift NODE`, from any agent)."""
        if not self._records.lift_quarantine(node_id):
            return False, f"node {node_id} is not quarantined"
        # The deletion reaches every agent's loop, this one's too, through its watch.
        return True, f"quarantine of {node_id} lifted; the leader plans it again as a join"

    # ------------------------------------------------------------------ the leader
    def carry_out(self, decisions: Sequence[SickAction]) -> None:
        """The leader's health decisions (elasticpp.agent.sick), in order: a quarantine etcd
        refuses (the term is over) ends them: the next leader judges again."""
        state, journal, m = self.state, self._journal, self._metrics
        for decision in decisions:
            if isinstance(decision, Quarantine):
                q = decision.entry
                record = QuarantineRecord(
                    q.node, q.reason, q.since, q.until, q.count, q.incarnation
                )
                term = self._leadership()
                if term is None or not self._records.quarantine(record, term):
                    return  # the term is over; the next leader judges again
                m.quarantines_total.labels(**m.labels).inc()
                state.quarantines = {**state.quarantines, q.node: record}
                journal.write(
                    "decision",
                    f"leader: node {q.node} quarantined for {q.until - q.since:.0f} s "
                    f"(the {q.count}. time): {q.reason}",
                )
            elif isinstance(decision, Readmit):
                self._records.lift_quarantine(decision.node)
                state.quarantines = {
                    n: r for n, r in state.quarantines.items() if n != decision.node
                }
                state.readmitted_s = self._clock.monotonic()  # planned again after settling
                journal.write(
                    "decision", f"leader: node {decision.node} re-admitted ({decision.reason})"
                )
            elif isinstance(decision, EndJob):
                end = self._records.end_job(
                    "failed", decision.reason, by=self.config.node_id, step=self._last_step()
                )
                state.job_end = end
                journal.write("decision", f"leader: the job ends: {end.reason}")
            self._reread()
