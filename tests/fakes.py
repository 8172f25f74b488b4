"""Fakes shared by the unit tests, for the pure logic around the agent's ports (the real
things are tested against etcd and real processes in tests/integration)."""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from elasticpp.cluster.cache import cache_ranges
from elasticpp.cluster.client import ClusterClient
from elasticpp.cluster.errors import ClusterError, ClusterUnavailableError, LeaseNotFoundError
from elasticpp.cluster.etcd.ops import Compare, Delete, Put
from elasticpp.cluster.keys import JobKeys, prefix_end
from elasticpp.cluster.records import KeyValue


class Term:
    """A leader's term as the leader part holds it (cluster.leases.Leadership): held until
    resigned. Its `node_id` is what the fenced writes compare the leader key with."""

    create_revision = 1

    def __init__(self, node_id: str = "n0") -> None:
        self.node_id = node_id
        self.resigned = False

    def is_held(self) -> bool:
        return not self.resigned

    def resign(self) -> None:
        self.resigned = True


class FakeRegistration:
    """A node's registration (membership.shell.RegistrationPort) as a test sets it: the
    lease its member key is on, the conflict its keeper found, whether it may have lapsed;
    `unreachable`: etcd does not take an update now (the keeper re-puts it later). Its
    answers in each of these states are the real one's on etcd:
    tests/integration/test_registration_contract.py."""

    lease_id = 7

    def __init__(
        self, *, conflict: str | None = None, lapsed: bool = False, unreachable: bool = False
    ) -> None:
        self.conflict = conflict
        self.lapsed = lapsed
        self.unreachable = unreachable
        self.updates: list[dict[str, object]] = []  # the member records it was given
        self.revoked: bool | None = None  # closed: with its lease revoked or not

    def may_have_lapsed(self) -> bool:
        return self.lapsed or self.conflict is not None  # a taken key fences, as etcd's does

    def update(self, info: dict[str, object]) -> bool:
        self.updates.append(dict(info))
        if self.unreachable:
            raise ClusterUnavailableError("etcd timed out")
        return self.conflict is None  # never written over another agent's key

    def close(self, *, revoke: bool = True) -> None:
        self.revoked = revoke


class MemoryKV:
    """etcd's KV and lease calls as `EtcdKV` makes them (elasticpp.cluster.etcd.kv), in
    memory, with etcd's revisions: every write that changes something is one revision, a
    transaction's ops share one, keys are read sorted, a key's create revision is kept until
    it is deleted, a revoked lease takes its keys with it. No watches, no TTL expiry (a
    lease ends when revoked: `expire` stands in for a lapse). The cases of
    tests/integration/test_cluster_contract.py run against it and against a real etcd.

    `writes` is every key written or deleted, in order, with its value (None: deleted);
    while `down`, every call raises ClusterUnavailableError, as an etcd out of reach does."""

    request_timeout_s = 1.0
    down = False

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._keys: dict[str, KeyValue] = {}
        self._leases: dict[int, int] = {}  # id -> ttl
        self._next_lease = 0x1000
        self._revision = 1
        self._sent: Counter[str] = Counter()
        self.writes: list[tuple[str, str | None]] = []
        self.read: list[str] = []  # each key and prefix read, in order (a cache's reads too)

    # ------------------------------------------------------------------ reads
    def requests(self) -> dict[str, int]:
        with self._lock:
            return dict(self._sent)

    def close(self) -> None:
        pass

    def get(self, key: str) -> KeyValue | None:
        with self._lock:
            self._send("Range")
            self.read.append(key)
            return self._keys.get(key)

    def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        with self._lock:
            self._send("Range")
            self.read.append(prefix)
            kvs = [self._keys[k] for k in sorted(self._keys) if k.startswith(prefix)]
            return kvs, self._revision

    def revision(self, within: str = "\0") -> int:
        with self._lock:
            return self._revision

    def held(self, key: str, range_end: str) -> tuple[list[KeyValue], int]:
        """The keys in [key, range_end), sorted, and the revision: what a watch-fed cache of
        that range holds once every event reached it (`MemoryCache`; not a request)."""
        with self._lock:
            kvs = [self._keys[k] for k in sorted(self._keys) if key <= k < range_end]
            return kvs, self._revision

    # ------------------------------------------------------------------ writes
    def put(self, key: str, value: str, lease_id: int | None = None) -> int:
        with self._lock:
            self._send("Put")
            self._check_lease(lease_id)
            self._revision += 1
            self._put(key, value, lease_id)
            return self._revision

    def delete(self, key: str) -> bool:
        with self._lock:
            self._send("DeleteRange")
            if key not in self._keys:
                return False
            self._revision += 1
            self._delete([key])
            return True

    def delete_prefix(self, prefix: str) -> int:
        with self._lock:
            self._send("DeleteRange")
            keys = [k for k in self._keys if k.startswith(prefix)]
            if keys:
                self._revision += 1
                self._delete(keys)
            return len(keys)

    def compact(self, revision: int, *, physical: bool = False) -> bool:
        return True  # no history is kept

    def txn(
        self,
        compares: Sequence[Compare],
        success: Sequence[Put | Delete],
        failure_get: Sequence[str] = (),
    ) -> tuple[bool, list[KeyValue | None], int]:
        with self._lock:
            self._send("Txn")
            if not all(self._holds(c) for c in compares):
                return False, [self._keys.get(k) for k in failure_get], self._revision
            self._apply(success)
            return True, [], self._revision

    def txn_deleting(self, compares: Sequence[Compare], ops: Sequence[Put | Delete]) -> int | None:
        with self._lock:
            self._send("Txn")
            if not all(self._holds(c) for c in compares):
                return None
            return self._apply(ops)

    # ------------------------------------------------------------------ leases
    def grant(self, ttl_s: int) -> int:
        with self._lock:
            self._send("LeaseGrant")
            self._next_lease += 1
            self._leases[self._next_lease] = int(ttl_s)
            return self._next_lease

    def refresh(self, lease_id: int, on_late: Callable[[], None] | None = None) -> int:
        with self._lock:
            self._send("LeaseKeepAlive")
            if lease_id not in self._leases:
                raise LeaseNotFoundError(f"lease {lease_id:x} not found")
            return self._leases[lease_id]

    def refresh_many(
        self, leases: Sequence[tuple[int, Callable[[], None] | None]]
    ) -> list[int | ClusterError]:
        out: list[int | ClusterError] = []
        for lease_id, on_late in leases:
            try:
                out.append(self.refresh(lease_id, on_late))
            except LeaseNotFoundError as exc:
                out.append(exc)
        return out

    def revoke(self, lease_id: int) -> None:
        with self._lock:
            self._send("LeaseRevoke")
            self._check_lease(lease_id)
            self.expire(lease_id)

    def expire(self, lease_id: int) -> None:
        """The lease ends (its TTL ran out): its keys go, in one revision."""
        with self._lock:
            self._leases.pop(lease_id, None)
            keys = [k for k, kv in self._keys.items() if kv.lease_id == lease_id]
            if keys:
                self._revision += 1
                self._delete(keys)

    # ------------------------------------------------------------------ inside
    def _send(self, method: str) -> None:
        self._sent[method] += 1
        if self.down:
            raise ClusterUnavailableError(f"etcd {method}: connection refused", fast=True)

    def _check_lease(self, lease_id: int | None) -> None:
        if lease_id and lease_id not in self._leases:
            raise LeaseNotFoundError("etcd: requested lease not found")

    def _holds(self, c: Compare) -> bool:
        kv = self._keys.get(c.key)
        if c.target == "value":
            return kv is not None and kv.value == c.value
        if kv is None:
            return c.value == 0
        field = {"create": kv.create_revision, "mod": kv.mod_revision, "lease": kv.lease_id}
        return field[c.target] == c.value

    def _apply(self, ops: Sequence[Put | Delete]) -> int:
        """The ops of one transaction, at one revision (none if nothing changes); returns
        the keys deleted."""
        for op in ops:
            if isinstance(op, Put):
                self._check_lease(op.lease_id)
        changes = any(isinstance(op, Put) for op in ops) or any(
            self._matching(op) for op in ops if isinstance(op, Delete)
        )
        if changes:
            self._revision += 1
        deleted = 0
        for op in ops:
            if isinstance(op, Put):
                self._put(op.key, op.value, op.lease_id)
            else:
                keys = self._matching(op)
                deleted += len(keys)
                self._delete(keys)
        return deleted

    def _matching(self, op: Delete) -> list[str]:
        if op.prefix:
            return [k for k in self._keys if k.startswith(op.key)]
        return [op.key] if op.key in self._keys else []

    def _put(self, key: str, value: str, lease_id: int | None) -> None:
        old = self._keys.get(key)
        created = old.create_revision if old is not None else self._revision
        self._keys[key] = KeyValue(key, value, self._revision, created, lease_id or 0)
        self.writes.append((key, value))

    def _delete(self, keys: Sequence[str]) -> None:
        for key in keys:
            del self._keys[key]
            self.writes.append((key, None))


def memory_cluster(job: str = "job", kv: MemoryKV | None = None) -> ClusterClient:
    """The real cluster client of `job` over a `MemoryKV`: the agent's cluster port with
    etcd's rules, without an etcd."""
    return ClusterClient(["memory:2379"], job, kv=kv if kv is not None else MemoryKV())


class MemoryCache:
    """The job's watch-fed cache (elasticpp.cluster.cache.JobCache) over a `MemoryKV`: the
    same ranges served (`cache_ranges`: a follower's, and the leader's while
    `serve_leader(True)`), each answer the memory's state now, as the real cache's is once
    every event reached it. Each key and prefix read is listed in the memory's `read`."""

    def __init__(self, memory: MemoryKV, keys: JobKeys, own_node: str | None = None) -> None:
        self.memory = memory
        self._shared, self._leader_only = cache_ranges(keys, own_node)
        self.leader = False  # serving the leader's ranges too

    def _ranges(self) -> list[tuple[str, str]]:
        return self._shared + (list(self._leader_only) if self.leader else [])

    def covers(self, key: str) -> bool:
        return any(k <= key < end for k, end in self._ranges())

    def _served(self, key: str, range_end: str) -> None:
        if not any(k <= key and range_end <= end for k, end in self._ranges()):
            raise ClusterUnavailableError(f"etcd cache: {key} is not cached here")

    def get(self, key: str) -> tuple[KeyValue | None, int]:
        self._served(key, key)
        self.memory.read.append(key)
        kvs, revision = self.memory.held(key, key + "\0")
        return (kvs[0] if kvs else None), revision

    def prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        self._served(prefix, prefix_end(prefix))
        self.memory.read.append(prefix)
        return self.memory.held(prefix, prefix_end(prefix))

    def serve_leader(self, on: bool) -> None:
        self.leader = on

    def ensure(self) -> None:
        pass  # no event is ever lost here

    def close(self) -> None:
        pass


class FakeCluster(ClusterClient):
    """The unit tests' cluster: the real `ClusterClient` over its own `MemoryKV` (`memory`),
    with what a test reads of what was written. Close it (`close`) when a test campaigned
    or registered: their keep-alive threads stop then."""

    def __init__(
        self,
        job: str = "job",
        registration: FakeRegistration | None = None,
        *,
        cached_for: str | None = None,
    ) -> None:
        self.memory = MemoryKV()
        super().__init__(["memory:2379"], job, kv=self.memory)
        self.registration = registration
        self.skipped: list[str] = []  # the keys whose values were skipped, in order
        # With `cached_for` (a node id), reads with cached=True are answered by a
        # MemoryCache of that node, as if `follow` had started the job's cache.
        self.cache: MemoryCache | None = None
        if cached_for is not None:
            self.cache = MemoryCache(self.memory, self.keys, cached_for)
            self.reads.serve_from(self.cache)

    def lead(self, node_id: str) -> Term:
        """Put `node_id` in the leader key, as a campaign would; its term, for fenced writes."""
        self.memory.put(self.keys.leader, node_id)
        term = Term(node_id)
        [kv], _ = self.memory.held(self.keys.leader, self.keys.leader + "\0")
        term.create_revision = kv.create_revision
        return term

    def register(self, node_id: str, info: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        """A registration as the client makes it; with a fake `registration` given, that one
        instead (its lapse is the test's to say), its member key put on a lease of its own."""
        if self.registration is None:
            return super().register(node_id, info, *args, **kwargs)
        lease = self.memory.grant(30)
        self.memory.put(self.keys.node(node_id), json.dumps(info), lease)
        self.registration.lease_id = lease
        self.registration.updates.append(dict(info))
        return self.registration

    def skip_value(self, key: str, exc: Exception) -> None:
        self.skipped.append(key)
        super().skip_value(key, exc)

    def puts(self, prefix: str) -> list[tuple[str, Any]]:
        """Every value written under `prefix`, in order, as JSON: (key, value)."""
        return [
            (key, json.loads(value))
            for key, value in self.memory.writes
            if value is not None and key.startswith(prefix)
        ]

    def arrived(self) -> list[tuple[str, str, Any]]:
        """Every arrival written to the job's barriers, in order: (barrier, member, value)."""
        prefix = self.keys.barriers_prefix
        out = []
        for key, record in self.puts(prefix):
            barrier, _, member = key.removeprefix(prefix).partition("/")
            out.append((barrier, member, record.get("value")))
        return out
