"""The agent's executor: it applies the actions the parts' pure steps return
(elasticpp.agent.actions), in order, and feeds the results of those whose outcome matters
back to the part that asked (a probe, a deposition). It is the only place that turns an
action into I/O; the parts' own state is written by the parts' functions it calls.
"""

from __future__ import annotations

import logging

from elasticpp.agent import probe
from elasticpp.agent.actions import (
    Action,
    Commit,
    CountSnapshotFailure,
    DeposeLeader,
    DropUncommitted,
    Event,
    JobEndedGauge,
    KillWorker,
    Persist,
    ProbeLeader,
    PublishMemberInfo,
    RecordCommit,
    RecordPieces,
    ReleaseSpares,
    ReplaceSpare,
    Replicate,
    ReportFailure,
    Reread,
    SetFloor,
    SpawnWarm,
    StepDown,
    StepMetrics,
    StopWorkers,
    UpdateGauges,
    WriteMetricsLine,
)
from elasticpp.agent.durabilitystep import (
    durability_committed,
    durability_dropped,
    durability_recorded,
)
from elasticpp.agent.liveness import leader_deposed, leader_probed
from elasticpp.errors import CheckpointError

log = logging.getLogger("elasticpp.agent")


class ExecutorPart:
    """Methods of `Agent` (elasticpp.agent.node); the state they use is set up there."""

    def _execute(self, actions: list[Action]) -> None:
        """Apply what a part's pure step asked for, in order (elasticpp.agent.actions)."""
        for action in actions:
            if isinstance(action, Event):
                self._event(action.kind, action.message)
            elif isinstance(action, PublishMemberInfo):
                self._registration.update(self._member_info())
            elif isinstance(action, StepDown):
                self._step_down(action.why)
            elif isinstance(action, ReleaseSpares):
                self.pool.release_spares()
            elif isinstance(action, StopWorkers):
                for w in self.pool.workers():
                    if w.proc.alive():
                        self.pool.kill_worker(w)  # never waits on a process that will not go
                self.pool.release_spares()
            elif isinstance(action, KillWorker):
                w = self.pool.worker(action.pid)
                if w is not None:
                    self.pool.kill_worker(w)  # reaped by its reader thread; the loop goes on
            elif isinstance(action, ReplaceSpare):
                spare = next((p for p in self.pool.spares() if p.pid == action.pid), None)
                if spare is not None:
                    self.pool.replace_overdue(spare, self._clock.monotonic())
                    self.metrics.worker_failures_total.labels(**self.metrics.labels).inc()
            elif isinstance(action, SpawnWarm):
                self._spawn_warm()
            elif isinstance(action, ReportFailure):
                self._report_failure(action.generation, action.reason)
            elif isinstance(action, ProbeLeader):
                self._execute(leader_probed(action, probe.check(action.address)))
            elif isinstance(action, DeposeLeader):
                assert self.cluster is not None
                done = self.cluster.depose(action.leader)
                self._execute(leader_deposed(self._lvs, action, done))
            elif isinstance(action, Reread):
                self._reread.raise_()
            elif isinstance(action, SetFloor):
                self.store.set_floor(action.step, action.generation)  # anchors below may go
            elif isinstance(action, UpdateGauges):
                self._update_gauges()
            elif isinstance(action, JobEndedGauge):
                self.metrics.job_ended.labels(**self.metrics.labels, status=action.status).set(1)
            # --- the durability part's actions
            elif isinstance(action, StepMetrics):
                m, lbl = self.metrics, self.metrics.labels
                m.step.labels(**lbl).set(action.step)
                m.loss.labels(**lbl).set(action.loss)
                m.steps_total.labels(**lbl).inc()
                if action.step_seconds is not None:
                    m.step_seconds.labels(**lbl).observe(action.step_seconds)
            elif isinstance(action, WriteMetricsLine):
                self._write_metrics_line(action.line)
            elif isinstance(action, CountSnapshotFailure):
                self.metrics.snapshot_failures_total.labels(**self.metrics.labels).inc()
            elif isinstance(action, RecordPieces):
                error = None
                try:
                    self.store.record_pieces(action.step, action.pieces, action.generation)
                except CheckpointError as exc:
                    error = str(exc)
                    log.info(
                        "snapshot of step %d from rank %d not recorded: %s",
                        action.step,
                        action.rank,
                        exc,
                    )
                self._execute(durability_recorded(self._ds, action, error))
            elif isinstance(action, Commit):
                ok = True
                try:
                    self.store.commit(action.step, action.model.units, action.generation)
                except CheckpointError as exc:
                    ok = False
                    log.warning("step %d not committed: %s", action.step, exc)
                self._execute(durability_committed(self._ds, action, ok))
            elif isinstance(action, DropUncommitted):
                dropped = self.store.drop_uncommitted(action.keep)
                self._execute(durability_dropped(self._ds, dropped, self.store.epoch))
            elif isinstance(action, RecordCommit):
                self._record_commit(action.generation)
            elif isinstance(action, Replicate):
                self._replicate_async()
            elif isinstance(action, Persist):
                self._persist_async(action.step, action.model)
            else:
                raise TypeError(f"no executor for action {action!r}")
