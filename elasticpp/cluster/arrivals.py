"""Barriers and suspicion in etcd, for `ClusterClient` (elasticpp.cluster.client): a node's
arrival at a barrier (fenced by its member lease), the leader's resume instruction (written
once per generation, fenced by its term, split into parts when large), who arrived at a
barrier (each value checked against its barrier's shape, `barriers`), waiting for a barrier,
and suspect reports.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from typing import Any

from elasticpp.cluster import keys as keymod
from elasticpp.cluster.barriers import (
    RESUME_MEMBER,
    RESUME_WAIT_MEMBER,
    check_arrival,
    join_resume,
    resume_barrier,
    resume_part_member,
    split_resume,
)
from elasticpp.cluster.errors import (
    BarrierTimeoutError,
    ClusterDataError,
)
from elasticpp.cluster.etcd.kv import Compare, Put
from elasticpp.cluster.leases import Leadership
from elasticpp.cluster.reads import JobReads
from elasticpp.cluster.records import EventType, WatchEvent, dumps, loads
from elasticpp.cluster.watch import Watch

log = logging.getLogger("elasticpp.cluster.client")

# The one member of barrier `resume-<G>`: the instruction of whichever leader wrote it.


def resume_records(value: Any, leader_id: str, at: float) -> list[tuple[str, str]]:
    """The barrier members and records that hold resume instruction `value`: the instruction
    and, when its pieces table is large, the parts holding it (`barriers.split_resume`)."""
    main, parts = split_resume(value)
    out = [(RESUME_MEMBER, dumps({"node_id": leader_id, "value": main, "at": at}))]
    for part in parts:
        record = dumps({"node_id": leader_id, "value": part, "at": at})
        out.append((resume_part_member(int(part["part"])), record))
    return out


class Arrivals:
    """The job's barriers, the resume instruction and suspect reports in etcd: one of the objects a
    `ClusterClient` holds (`client.arrivals`), reading and writing through its `JobReads`."""

    def __init__(self, reads: JobReads) -> None:
        self._reads = reads
        self._kv = reads.kv
        self.keys = reads.keys

    # ------------------------------------------------------------------ barriers
    def arrive(
        self, barrier: str, node_id: str, value: Any = None, *, lease_id: int | None = None
    ) -> None:
        """Put `node_id`'s arrival at `barrier`. With `lease_id` (the node's registration
        lease) etcd writes it only while the node's member key is on that lease, else
        `MembershipLapsedError`: a node whose lease lapsed arrives nowhere, however late its
        write reaches etcd (a check before the put would race with the lapse)."""
        self._reads.put_as_node(
            node_id,
            lease_id,
            Put(
                self.keys.barrier(barrier, node_id),
                dumps({"node_id": node_id, "value": value, "at": time.time()}),
            ),
        )

    def write_resume(self, generation: int, value: Any, leader: Leadership) -> bool:
        """Publish generation `generation`'s resume instruction (barrier `resume-<G>`, member
        `RESUME_MEMBER`) once, fenced by `leader`'s term.

        Whichever leader writes first wins; a later one (elected mid-transition) reads it
        instead of writing its own, so followers never wait on a record that names a
        leader they do not expect. False if one exists already or `leader` lost its term."""
        key = self.keys.barrier(resume_barrier(generation), RESUME_MEMBER)
        compares = [
            Compare(key, "create", 0),
            Compare(self.keys.leader, "value", leader.node_id),
            Compare(self.keys.leader, "create", leader.create_revision),
        ]
        puts = [
            Put(self.keys.barrier(resume_barrier(generation), member), record)
            for member, record in resume_records(value, leader.node_id, time.time())
        ]
        ok, _, _ = self._kv.txn(compares, puts)
        return ok

    def write_resume_wait(self, generation: int, why: str, leader: Leadership) -> bool:
        """Say that generation `generation` cannot resume yet, and why (barrier `resume-<G>`,
        member `RESUME_WAIT_MEMBER`), fenced by `leader`'s term and written only while no
        instruction is: its followers then wait for state instead of failing the generation.
        A later wait of the same generation replaces it. False if an instruction exists or
        `leader` lost its term."""
        at = time.time()
        record = dumps({"node_id": leader.node_id, "value": {"why": why, "at": at}, "at": at})
        ok, _, _ = self._kv.txn(
            [
                Compare(self.keys.barrier(resume_barrier(generation), RESUME_MEMBER), "create", 0),
                Compare(self.keys.leader, "value", leader.node_id),
                Compare(self.keys.leader, "create", leader.create_revision),
            ],
            [Put(self.keys.barrier(resume_barrier(generation), RESUME_WAIT_MEMBER), record)],
        )
        return ok

    def barrier_state(self, barrier: str, *, cached: bool = False) -> tuple[dict[str, Any], int]:
        """Who arrived (node id -> value) and the revision read. A value without the shape
        its barrier needs (`barriers.check_arrival`) is skipped and counted, like an
        unreadable one: the caller never sees it."""
        prefix = self.keys.barrier_prefix(barrier)
        kvs, revision = self._reads.get_prefix(prefix, cached)
        return self._reads.memo(prefix, kvs, cached, lambda: self._arrivals(barrier, kvs)), revision

    def _arrivals(self, barrier: str, kvs: list[Any]) -> dict[str, Any]:
        prefix = self.keys.barrier_prefix(barrier)
        out = self._reads.values_once(
            kvs, f"{barrier} arrival", lambda node, r: check_arrival(barrier, node, r.get("value"))
        )
        if barrier.startswith("resume-"):
            try:
                out = join_resume(out, RESUME_MEMBER)
            except ClusterDataError as exc:
                self._reads.skip(prefix + RESUME_MEMBER, exc)
                # Without its parts the instruction cannot be used: neither is seen.
                out = {m: v for m, v in out.items() if m != RESUME_MEMBER and "-part-" not in m}
        return out

    def wait_barrier(
        self, barrier: str, expected_nodes: Iterable[str], timeout_s: float
    ) -> dict[str, Any]:
        """Block until every expected node arrived; returns node id -> value.

        Raises BarrierTimeoutError (naming the missing nodes) at the deadline; keeps waiting
        through an etcd restart (the watch resumes), but the first read needs etcd."""
        expected = set(expected_nodes)
        deadline = time.monotonic() + timeout_s
        arrived, revision = self.barrier_state(barrier)
        cond = threading.Condition()
        prefix = self.keys.barrier_prefix(barrier)

        def on_event(event: WatchEvent) -> None:
            node_id = keymod.last_segment(event.key)
            with cond:
                if event.type is EventType.PUT and event.value is not None:
                    try:
                        arrived[node_id] = loads(event.value, "barrier arrival").get("value")
                    except ClusterDataError as exc:
                        self._reads.skip(event.key, exc)
                elif event.type is EventType.DELETE:
                    arrived.pop(node_id, None)
                cond.notify_all()

        if expected <= arrived.keys():
            return {n: arrived[n] for n in expected}
        watch = Watch(self._kv, prefix, on_event, prefix=True, start_revision=revision + 1)
        try:
            with cond:
                while not expected <= arrived.keys():
                    left_s = deadline - time.monotonic()
                    if left_s <= 0:
                        raise BarrierTimeoutError(barrier, sorted(expected - arrived.keys()))
                    cond.wait(left_s)
                return {n: arrived[n] for n in expected}
        finally:
            watch.cancel()

    def clear_barrier(self, barrier: str) -> int:
        return self._kv.delete_prefix(self.keys.barrier_prefix(barrier))

    # ------------------------------------------------------------------ suspicion
    def report_suspect(self, node_id: str, by: str, reason: str) -> None:
        self._kv.put(
            self.keys.suspect(node_id),
            dumps({"node_id": node_id, "by": by, "reason": reason, "at": time.time()}),
        )
        log.info("node %s suspected by %s: %s", node_id, by, reason)

    def suspects(self) -> dict[str, dict[str, Any]]:
        kvs, _ = self._kv.get_prefix(self.keys.suspects_prefix)
        return self._reads.records(kvs, "suspect")

    def clear_suspect(self, node_id: str) -> bool:
        return self._kv.delete(self.keys.suspect(node_id))
