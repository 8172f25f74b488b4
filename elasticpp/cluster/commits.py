"""The durable side of a job in etcd: per-node commit records (the newest committed step
and the anchors held, own and replicas), the published safe step, and housekeeping that
keeps the number of keys bounded however long the job runs.

Invariants: the safe step is written only fenced by the leader's term and the revision it
read, and only when it rises (the caller's rule); a record that cannot be read (malformed,
a newer format, filed under another node) is skipped and logged once, never fatal.
Housekeeping keeps the newest generation's commit records as the job's "ever committed"
mark. `ClusterClient` holds one (`client.commits`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from elasticpp.cluster.barriers import timeline_member
from elasticpp.cluster.errors import ClusterDataError
from elasticpp.cluster.etcd.kv import Compare, Delete, Put
from elasticpp.cluster.leases import Leadership
from elasticpp.cluster.reads import JobReads
from elasticpp.cluster.records import CommitRecord, SafeStep, dumps, loads

HISTORY_KEPT = 100  # generations of history and recovery timelines kept in etcd
HOUSEKEEP_OPS = 100  # operations in one housekeeping transaction (etcd allows 128)


class Commits:
    """The job's commit records, the safe step, housekeeping and recovery timelines in
    etcd: one of the objects a `ClusterClient` holds (`client.commits`), reading and writing
    through its `JobReads`."""

    def __init__(self, reads: JobReads) -> None:
        self._reads = reads
        self._kv = reads.kv
        self.keys = reads.keys

    # ------------------------------------------------------------------ commits
    def record_commit(
        self,
        generation: int,
        node_id: str,
        step: int,
        anchors: Sequence[int] = (),
        replicas: Mapping[str, Sequence[int]] | None = None,
        *,
        lease_id: int | None = None,
    ) -> None:
        """Record `step` as this node's newest committed step in `generation` (-1: none), and
        the anchor steps of `generation` it holds: its own and, per origin, its replicas.
        With `lease_id` (the node's registration lease) etcd writes it only while the node's
        member key is on that lease, else `MembershipLapsedError` (see `arrive`)."""
        record = CommitRecord(
            node_id,
            generation,
            step,
            tuple(sorted(anchors, reverse=True)),
            {o: tuple(sorted(s, reverse=True)) for o, s in (replicas or {}).items()},
        )
        self._reads.put_as_node(
            node_id,
            lease_id,
            Put(
                self.keys.commit(generation, node_id),
                dumps({**record.to_dict(), "at": time.time()}),
            ),
        )

    def commit_records(self, generation: int, *, cached: bool = False) -> dict[str, CommitRecord]:
        """The readable commit records of `generation` by node id; unreadable ones (malformed,
        a newer format, or naming another node or generation) are skipped and logged once."""
        kvs, _ = self._reads.get_prefix(self.keys.commits_of(generation), cached)
        out: dict[str, CommitRecord] = {}
        for node, data in self._reads.records(kvs, "commit record").items():
            key = self.keys.commit(generation, node)
            try:
                record = CommitRecord.from_dict(data)
                if (record.node_id, record.generation) != (node, generation):
                    raise ClusterDataError(
                        f"commit record under {node}/{generation} names "
                        f"{record.node_id}/{record.generation}"
                    )
            except ClusterDataError as exc:
                self._reads.skip(key, exc)
                continue
            out[node] = record
        return out

    def committed_steps(self, generation: int) -> dict[str, int]:
        kvs, _ = self._kv.get_prefix(self.keys.commits_of(generation))
        out: dict[str, int] = {}
        for node, record in self._reads.records(kvs, "commit record").items():
            try:
                out[node] = int(record["step"])
            except (KeyError, TypeError, ValueError) as exc:
                self._reads.skip(self.keys.commit(generation, node), exc)
        return out

    # ------------------------------------------------------------------ safe step
    def read_safe(self, *, cached: bool = False) -> tuple[SafeStep | None, int]:
        """The published safe step (None if none, or unreadable: skipped and logged once) and
        the key's mod revision (0 if absent), for `write_safe` (read etcd itself for that:
        the cached one may be a watch delivery old)."""
        kv = self._reads.get(self.keys.safe, cached)
        if kv is None:
            return None, 0
        try:
            return SafeStep.from_dict(loads(kv.value, "safe step")), kv.mod_revision
        except ClusterDataError as exc:
            self._reads.skip(self.keys.safe, exc)
            return None, kv.mod_revision

    def write_safe(self, safe: SafeStep, expected_mod_revision: int, leader: Leadership) -> bool:
        """Publish `safe`, fenced by `leader`'s term and by the revision read. The caller
        writes only a rise; False if the key changed since it was read or the term is over."""
        compares = [
            Compare(self.keys.safe, "mod", expected_mod_revision),
            Compare(self.keys.leader, "value", leader.node_id),
            Compare(self.keys.leader, "create", leader.create_revision),
        ]
        value = dumps({"generation": safe.generation, "step": safe.step, "at": time.time()})
        ok, _, _ = self._kv.txn(compares, [Put(self.keys.safe, value)])
        return ok

    def ever_committed(self) -> bool:
        """Whether any node recorded a commit in any generation still on record
        (`housekeep` keeps the newest generation that has commits)."""
        kvs, _ = self._kv.get_prefix(self.keys.commits_prefix)
        return bool(kvs)

    def _commits_below(self) -> list[int]:
        """The generations that have commit records, but the newest of them (whose records
        stay as the job's "ever committed" mark)."""
        kvs, _ = self._kv.get_prefix(self.keys.commits_prefix)
        held = sorted({_gen_of(kv.key) for kv in kvs} - {-1})
        return held[:-1]

    # ------------------------------------------------------------------ housekeeping
    def _term(self, leader: Leadership) -> list[Compare]:
        """The compares that hold while `leader`'s term does (value and create revision)."""
        return [
            Compare(self.keys.leader, "value", leader.node_id),
            Compare(self.keys.leader, "create", leader.create_revision),
        ]

    def housekeep(
        self,
        generation: int,
        *,
        keep_history: int = HISTORY_KEPT,
        leader: Leadership | None = None,
    ) -> int:
        """Remove what a running `generation` no longer needs, so that etcd holds a bounded
        number of keys however long the job runs: the barriers of generations before the
        previous one, generation history and recovery timelines older than `keep_history`
        generations, and the commit records of all but the newest generation that has any
        (it keeps the job's "ever committed" mark). Idempotent; a watermark record makes
        each call cost only the generations since the last one. Returns keys deleted.

        The deletes and the watermark go in as few transactions as etcd allows, each a
        revision: a node watching these keys is sent one message, not one per key. With
        `leader`, each is fenced by its term (a deposed leader deletes nothing and moves no
        mark)."""
        kv = self._kv.get(self.keys.housekeeping)
        marks = {"barriers_below": 1, "history_below": 1}
        stored_marks = None
        if kv is not None:
            try:
                stored = loads(kv.value, "housekeeping")
                marks = {k: max(1, int(stored.get(k, 1))) for k in marks}
                stored_marks = dict(marks)
            except (ClusterDataError, TypeError, ValueError) as exc:
                self._reads.skip(self.keys.housekeeping, exc)
        ops: list[Put | Delete] = []
        barriers_upto = generation - 1  # the current and the previous generation stay
        for g in range(marks["barriers_below"], barriers_upto):
            for name in ("stopped", "resume", "started", "stepped", "failed"):
                ops.append(Delete(self.keys.barrier_prefix(f"{name}-{g}"), prefix=True))
        history_upto = generation - keep_history
        for g in range(marks["history_below"], history_upto):
            ops.append(Delete(self.keys.generation_history(g)))
            ops.append(Delete(self.keys.barrier("timelines", timeline_member(g))))
        ops += [Delete(self.keys.commits_of(g), prefix=True) for g in self._commits_below()]
        marks = {
            "barriers_below": max(marks["barriers_below"], barriers_upto),
            "history_below": max(marks["history_below"], history_upto),
        }
        # In transactions of at most HOUSEKEEP_OPS operations (etcd refuses more than its
        # --max-txn-ops, 128 by default), the mark with the last: each one revision, so a
        # watcher of these keys (every node watches the resume instructions and timelines)
        # gets one message for all of them, not one per key.
        if not ops and marks == stored_marks:
            return 0  # nothing to delete, the mark as it is: no write (and no watch event)
        ops.append(Put(self.keys.housekeeping, dumps(marks)))
        term = self._term(leader) if leader is not None else []
        deleted = 0
        for i in range(0, len(ops), HOUSEKEEP_OPS):
            done = self._kv.txn_deleting(term, ops[i : i + HOUSEKEEP_OPS])
            if done is None:
                return deleted  # the term is over: nothing more, and the mark stays
            deleted += done
        return deleted

    def compact_history(self, leader: Leadership) -> int | None:
        """Drop etcd's history (every revision of every key: commit records, barriers, the
        values housekeeping deleted) up to the revision this call read the last time, and
        note the revision now for the next. Called every few minutes by the leader, so
        history is kept for one period: a watch that lags more is told to resync (it
        re-reads). Fenced by `leader`'s term. Returns the revision compacted to, if any."""
        ok, _, revision = self._kv.txn(self._term(leader), [])
        if not ok:
            return None
        previous = 0
        kv = self._kv.get(self.keys.compaction)
        if kv is not None:
            try:
                previous = int(loads(kv.value, "compaction")["next"])
            except (ClusterDataError, KeyError, TypeError, ValueError) as exc:
                self._reads.skip(self.keys.compaction, exc)
        compacted = None
        if 0 < previous < revision and self._kv.compact(previous):
            compacted = previous
        self._kv.txn(self._term(leader), [Put(self.keys.compaction, dumps({"next": revision}))])
        return compacted

    def record_timeline(self, generation: int, timeline: Any, leader: Leadership) -> bool:
        """Publish the recovery timeline of `generation`, fenced by `leader`'s term."""
        key = self.keys.barrier("timelines", timeline_member(generation))
        value = dumps(
            {"node_id": timeline_member(generation), "value": timeline, "at": time.time()}
        )
        ok, _, _ = self._kv.txn(self._term(leader), [Put(key, value)])
        return ok


def _gen_of(commit_key: str) -> int:
    try:
        return int(commit_key.rsplit("/", 2)[-2])
    except ValueError:
        return -1
