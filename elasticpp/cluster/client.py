"""`ClusterClient`: a job's shared state in etcd — membership, election, generations, barriers.

Invariants this module keeps:
- Membership and leadership are keys under leases (`leases`: a lost registration is
  re-granted, a lost leadership is over).
- A generation is written only by compare-and-swap: the generation key's mod revision must be
  the one the leader read, the leader key must still hold this leader (value, and for a
  `Leadership` also its create revision, so a deposed-then-re-elected node cannot write with
  its old term), and the number must be exactly the previous one + 1.
- Watches survive etcd restarts without losing or repeating an event (`watch`).
- A read with `cached=True` is answered by the job's watch-fed cache (`cache.JobCache`,
  started by `follow`): no request to etcd, a state etcd held at a revision at most one
  watch delivery old, never one with a gap. Fenced writes read etcd itself.
- Every call that needs etcd raises `ClusterUnavailableError` within about
  `request_timeout_s` when etcd does not answer.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from elasticpp.cluster import keys as keymod
from elasticpp.cluster.arrivals import Arrivals
from elasticpp.cluster.barriers import (
    check_member,
)
from elasticpp.cluster.commits import Commits
from elasticpp.cluster.errors import (
    ClusterDataError,
    ClusterUnavailableError,
    GenerationConflictError,
    LeaseNotFoundError,
)
from elasticpp.cluster.etcd.kv import (
    Compare,
    Delete,
    EtcdKV,
    Put,
)
from elasticpp.cluster.etcd.meter import EtcdMeter
from elasticpp.cluster.etcd.security import EtcdSecurity
from elasticpp.cluster.health import Health
from elasticpp.cluster.leases import (
    Leadership,
    ProgressGate,
    Registration,
    check_ttl,
    fence_after_s,
)
from elasticpp.cluster.reads import JobReads
from elasticpp.cluster.records import (
    GenerationRecord,
    GenerationSummary,
    JobEpoch,
    Members,
    WatchEvent,
)
from elasticpp.cluster.requests import Requests
from elasticpp.cluster.watch import Watch

log = logging.getLogger(__name__)

_T = TypeVar("_T", "Registration", "Leadership", "Watch")


class ClusterClient:
    """One job's cluster state in etcd. Thread-safe; one instance per process is enough.

    The client itself keeps the spec, the epoch, membership, the election, generations,
    watches and the job's cache; the rest of the job's state is in the objects it holds,
    which share its connection and reads (`reads`): `arrivals` (barriers, the resume
    instruction, suspects), `commits` (commit records, the safe step, housekeeping) and
    `health` (quarantines, the end of the job).

    `request_timeout_s` bounds every etcd call; past it the call raises
    `ClusterUnavailableError`.
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        job: str,
        *,
        request_timeout_s: float = 2.0,
        meter: EtcdMeter | None = None,
        kv: EtcdKV | None = None,
        security: EtcdSecurity | None = None,
        prefix: str = keymod.ROOT,
    ) -> None:
        """`kv`: an etcd connection shared with other clients in this process (simulated
        nodes, bench/scale.py); this client then neither makes nor closes one, and
        `etcd_requests()` counts every sharer's requests. `security`: TLS and
        authentication for the connection this client makes; `prefix`: where the job's keys
        live (`<prefix>/<job>/`)."""
        self.job = job
        self.keys = keymod.JobKeys(job, prefix)
        self._shared_kv = kv is not None
        self._kv = kv or EtcdKV(
            list(endpoints), request_timeout_s=request_timeout_s, meter=meter, security=security
        )
        self._lock = threading.Lock()
        self._owned: list[Registration | Leadership | Watch] = []
        self.reads = JobReads(self._kv, self.keys)
        self.arrivals = Arrivals(self.reads)
        self.commits = Commits(self.reads)
        self.health = Health(self.reads)
        self.requests = Requests(self.reads)

    def _own(self, obj: _T) -> _T:
        with self._lock:
            self._owned.append(obj)
        return obj

    def close(self) -> None:
        """Stop every watch and keep-alive this client started, then close the connection.

        Registrations and leaderships are not revoked here (their keys lapse by TTL); call
        their `close()`/`resign()` first for a clean leave."""
        with self._lock:
            owned, self._owned = self._owned, []
        self.reads.close()
        for obj in owned:
            if isinstance(obj, Watch):
                obj.cancel()
            elif isinstance(obj, Registration):
                obj.close(revoke=False)
            else:
                obj._keeper.stop()
        if not self._shared_kv:
            self._kv.close()

    def __enter__(self) -> ClusterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def revision(self) -> int:
        return self._kv.revision(within=self.keys.root)

    # ------------------------------------------------------------------ spec
    def put_spec_if_absent(self, spec_json: str) -> str:
        """Store the job spec unless one is stored; returns the stored one (first writer's)."""
        ok, found, _ = self._kv.txn(
            [Compare(self.keys.spec, "create", 0)],
            [Put(self.keys.spec, spec_json)],
            [self.keys.spec],
        )
        if ok:
            log.info("job %s: spec stored", self.job)
            return spec_json
        stored = found[0]
        if stored is None:  # deleted between compare and read: cannot happen in one txn
            raise ClusterDataError(f"job {self.job}: spec vanished")
        return stored.value

    def delete_job(self) -> int:
        """Delete every key of the job (`elasticpp job delete`); the number deleted."""
        return int(self._kv.delete_prefix(self.keys.root))

    def spec(self) -> str | None:
        kv = self._kv.get(self.keys.spec)
        return kv.value if kv else None

    def epoch_if_absent(self, proposed: int, node_id: str) -> JobEpoch:
        """The job's epoch: `proposed` stored by `node_id` if the job's etcd state has none
        yet (create-if-absent: the first writer wins), else the one stored. A stored value
        that cannot be read raises `ClusterDataError`: guessing would break the ordering."""
        record = JobEpoch(proposed, node_id, time.time())
        ok, found, _ = self._kv.txn(
            [Compare(self.keys.epoch, "create", 0)],
            [Put(self.keys.epoch, record.to_json())],
            [self.keys.epoch],
        )
        if ok:
            log.info("job %s: epoch %d begins (created by %s)", self.job, proposed, node_id)
            return record
        stored = found[0]
        if stored is None:  # deleted between compare and read: cannot happen in one txn
            raise ClusterDataError(f"job {self.job}: epoch vanished")
        return JobEpoch.from_json(stored.value)

    def epoch(self) -> JobEpoch | None:
        """The job's epoch as stored, or None (etcd state started afresh, not joined yet)."""
        kv = self._kv.get(self.keys.epoch)
        return JobEpoch.from_json(kv.value) if kv else None

    # ------------------------------------------------------------------ membership
    def register(
        self,
        node_id: str,
        info: dict[str, Any],
        ttl_s: float = 5,
        gate: ProgressGate | None = None,
    ) -> Registration:
        """Put `nodes/<node_id>` under a new lease kept alive from a daemon thread (while
        `gate` says the caller's loop makes progress)."""
        key = self.keys.node(node_id)
        return self._own(Registration(self._kv, key, node_id, info, check_ttl(ttl_s), gate=gate))

    @property
    def skipped_values(self) -> int:
        """Values of the job that could not be read (malformed, or a newer format): skipped,
        counted, logged once per key (`JobReads.skip`)."""
        return self.reads.skipped_values

    def skip_value(self, key: str, exc: Exception) -> None:
        """Count an unreadable value (and log it once per key)."""
        self.reads.skip(key, exc)

    def etcd_requests(self) -> dict[str, int]:
        """Requests this client sent to etcd, by method (`EtcdKV.requests`)."""
        return self._kv.requests()

    def follow(
        self, on_event: Callable[[WatchEvent], None] | None = None, own_node: str | None = None
    ) -> None:
        """Start the job's watch-fed cache (once; `JobReads.follow`) for reads with
        `cached=True`."""
        self.reads.follow(on_event, own_node)

    def cache_for_leader(self, on: bool) -> None:
        """Cache the `stopped-<G>` arrivals and the commit records too (the leader reads
        them), or no longer."""
        self.reads.cache_for_leader(on)

    def sync_cache(self) -> None:
        """Read again what the cache lost events of (nothing in steady state)."""
        self.reads.sync_cache()

    def members(self, *, cached: bool = False) -> Members:
        """Registered nodes. Cached, an unchanged answer is the object returned before
        (as every cached answer below), and a record parsed once is shared by every answer
        that holds it (`JobReads.records`): callers must not change what they are handed."""
        kvs, revision = self.reads.get_prefix(self.keys.nodes_prefix, cached)
        nodes = self.reads.memo("members", kvs, cached, lambda: self.reads.records(kvs, "member"))
        return Members(nodes, revision)

    def agent_members(self, *, cached: bool = False) -> Members:
        """Registered agents whose records a planner can use (`barriers.check_member`: an
        address to dial, a positive slot count); any other is skipped and counted."""
        members = self.members(cached=cached)

        def usable() -> dict[str, dict[str, Any]]:
            nodes: dict[str, dict[str, Any]] = {}
            for node, record in members.nodes.items():
                try:
                    key = self.keys.nodes_prefix + node
                    self.reads.checked_once(key, record, check_member, node, record)
                except ClusterDataError as exc:
                    self.reads.skip(self.keys.nodes_prefix + node, exc)
                    continue
                nodes[node] = record
            return nodes

        return Members(
            self.reads.memo("agent members", members.nodes, cached, usable), members.revision
        )

    def member_records(self, nodes: Iterable[str]) -> dict[str, dict[str, Any]]:
        """The usable member records (see `agent_members`) of `nodes`, by node; a node not
        registered, or with an unusable record, is left out. Each key comes from the cache
        where it is cached (this node's own, and every one on the leader), else from etcd
        by key: a follower reads the few members it needs, not the cluster's."""
        out: dict[str, dict[str, Any]] = {}
        for node in sorted(set(nodes)):
            key = self.keys.node(node)
            kv = self.reads.get(key, self.reads.covered(key))
            if kv is None:
                continue
            try:
                record = self.reads.parsed_once(kv, f"member {node}")
                check_member(node, record)
            except ClusterDataError as exc:
                self.reads.skip(key, exc)
                continue
            out[node] = record
        return out

    def watch_members(
        self, callback: Callable[[WatchEvent], None], start_revision: int | None = None
    ) -> Watch:
        return self.watch(
            self.keys.nodes_prefix, callback, prefix=True, start_revision=start_revision
        )

    # ------------------------------------------------------------------ election
    def campaign(
        self,
        node_id: str,
        ttl_s: float = 5,
        on_lost: Callable[[], None] | None = None,
        gate: ProgressGate | None = None,
    ) -> Leadership | None:
        """Become leader if nobody is: create `leader` under a new lease. None if taken
        (seen taken first by a read: no lease is granted for a campaign already lost).

        `on_lost` is called (from the client's lease thread) if the lease is lost later; the
        lease is renewed only while `gate` says the caller's loop makes progress."""
        keymod.check_name("node_id", node_id)
        ttl = check_ttl(ttl_s)
        fence_after_s(ttl, self._kv.request_timeout_s)  # refused before anything is granted
        if self._kv.get(self.keys.leader) is not None:
            return None  # taken: one read, not a lease granted and revoked around a lost try
        granted_at_s = time.monotonic()
        lease_id = self._kv.grant(ttl)
        try:
            ok, _, revision = self._kv.txn(
                [Compare(self.keys.leader, "create", 0)],
                [Put(self.keys.leader, node_id, lease_id)],
                [self.keys.leader],
            )
        except ClusterUnavailableError:
            self._revoke_quietly(lease_id)
            raise
        if not ok:
            self._revoke_quietly(lease_id)
            return None
        log.info("node %s elected leader (term revision %d)", node_id, revision)
        leadership = Leadership(
            self._kv,
            self.keys.leader,
            node_id,
            ttl,
            lease_id,
            revision,
            on_lost,
            granted_at_s=granted_at_s,
            gate=gate,
        )
        return self._own(leadership)

    def depose(self, node_id: str) -> bool:
        """Remove the leader key of `node_id`'s term, for a leader confirmed dead by probe,
        so that a new leader is elected now instead of when its lease lapses. Fenced: the
        key is deleted only if it still holds that term (value and create revision read
        here), so a leader elected meanwhile is never touched. True if deleted."""
        kv = self._kv.get(self.keys.leader)
        if kv is None or kv.value != node_id:
            return False
        ok, _, _ = self._kv.txn(
            [
                Compare(self.keys.leader, "value", node_id),
                Compare(self.keys.leader, "create", kv.create_revision),
            ],
            [Delete(self.keys.leader)],
        )
        if ok:
            log.info("leader %s deposed (confirmed dead)", node_id)
        return ok

    def _revoke_quietly(self, lease_id: int) -> None:
        # An unused lease lapses by itself; revoking only frees it sooner.
        with contextlib.suppress(ClusterUnavailableError, LeaseNotFoundError):
            self._kv.revoke(lease_id)

    def leader(self, *, cached: bool = False) -> str | None:
        kv = self.reads.get(self.keys.leader, cached)
        return kv.value if kv else None

    def leader_term(self, *, cached: bool = False) -> tuple[str | None, int]:
        """The leader and the create revision of its key: a new term (the same node
        elected again, after a restart, say) is a new revision. (None, 0) with no leader."""
        kv = self.reads.get(self.keys.leader, cached)
        return (kv.value, kv.create_revision) if kv else (None, 0)

    def watch_suspects(
        self, callback: Callable[[WatchEvent], None], start_revision: int | None = None
    ) -> Watch:
        return self.watch(
            self.keys.suspects_prefix, callback, prefix=True, start_revision=start_revision
        )

    def watch_leader(
        self, callback: Callable[[WatchEvent], None], start_revision: int | None = None
    ) -> Watch:
        return self.watch(self.keys.leader, callback, start_revision=start_revision)

    # ------------------------------------------------------------------ generations
    def read_generation(self, *, cached: bool = False) -> tuple[GenerationRecord | None, int]:
        """The current generation record and its mod revision (0 if none yet)."""
        kv = self.reads.get(self.keys.generation, cached)
        if kv is None:
            return None, 0
        # The cache holds one KeyValue per change of the key: parsed once per change (and
        # once per process: the same text is one record for every agent of a process).
        record = self.reads.memo(
            "generation", kv, cached, lambda: GenerationRecord.shared(kv.value)
        )
        return record, kv.mod_revision

    def write_generation(
        self,
        record: GenerationRecord,
        expected_mod_revision: int,
        leader: Leadership | str,
    ) -> bool:
        """Compare-and-swap the next generation. False if the generation changed since it was
        read or `leader` no longer holds the leader key; raises GenerationConflictError if the
        record is not previous + 1 or names another leader."""
        leader_id = leader.node_id if isinstance(leader, Leadership) else leader
        if record.leader != leader_id:
            raise GenerationConflictError(
                f"generation {record.generation}: record names leader {record.leader!r}, "
                f"written by {leader_id!r}"
            )
        current = self._kv.get(self.keys.generation)
        current_rev = current.mod_revision if current else 0
        if current_rev != expected_mod_revision:
            log.info(
                "generation %d not written: generation key changed (revision %d, expected %d)",
                record.generation,
                current_rev,
                expected_mod_revision,
            )
            return False
        previous = GenerationRecord.from_json(current.value).generation if current else 0
        if record.generation != previous + 1:
            raise GenerationConflictError(
                f"generation {record.generation}: must be exactly {previous + 1} "
                f"(the stored generation is {previous})"
            )
        compares = [
            Compare(self.keys.generation, "mod", expected_mod_revision),
            Compare(self.keys.leader, "value", leader_id),
        ]
        if isinstance(leader, Leadership):
            compares.append(Compare(self.keys.leader, "create", leader.create_revision))
        ok, _, revision = self._kv.txn(
            compares,
            [
                Put(self.keys.generation, record.to_json()),
                # A summary, not a second copy: the transaction stays under etcd's limit.
                Put(
                    self.keys.generation_history(record.generation),
                    GenerationSummary.of(record).to_json(),
                ),
            ],
        )
        if ok:
            log.info(
                "generation %d written by leader %s at revision %d",
                record.generation,
                leader_id,
                revision,
            )
        else:
            log.info(
                "generation %d not written: lost the race or no longer leader (%s)",
                record.generation,
                leader_id,
            )
        return ok

    def generation_history(self) -> list[GenerationSummary]:
        """The kept generations, oldest first, as summaries (older full copies included)."""
        kvs, _ = self._kv.get_prefix(self.keys.generations_prefix)
        out = []
        for kv in kvs:
            try:
                out.append(GenerationSummary.from_json(kv.value))
            except ClusterDataError as exc:
                self.skip_value(kv.key, exc)  # counted, logged once; never misread
        return out

    def watch_generation(
        self, callback: Callable[[WatchEvent], None], start_revision: int | None = None
    ) -> Watch:
        return self.watch(self.keys.generation, callback, start_revision=start_revision)

    # ------------------------------------------------------------------ watches
    def watch(
        self,
        key: str,
        callback: Callable[[WatchEvent], None],
        *,
        prefix: bool = False,
        start_revision: int | None = None,
    ) -> Watch:
        """Watch a full key (or every key under it with `prefix`) from `start_revision`
        (default: changes after now). Survives etcd restarts; `cancel()` to stop."""
        return self._own(
            Watch(self._kv, key, callback, prefix=prefix, start_revision=start_revision)
        )
