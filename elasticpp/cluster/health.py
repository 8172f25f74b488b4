"""The job's health in etcd: quarantined nodes and the end of the job.

- `quarantine/<node_id>`: a node the leader set aside (`QuarantineRecord`): why, since and
  until when (wall-clock seconds), the how-many-th time, the agent incarnation. Written only
  fenced by the leader's term; deleted by the leader when it re-admits the node, or by an
  operator (`lift_quarantine`, from any agent's control service).
- `ended`: the job ended without finishing (`JobEnd`: `failed` when its failure budget was
  spent, `halted` when a step's loss or gradient norm was not finite, `stopped` when an
  operator stopped it), written once (create-if-absent): the first reason stays. Every
  agent, also one started later, reads it and ends; a new run of the job needs a new job
  name or `elasticpp job reset`, which also removes an operator's stop request.

Every value is parsed into its typed record here: a value that cannot be read is skipped
(counted, logged once), never handed to the agent. `ClusterClient` holds one
(`client.health`); an operator's requests (stop, checkpoint now, cordons) are
`elasticpp.cluster.requests`'.
"""

from __future__ import annotations

import time

from elasticpp.cluster.errors import ClusterDataError
from elasticpp.cluster.etcd.kv import Compare, Put
from elasticpp.cluster.leases import Leadership
from elasticpp.cluster.reads import JobReads
from elasticpp.cluster.records import END_STATUSES, JobEnd, QuarantineRecord, dumps
from elasticpp.cluster.typedreads import put_if_absent, read_per_node, read_record

__all__ = ["END_STATUSES", "Health", "JobEnd", "QuarantineRecord"]


class Health:
    """The job's quarantines and the end of the job in etcd: one of the objects a
    `ClusterClient` holds (`client.health`), reading and writing through its `JobReads`."""

    def __init__(self, reads: JobReads) -> None:
        self._reads = reads
        self._kv = reads.kv
        self.keys = reads.keys

    # ------------------------------------------------------------------ quarantine
    def quarantined(self, *, cached: bool = False) -> dict[str, QuarantineRecord]:
        """The quarantined nodes; a value that cannot be read is skipped (counted). With
        `cached`, from the job's watch-fed cache (`follow`): no request to etcd."""
        return read_per_node(
            self._reads,
            self.keys.quarantine_prefix,
            "quarantine record",
            QuarantineRecord.from_dict,
            cached,
        )

    def quarantine(self, record: QuarantineRecord, leader: Leadership) -> bool:
        """Publish a quarantine, fenced by `leader`'s term; False if the term is over."""
        compares = [
            Compare(self.keys.leader, "value", leader.node_id),
            Compare(self.keys.leader, "create", leader.create_revision),
        ]
        put = Put(self.keys.quarantine(record.node_id), dumps(record.to_dict()))
        ok, _, _ = self._kv.txn(compares, [put])
        return ok

    def lift_quarantine(self, node_id: str) -> bool:
        """Remove the quarantine of `node_id` (the leader re-admitting it, or an operator).
        False if it was not quarantined."""
        return self._kv.delete(self.keys.quarantine(node_id))

    # ------------------------------------------------------------------ the job's end
    def job_end(self, *, cached: bool = False) -> JobEnd | None:
        """The job's end on record, if any (`cached`: from the job's cache)."""
        return read_record(self._reads, self.keys.ended, "job end record", JobEnd.from_dict, cached)

    def reset_end(self) -> bool:
        """Delete the job's end record and any stop request (`elasticpp job reset`: a
        failed, halted or stopped job may run again); False if there was no end."""
        ended = self._kv.delete(self.keys.ended)
        self._kv.delete(self.keys.stop)
        return ended

    def end_job(self, status: str, reason: str, by: str, step: int = -1) -> JobEnd:
        """End the job once: the first end written stays. Returns the end on record."""
        if status not in END_STATUSES:
            raise ClusterDataError(f"job end: status {status!r} is not one of {END_STATUSES}")
        record = JobEnd(status=status, reason=reason, by=by, at=time.time(), step=step)
        if put_if_absent(self._kv, self.keys.ended, record.to_dict()):
            return record
        current = self.job_end()
        return current if current is not None else record
