"""The leader's actions, applied: one handler per action type, which the leader registers on
the agent's executor (elasticpp.agent.kernel.executor) like every other part. Each writes the
leader's records by compare-and-swap under its term (or reads what its step asked for),
starts the holdings pull, resolves where resume state comes from, and feeds the outcome back
to the leader's step functions (elasticpp.agent.leaderstep), whose actions the executor then
applies. Methods of `Agent` until the leader is an object of its own (its state still holds
the term and the rendezvous store)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from elasticpp.agent.actions import (
    Action,
    CheckNeverCommitted,
    CleanRendezvous,
    CompactHistory,
    CountRecovery,
    Housekeep,
    PublishResumeWait,
    PullHoldings,
    ReadCommitRecords,
    ReadSafe,
    RecordTimeline,
    ResolveResume,
    WriteGeneration,
    WriteResume,
    WriteSafe,
)
from elasticpp.agent.kernel.executor import Executor
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
from elasticpp.store.checkpoints import checkpoint_holdings

log = logging.getLogger("elasticpp.agent")

Self = Any  # the Agent these methods are bound to


class LeaderHandlers:
    """Methods of `Agent` (elasticpp.agent.node); the state they use is set up there."""

    def _register_leader(self: Self, executor: Executor) -> None:
        """The handlers of the actions only the leader's steps emit."""
        executor.register(WriteGeneration, self._write_generation)
        executor.register(PullHoldings, self._start_pull)
        executor.register(ResolveResume, self._resolve_resume)
        executor.register(CheckNeverCommitted, self._check_never_committed)
        executor.register(WriteResume, self._write_resume)
        executor.register(PublishResumeWait, self._publish_resume_wait)
        executor.register(RecordTimeline, self._record_timeline)
        executor.register(Housekeep, self._housekeep)
        executor.register(CleanRendezvous, lambda a: self._clean_rendezvous(a.generation))
        executor.register(CompactHistory, self._compact_history)
        executor.register(CountRecovery, self._count_recovery)
        executor.register(ReadCommitRecords, self._read_commit_records)
        executor.register(ReadSafe, self._read_safe)
        executor.register(WriteSafe, self._write_safe)

    def _write_generation(self: Self, action: WriteGeneration) -> list[Action]:
        ok = self.cluster.write_generation(action.record, action.expected_rev, self._ls.leadership)
        return leader_generation_written(self._ls, action, ok)

    def _start_pull(self: Self, action: PullHoldings) -> list[Action]:
        future = run_in_thread("pull-holdings", self._pull_holdings, action)
        future.add_done_callback(lambda _: self._wake.set())
        return leader_pull_started(self._ls, action, future)

    def _resolve_resume(self: Self, action: ResolveResume) -> list[Action]:
        disk = action.disk
        if action.persist_dir and Path(action.persist_dir).is_dir():
            disk = checkpoint_holdings(Path(action.persist_dir), self.store.job)
        return leader_resume_resolved(self._ls, action, disk)

    def _check_never_committed(self: Self, action: CheckNeverCommitted) -> list[Action]:
        return leader_fresh_checked(self._ls, action, self.cluster.ever_committed())

    def _write_resume(self: Self, action: WriteResume) -> list[Action]:
        ok = self.cluster.write_resume(action.generation, dict(action.value), self._ls.leadership)
        self.view.reread.raise_()
        return leader_resume_written(self._ls, action, ok)

    def _publish_resume_wait(self: Self, action: PublishResumeWait) -> list[Action]:
        ok = self.cluster.write_resume_wait(action.generation, action.why, self._ls.leadership)
        self.view.reread.raise_()
        return leader_resume_wait_published(self._ls, action, ok)

    def _record_timeline(self: Self, action: RecordTimeline) -> list[Action]:
        ok = self.cluster.record_timeline(
            action.generation, dict(action.timeline), self._ls.leadership
        )
        return leader_timeline_recorded(self._ls, action, ok)

    def _housekeep(self: Self, action: Housekeep) -> None:
        removed = self.cluster.housekeep(action.generation, leader=self._ls.leadership)
        if removed:
            log.info("leader: removed %d etcd key(s) of older generations", removed)

    def _compact_history(self: Self, action: CompactHistory) -> None:
        compacted = self.cluster.compact_history(self._ls.leadership)
        if compacted is not None:
            log.info("leader: etcd history compacted to revision %d", compacted)

    def _count_recovery(self: Self, action: CountRecovery) -> None:
        m = self.metrics
        m.recoveries_total.labels(**m.labels).inc()
        m.recovery_seconds.labels(**m.labels).observe(action.seconds)

    def _read_commit_records(self: Self, action: ReadCommitRecords) -> list[Action]:
        # From the cache (no read of every node's record twice a second): a record a watch
        # delivery old gives a safe step no newer than a fresh one would.
        self.cluster.cache_for_leader(True)
        records = self.cluster.commit_records(action.generation, cached=True)
        return leader_safe_step(action, records)

    def _read_safe(self: Self, action: ReadSafe) -> list[Action]:
        # A cached value may be a delivery old: the write compares its revision.
        current, revision = self.cluster.read_safe(cached=True)
        return leader_safe_read(action, current, revision)

    def _write_safe(self: Self, action: WriteSafe) -> list[Action]:
        ok = self.cluster.write_safe(action.safe, action.expected_rev, self._ls.leadership)
        return leader_safe_written(action, ok)
