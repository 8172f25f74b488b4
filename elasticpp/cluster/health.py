"""The job's health in etcd: quarantined nodes and the end of the job.

- `quarantine/<node_id>`: a node the leader set aside (`QuarantineRecord`): why, since and
  until when (wall-clock seconds), the how-many-th time, the agent incarnation. Written only
  fenced by the leader's term; deleted by the leader when it re-admits the node, or by an
  operator (`lift_quarantine`, from any agent's control service).
- `ended`: the job ended without finishing (`JobEnd`: `failed` when its failure budget was
  spent, `halted` when a step's loss or gradient norm was not finite, `stopped` when an
  operator stopped it), written once (create-if-absent): the first reason stays. Every
  agent, also one started later, reads it and ends; a new run of the job needs a new job
  name or `elasticpp job reset`.
- `stop`: an operator asked the job to stop (`StopRequest`, `elasticpp job stop`), written
  once; the agents stop at a step boundary, commit and persist it, and the leader ends the
  job as `stopped` (elasticpp.agent.stop). Reset removes it with the end.
- `cordon/<node_id>`: a node an operator set aside (`CordonRecord`, `elasticpp job
  cordon`): planned into no new generation, the job moves off it at a step boundary, its
  agent stays; `job uncordon` deletes it.

Every value is parsed into its typed record here: a value that cannot be read is skipped
(counted, logged once), never handed to the agent. `ClusterClient` holds one (`client.health`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from elasticpp.cluster import keys as keymod
from elasticpp.cluster.errors import ClusterDataError
from elasticpp.cluster.etcd.kv import Compare, Put
from elasticpp.cluster.leases import Leadership
from elasticpp.cluster.reads import JobReads
from elasticpp.cluster.records import (
    END_STATUSES,
    CheckpointRequest,
    CordonRecord,
    JobEnd,
    QuarantineRecord,
    StopRequest,
    dumps,
    loads,
)

R = TypeVar("R")
N = TypeVar("N", QuarantineRecord, CordonRecord)  # a per-node record

__all__ = ["END_STATUSES", "CordonRecord", "Health", "JobEnd", "QuarantineRecord", "StopRequest"]


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
        return self._per_node(
            self.keys.quarantine_prefix, "quarantine record", QuarantineRecord.from_dict, cached
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
        return self._read_once(self.keys.ended, "job end record", JobEnd.from_dict, cached)

    def reset_end(self) -> bool:
        """Delete the job's end record and any stop request (`elasticpp job reset`: a
        failed, halted or stopped job may run again); False if there was no end."""
        ended = self._kv.delete(self.keys.ended)
        self._kv.delete(self.keys.stop)
        return ended

    # ------------------------------------------------------------------ an operator's stop
    def stop_request(self, *, cached: bool = False) -> StopRequest | None:
        """The operator's request that the job stop, if one is on record."""
        return self._read_once(self.keys.stop, "job stop request", StopRequest.from_dict, cached)

    def request_stop(self, by: str, reason: str) -> StopRequest:
        """Ask the job to stop, once: a request already on record stays and is returned."""
        record = StopRequest(by=by, reason=reason, at=time.time())
        if self._put_once(self.keys.stop, record.to_dict()):
            return record
        current = self.stop_request()
        return current if current is not None else record

    # ------------------------------------------------------------------ checkpoint now
    def checkpoint_request(self, *, cached: bool = False) -> CheckpointRequest | None:
        """The operator's newest request for a checkpoint now, if one is on record."""
        return self._read_once(
            self.keys.checkpoint, "checkpoint request", CheckpointRequest.from_dict, cached
        )

    def request_checkpoint(self, by: str, reason: str) -> CheckpointRequest:
        """Ask for a checkpoint now: a new request, which replaces any before it."""
        record = CheckpointRequest(id=uuid.uuid4().hex[:12], by=by, reason=reason, at=time.time())
        self._kv.put(self.keys.checkpoint, dumps(record.to_dict()))
        return record

    def choose_checkpoint_step(self, request: CheckpointRequest, step: int) -> bool:
        """Name the step `request` persists; False if another request replaced it."""
        key = self.keys.checkpoint
        chosen = CheckpointRequest(request.id, request.by, request.reason, request.at, step)
        ok, _, _ = self._kv.txn(
            [Compare(key, "value", dumps(request.to_dict()))], [Put(key, dumps(chosen.to_dict()))]
        )
        return ok

    # ------------------------------------------------------------------ cordons
    def cordoned(self, *, cached: bool = False) -> dict[str, CordonRecord]:
        """The nodes an operator cordoned; a value that cannot be read is skipped (counted)."""
        return self._per_node(
            self.keys.cordon_prefix, "cordon record", CordonRecord.from_dict, cached
        )

    def cordon(self, node_id: str, by: str, reason: str) -> tuple[bool, CordonRecord]:
        """Cordon `node_id`, once: (True, the new record), or (False, the one on record)."""
        record = CordonRecord(node_id=node_id, by=by, reason=reason, at=time.time())
        if self._put_once(self.keys.cordon(node_id), record.to_dict()):
            return True, record
        current = self.cordoned().get(node_id)
        return False, current if current is not None else record

    def uncordon(self, node_id: str) -> bool:
        """Delete the cordon of `node_id`; False if it was not cordoned."""
        return self._kv.delete(self.keys.cordon(node_id))

    # ------------------------------------------------------------------ write-once records
    def _read_once(
        self, key: str, what: str, parse: Callable[[Mapping[str, Any]], R], cached: bool
    ) -> R | None:
        """The record at `key`, parsed; None if absent or unreadable (skipped, counted)."""
        kv = self._reads.get(key, cached)
        if kv is None:
            return None
        try:
            return parse(loads(kv.value, what))
        except ClusterDataError as exc:
            self._reads.skip(kv.key, exc)
            return None

    def _per_node(
        self, prefix: str, what: str, parse: Callable[[Mapping[str, Any]], N], cached: bool
    ) -> dict[str, N]:
        """The records under `prefix`, one per node, by node id; one that cannot be read, or
        is filed under another node's id, is skipped (counted)."""
        kvs, _ = self._reads.get_prefix(prefix, cached)
        out: dict[str, N] = {}
        for kv in kvs:
            node = keymod.last_segment(kv.key)
            try:
                record = parse(loads(kv.value, what))
                if record.node_id != node:
                    raise ClusterDataError(f"{what} of {record.node_id!r} filed under {node!r}")
            except ClusterDataError as exc:
                self._reads.skip(kv.key, exc)
                continue
            out[node] = record
        return out

    def _put_once(self, key: str, value: dict[str, Any]) -> bool:
        """Create `key` with `value` if it is absent; False if a value was there first."""
        ok, _, _ = self._kv.txn([Compare(key, "create", 0)], [Put(key, dumps(value))])
        return ok

    def end_job(self, status: str, reason: str, by: str, step: int = -1) -> JobEnd:
        """End the job once: the first end written stays. Returns the end on record."""
        if status not in END_STATUSES:
            raise ClusterDataError(f"job end: status {status!r} is not one of {END_STATUSES}")
        record = JobEnd(status=status, reason=reason, by=by, at=time.time(), step=step)
        if self._put_once(self.keys.ended, record.to_dict()):
            return record
        current = self.job_end()
        return current if current is not None else record
