"""The agent's executor: it applies the actions the parts' pure steps return
(elasticpp.agent.actions), in order, and feeds the results of those whose outcome matters
back to the part that asked (a probe, a deposition). It is the only place that turns an
action into I/O; the parts' own state is written by the parts' functions it calls.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from pathlib import Path

from elasticpp.agent.actions import (
    Action,
    CheckNeverCommitted,
    CleanRendezvous,
    CompactHistory,
    CountRecovery,
    Housekeep,
    PublishMemberInfo,
    PublishResumeWait,
    PullHoldings,
    ReadCommitRecords,
    ReadSafe,
    RecordTimeline,
    Reread,
    ResolveResume,
    SetFloor,
    StepDown,
    StopWorkers,
    UpdateGauges,
    WriteGeneration,
    WriteResume,
    WriteSafe,
)
from elasticpp.agent.kernel.threads import run_in_thread
from elasticpp.agent.leaderstep import (
    leader_fresh_checked,
    leader_generation_written,
    leader_pull_started,
    leader_resume_resolved,
    leader_resume_wait_published,
    leader_resume_written,
    leader_safe_read,
    leader_safe_step,
    leader_safe_written,
    leader_timeline_recorded,
)
from elasticpp.errors import ElasticppError
from elasticpp.store.checkpoints import checkpoint_holdings

log = logging.getLogger("elasticpp.agent")


class ExecutorPart:
    """Methods of `Agent` (elasticpp.agent.node); the state they use is set up there."""

    def _execute(self, actions: Sequence[Action]) -> None:
        """Apply what a part's pure step asked for, in order (elasticpp.agent.actions)."""
        self.executor.run(actions)

    def _apply(self, action: Action) -> None:
        """The executor's handler of the actions whose parts register none yet."""
        if isinstance(action, PublishMemberInfo):
            # The registration keeps the new info: its keeper writes it when it re-puts
            # the key, if this write does not land (elasticpp.cluster.leases).
            if self._registration is not None:
                with contextlib.suppress(ElasticppError):
                    self._registration.update(self._member_info())
        elif isinstance(action, StepDown):
            self._step_down(action.why)
        elif isinstance(action, StopWorkers):
            for w in self.pool.workers():
                if w.proc.alive():
                    self.pool.kill_worker(w)  # never waits on a process that will not go
            self.pool.release_spares()
        elif isinstance(action, Reread):
            self.view.reread.raise_()
        elif isinstance(action, SetFloor):
            self.store.set_floor(action.step, action.generation)  # anchors below may go
        elif isinstance(action, UpdateGauges):
            self._update_gauges()
        # --- the leader's actions
        elif isinstance(action, WriteGeneration):
            ok = self.cluster.write_generation(
                action.record, action.expected_rev, self._ls.leadership
            )
            self._execute(leader_generation_written(self._ls, action, ok))
        elif isinstance(action, PullHoldings):
            future = run_in_thread("pull-holdings", self._pull_holdings, action)
            future.add_done_callback(lambda _: self._wake.set())
            self._execute(leader_pull_started(self._ls, action, future))
        elif isinstance(action, ResolveResume):
            disk = action.disk
            if action.persist_dir and Path(action.persist_dir).is_dir():
                disk = checkpoint_holdings(Path(action.persist_dir), self.store.job)
            self._execute(leader_resume_resolved(self._ls, action, disk))
        elif isinstance(action, CheckNeverCommitted):
            ever = self.cluster.ever_committed()
            self._execute(leader_fresh_checked(self._ls, action, ever))
        elif isinstance(action, WriteResume):
            ok = self.cluster.write_resume(
                action.generation, dict(action.value), self._ls.leadership
            )
            self.view.reread.raise_()
            self._execute(leader_resume_written(self._ls, action, ok))
        elif isinstance(action, PublishResumeWait):
            ok = self.cluster.write_resume_wait(action.generation, action.why, self._ls.leadership)
            self.view.reread.raise_()
            self._execute(leader_resume_wait_published(self._ls, action, ok))
        elif isinstance(action, RecordTimeline):
            ok = self.cluster.record_timeline(
                action.generation, dict(action.timeline), self._ls.leadership
            )
            self._execute(leader_timeline_recorded(self._ls, action, ok))
        elif isinstance(action, Housekeep):
            removed = self.cluster.housekeep(action.generation, leader=self._ls.leadership)
            if removed:
                log.info("leader: removed %d etcd key(s) of older generations", removed)
        elif isinstance(action, CleanRendezvous):
            self._clean_rendezvous(action.generation)
        elif isinstance(action, CompactHistory):
            compacted = self.cluster.compact_history(self._ls.leadership)
            if compacted is not None:
                log.info("leader: etcd history compacted to revision %d", compacted)
        elif isinstance(action, CountRecovery):
            self.metrics.recoveries_total.labels(**self.metrics.labels).inc()
            self.metrics.recovery_seconds.labels(**self.metrics.labels).observe(action.seconds)
        elif isinstance(action, ReadCommitRecords):
            # From the cache (no read of every node's record twice a second): a record
            # a watch delivery old gives a safe step no newer than a fresh one would.
            self.cluster.cache_for_leader(True)
            records = self.cluster.commit_records(action.generation, cached=True)
            self._execute(leader_safe_step(action, records))
        elif isinstance(action, ReadSafe):
            # A cached value may be a delivery old: the write compares its revision.
            current, revision = self.cluster.read_safe(cached=True)
            self._execute(leader_safe_read(action, current, revision))
        elif isinstance(action, WriteSafe):
            ok = self.cluster.write_safe(action.safe, action.expected_rev, self._ls.leadership)
            self._execute(leader_safe_written(action, ok))
        else:
            raise TypeError(f"no executor for action {action!r}")
