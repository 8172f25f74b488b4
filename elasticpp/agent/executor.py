"""The leader's actions, applied: the one part that is not yet an object registers no
handlers of its own, so the agent's executor (elasticpp.agent.kernel.executor) falls back to
`ExecutorPart._apply` for them. It writes the leader's records by compare-and-swap under its
term, starts the holdings pull, resolves and publishes the resume instruction and the safe
step, and feeds each outcome back to the leader's step functions. Every other action has a
handler registered by the part that carries it out (or by the agent, for what it owns:
its registration, the term, the workers as a whole, the gauges).
"""

from __future__ import annotations

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


class ExecutorPart:
    """Methods of `Agent` (elasticpp.agent.node); the state they use is set up there."""

    def _execute(self, actions: Sequence[Action]) -> None:
        """Apply what a part's pure step asked for, in order (elasticpp.agent.actions)."""
        self.executor.run(actions)

    def _apply(self, action: Action) -> None:
        """The executor's handler of the leader's actions (the one part not yet an object
        that registers its own)."""
        if isinstance(action, WriteGeneration):
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
