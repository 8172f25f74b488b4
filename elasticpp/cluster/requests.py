"""An operator's requests of a job in etcd: stop it, checkpoint it now, cordon a node.

- `stop`: an operator asked the job to stop (`StopRequest`, `elasticpp job stop`), written
  once; the agents stop at a step boundary, commit and persist it, and the leader ends the
  job as `stopped` (elasticpp.agent.stop). `elasticpp job reset` removes it with the end.
- `checkpoint`: the newest request for a persistent checkpoint now (`CheckpointRequest`,
  `elasticpp job checkpoint`); the command names the step it persists by compare-and-swap
  (elasticpp.agent.checkpoint).
- `cordon/<node_id>`: a node an operator set aside (`CordonRecord`, `elasticpp job
  cordon`): planned into no new generation, the job moves off it at a step boundary, its
  agent stays; `job uncordon` deletes it.

Every value is parsed into its typed record here: a value that cannot be read is skipped
(counted, logged once), never handed to the agent. `ClusterClient` holds one
(`client.requests`); the job's quarantines and its end are `elasticpp.cluster.health`'s.
"""

from __future__ import annotations

import time
import uuid

from elasticpp.cluster.etcd.kv import Compare, Put
from elasticpp.cluster.reads import JobReads
from elasticpp.cluster.records import CheckpointRequest, CordonRecord, StopRequest, dumps
from elasticpp.cluster.typedreads import put_if_absent, read_per_node, read_record

__all__ = ["CheckpointRequest", "CordonRecord", "Requests", "StopRequest"]


class Requests:
    """The operator's requests of the job in etcd: one of the objects a `ClusterClient`
    holds (`client.requests`), reading and writing through its `JobReads`."""

    def __init__(self, reads: JobReads) -> None:
        self._reads = reads
        self._kv = reads.kv
        self.keys = reads.keys

    # ------------------------------------------------------------------ an operator's stop
    def stop_request(self, *, cached: bool = False) -> StopRequest | None:
        """The operator's request that the job stop, if one is on record."""
        return read_record(
            self._reads, self.keys.stop, "job stop request", StopRequest.from_dict, cached
        )

    def request_stop(self, by: str, reason: str) -> StopRequest:
        """Ask the job to stop, once: a request already on record stays and is returned."""
        record = StopRequest(by=by, reason=reason, at=time.time())
        if put_if_absent(self._kv, self.keys.stop, record.to_dict()):
            return record
        current = self.stop_request()
        return current if current is not None else record

    # ------------------------------------------------------------------ checkpoint now
    def checkpoint_request(self, *, cached: bool = False) -> CheckpointRequest | None:
        """The operator's newest request for a checkpoint now, if one is on record."""
        return read_record(
            self._reads,
            self.keys.checkpoint,
            "checkpoint request",
            CheckpointRequest.from_dict,
            cached,
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
        return read_per_node(
            self._reads, self.keys.cordon_prefix, "cordon record", CordonRecord.from_dict, cached
        )

    def cordon(self, node_id: str, by: str, reason: str) -> tuple[bool, CordonRecord]:
        """Cordon `node_id`, once: (True, the new record), or (False, the one on record,
        read by its key alone)."""
        record = CordonRecord(node_id=node_id, by=by, reason=reason, at=time.time())
        key = self.keys.cordon(node_id)
        if put_if_absent(self._kv, key, record.to_dict()):
            return True, record
        current = read_record(self._reads, key, "cordon record", CordonRecord.from_dict, False)
        return False, current if current is not None and current.node_id == node_id else record

    def uncordon(self, node_id: str) -> bool:
        """Delete the cordon of `node_id`; False if it was not cordoned."""
        return self._kv.delete(self.keys.cordon(node_id))
