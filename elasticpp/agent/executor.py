"""The agent's executor: it applies the actions the parts' pure steps return
(elasticpp.agent.actions), in order, and feeds the results of those whose outcome matters
back to the part that asked (a probe, a deposition). It is the only place that turns an
action into I/O; the parts' own state is written by the parts' functions it calls.
"""

from __future__ import annotations

import logging
from pathlib import Path

from elasticpp.agent import probe
from elasticpp.agent.actions import (
    Action,
    CheckNeverCommitted,
    CleanRendezvous,
    Commit,
    ConfirmDead,
    CountRecovery,
    CountSnapshotFailure,
    DeposeLeader,
    DropUncommitted,
    Event,
    Housekeep,
    JobEndedGauge,
    KillWorker,
    Persist,
    ProbeLeader,
    PublishMemberInfo,
    ReadCommitRecords,
    ReadSafe,
    RecordCommit,
    RecordPieces,
    RecordTimeline,
    ReleaseSpares,
    ReplaceSpare,
    Replicate,
    ReportFailure,
    Reread,
    ResolveResume,
    SetAside,
    SetFloor,
    SpawnWarm,
    StepDown,
    StepMetrics,
    StopWorkers,
    UpdateGauges,
    WriteGeneration,
    WriteMetricsLine,
    WriteResume,
    WriteSafe,
)
from elasticpp.agent.durabilitystep import (
    durability_committed,
    durability_dropped,
    durability_recorded,
)
from elasticpp.agent.leaderstep import (
    leader_fresh_checked,
    leader_generation_written,
    leader_resume_resolved,
    leader_resume_written,
    leader_safe_read,
    leader_safe_step,
    leader_safe_written,
    leader_timeline_recorded,
)
from elasticpp.agent.liveness import leader_deposed, leader_probed
from elasticpp.errors import CheckpointError
from elasticpp.store.persist import checkpoint_holdings

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
            # --- the leader's actions
            elif isinstance(action, WriteGeneration):
                assert self.cluster is not None
                ok = self.cluster.write_generation(
                    action.record, action.expected_rev, self._ls.leadership
                )
                self._execute(leader_generation_written(self._ls, action, ok))
            elif isinstance(action, ConfirmDead):
                self._confirm_dead(action.nodes)
            elif isinstance(action, SetAside):
                self._act_sick(list(action.decisions))
            elif isinstance(action, ResolveResume):
                disk = None
                if action.persist_dir and Path(action.persist_dir).is_dir():
                    disk = checkpoint_holdings(Path(action.persist_dir), self.store.job)
                self._execute(leader_resume_resolved(self._ls, action, disk))
            elif isinstance(action, CheckNeverCommitted):
                assert self.cluster is not None
                ever = self.cluster.ever_committed()
                self._execute(leader_fresh_checked(self._ls, action, ever))
            elif isinstance(action, WriteResume):
                assert self.cluster is not None
                ok = self.cluster.write_resume(
                    action.generation, dict(action.value), self._ls.leadership
                )
                self._reread.raise_()
                self._execute(leader_resume_written(self._ls, action, ok))
            elif isinstance(action, RecordTimeline):
                assert self.cluster is not None
                ok = self.cluster.record_timeline(
                    action.generation, dict(action.timeline), self._ls.leadership
                )
                self._execute(leader_timeline_recorded(self._ls, action, ok))
            elif isinstance(action, Housekeep):
                assert self.cluster is not None
                removed = self.cluster.housekeep(action.generation, leader=self._ls.leadership)
                if removed:
                    log.info("leader: removed %d etcd key(s) of older generations", removed)
            elif isinstance(action, CleanRendezvous):
                self._clean_rendezvous(action.generation)
            elif isinstance(action, CountRecovery):
                self.metrics.recoveries_total.labels(**self.metrics.labels).inc()
                self.metrics.recovery_seconds.labels(**self.metrics.labels).observe(action.seconds)
            elif isinstance(action, ReadCommitRecords):
                assert self.cluster is not None
                records = self.cluster.commit_records(action.generation)
                self._execute(leader_safe_step(action, records))
            elif isinstance(action, ReadSafe):
                assert self.cluster is not None
                current, revision = self.cluster.read_safe()
                self._execute(leader_safe_read(action, current, revision))
            elif isinstance(action, WriteSafe):
                assert self.cluster is not None
                ok = self.cluster.write_safe(action.safe, action.expected_rev, self._ls.leadership)
                self._execute(leader_safe_written(action, ok))
            else:
                raise TypeError(f"no executor for action {action!r}")
