"""The job's health in etcd: quarantined nodes and the end of the job.

- `quarantine/<node_id>`: a node the leader set aside (`QuarantineRecord`): why, since and
  until when (wall-clock seconds), the how-many-th time, the agent incarnation. Written only
  fenced by the leader's term; deleted by the leader when it re-admits the node, or by an
  operator (`lift_quarantine`, from any agent's control service).
- `ended`: the job ended without finishing (`JobEnd`: `failed` when its failure budget was
  spent, `halted` when a step's loss or gradient norm was not finite), written once
  (create-if-absent): the first reason stays. Every agent, also one started later, reads it
  and ends; a new run of the job needs a new job name or the key removed.

Every value is parsed into its typed record here: a value that cannot be read is skipped
(counted, logged once), never handed to the agent. `ClusterClient` holds one (`client.health`).
"""

from __future__ import annotations

import time

from elasticpp.cluster import keys as keymod
from elasticpp.cluster.errors import ClusterDataError
from elasticpp.cluster.etcd.kv import Compare, Put
from elasticpp.cluster.leases import Leadership
from elasticpp.cluster.reads import JobReads
from elasticpp.cluster.records import END_STATUSES, JobEnd, QuarantineRecord, dumps, loads

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
        kvs, _ = self._reads.get_prefix(self.keys.quarantine_prefix, cached)
        out: dict[str, QuarantineRecord] = {}
        for kv in kvs:
            node = keymod.last_segment(kv.key)
            try:
                record = QuarantineRecord.from_dict(loads(kv.value, "quarantine record"))
                if record.node_id != node:
                    raise ClusterDataError(
                        f"quarantine record of {record.node_id!r} filed under {node!r}"
                    )
            except ClusterDataError as exc:
                self._reads.skip(kv.key, exc)
                continue
            out[node] = record
        return out

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
        kv = self._reads.get(self.keys.ended, cached)
        if kv is None:
            return None
        try:
            return JobEnd.from_dict(loads(kv.value, "job end record"))
        except ClusterDataError as exc:
            self._reads.skip(kv.key, exc)
            return None

    def reset_end(self) -> bool:
        """Delete the job's end record (`elasticpp job reset`: a failed or halted job may run
        again); False if there was none."""
        return self._kv.delete(self.keys.ended)

    def end_job(self, status: str, reason: str, by: str, step: int = -1) -> JobEnd:
        """End the job once: the first end written stays. Returns the end on record."""
        if status not in END_STATUSES:
            raise ClusterDataError(f"job end: status {status!r} is not one of {END_STATUSES}")
        record = JobEnd(status=status, reason=reason, by=by, at=time.time(), step=step)
        key = self.keys.ended
        ok, _, _ = self._kv.txn([Compare(key, "create", 0)], [Put(key, dumps(record.to_dict()))])
        if ok:
            return record
        current = self.job_end()
        return current if current is not None else record
