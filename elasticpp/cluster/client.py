"""`ClusterClient`: a job's shared state in etcd — membership, election, generations, barriers.

Invariants this module keeps:
- Membership and leadership are keys under leases kept alive by one daemon thread each
  (refresh every ttl/3). A registration whose lease was lost (expired while etcd was down,
  revoked) is re-granted and re-put; a leadership whose lease was lost is over, never renewed
  silently — the caller must campaign again.
- A generation is written only by compare-and-swap: the generation key's mod revision must be
  the one the leader read, the leader key must still hold this leader (value, and for a
  `Leadership` also its create revision, so a deposed-then-re-elected node cannot write with
  its old term), and the number must be exactly the previous one + 1.
- Watches survive etcd restarts: when a stream ends they are re-created from the last
  delivered revision + 1, so no event is lost or delivered twice.
- Every call that needs etcd raises `ClusterUnavailableError` within about
  `request_timeout_s` when etcd does not answer.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from elasticpp.cluster import keys as keymod
from elasticpp.cluster.errors import (
    BarrierTimeoutError,
    ClusterDataError,
    ClusterUnavailableError,
    GenerationConflictError,
    LeaseNotFoundError,
)
from elasticpp.cluster.etcd_client import (
    Compare,
    Delete,
    EtcdKV,
    Put,
    WatchBatch,
    WatchEnded,
    WatchItem,
)
from elasticpp.cluster.records import (
    CommitRecord,
    EventType,
    GenerationRecord,
    Members,
    SafeStep,
    WatchEvent,
    dumps,
    loads,
)
from elasticpp.errors import ConfigError

log = logging.getLogger(__name__)

_T = TypeVar("_T", "Registration", "Leadership", "Watch")

MIN_LEASE_TTL_S = 2  # etcd grants no shorter lease
# The one member of barrier `resume-<G>`: the instruction of whichever leader wrote it.
RESUME_MEMBER = "resume"
HISTORY_KEPT = 100  # generations of history and recovery timelines kept in etcd
_RETRY_MIN_S = 0.1
_RETRY_MAX_S = 2.0


def _check_ttl(ttl_s: float) -> int:
    if int(ttl_s) != ttl_s or ttl_s < MIN_LEASE_TTL_S:
        raise ConfigError(f"ttl_s {ttl_s!r}: must be a whole number of seconds >= 2")
    return int(ttl_s)


class _LeaseKeeper:
    """Keeps one lease (and the key on it) alive from a daemon thread.

    `regrant=True` (membership): a lost lease is replaced by a new one and the key re-put.
    `regrant=False` (leadership): a lost lease ends the keeper and marks it lost.
    """

    def __init__(
        self,
        kv: EtcdKV,
        key: str,
        value: Callable[[], str],
        ttl_s: int,
        lease_id: int,
        *,
        regrant: bool,
        what: str,
        on_lost: Callable[[], None] | None = None,
    ) -> None:
        self._kv = kv
        self._key = key
        self._value = value
        self.ttl_s = ttl_s
        self._lease_id = lease_id
        self._regrant = regrant
        self._what = what
        self._on_lost = on_lost
        self._stop = threading.Event()
        self._lost = threading.Event()
        self._lock = threading.Lock()
        self._last_ok = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=f"lease-{what}", daemon=True)
        self._thread.start()

    @property
    def lease_id(self) -> int:
        with self._lock:
            return self._lease_id

    @property
    def lost(self) -> bool:
        return self._lost.is_set()

    def seconds_since_refresh(self) -> float:
        with self._lock:
            return time.monotonic() - self._last_ok

    def _run(self) -> None:
        interval_s = self.ttl_s / 3.0
        failing = False
        need_put = False
        while not self._stop.wait(_RETRY_MIN_S * 5 if failing else interval_s):
            try:
                if need_put:
                    self._kv.put(self._key, self._value(), self.lease_id)
                    need_put = False
                    log.info("%s: key %s re-put on lease %x", self._what, self._key, self.lease_id)
                else:
                    self._kv.refresh(self.lease_id)
                with self._lock:
                    self._last_ok = time.monotonic()
                if failing:
                    log.info("%s: etcd reachable again, lease %x kept", self._what, self.lease_id)
                failing = False
            except LeaseNotFoundError:
                if self._stop.is_set():
                    return  # revoked on purpose (resign/close)
                if not self._regrant:
                    log.info("%s: lease %x lost; giving up the key", self._what, self.lease_id)
                    self._lost.set()
                    if self._on_lost is not None:
                        self._on_lost()
                    return
                try:
                    new_id = self._kv.grant(self.ttl_s)
                except ClusterUnavailableError:
                    failing = True
                    continue
                with self._lock:
                    old, self._lease_id = self._lease_id, new_id
                need_put = True
                failing = True  # retry the put soon instead of after ttl/3
                log.info("%s: lease %x lost; granted lease %x", self._what, old, new_id)
            except ClusterUnavailableError as exc:
                if not failing:
                    log.warning("%s: keep-alive failed, retrying: %s", self._what, exc)
                failing = True

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self._kv.request_timeout_s * 2 + 1)


class Registration:
    """A node's membership key under its own lease; `close()` revokes it (the node leaves)."""

    def __init__(self, kv: EtcdKV, key: str, node_id: str, info: dict[str, Any], ttl_s: int):
        self.node_id = node_id
        self._kv = kv
        self._key = key
        self._info_lock = threading.Lock()
        self._value = dumps({**info, "node_id": node_id, "registered_at": time.time()})
        lease_id = kv.grant(ttl_s)
        kv.put(key, self._value, lease_id)
        self._keeper = _LeaseKeeper(
            kv, key, self._current, ttl_s, lease_id, regrant=True, what=f"node {node_id}"
        )
        log.info("node %s registered (lease %x, ttl %d s)", node_id, lease_id, ttl_s)

    def _current(self) -> str:
        with self._info_lock:
            return self._value

    @property
    def lease_id(self) -> int:
        return self._keeper.lease_id

    def may_have_lapsed(self) -> bool:
        """True when this node cannot know that its membership still stands: no keep-alive
        succeeded for a whole TTL (etcd unreachable, or this process stalled), or the lease
        was lost and the key is not re-put yet. The agent fences itself meanwhile."""
        return self._keeper.seconds_since_refresh() >= self._keeper.ttl_s

    def update(self, info: dict[str, Any]) -> None:
        """Replace the registered info (same lease)."""
        with self._info_lock:
            self._value = dumps({**info, "node_id": self.node_id, "registered_at": time.time()})
        self._kv.put(self._key, self._current(), self.lease_id)

    def close(self, *, revoke: bool = True) -> None:
        """Stop the keep-alive; with `revoke` the key disappears at once (a clean leave)."""
        self._keeper.stop()
        if revoke:
            try:
                self._kv.revoke(self.lease_id)
                log.info("node %s deregistered", self.node_id)
            except (ClusterUnavailableError, LeaseNotFoundError) as exc:
                log.warning("node %s: lease not revoked, it lapses by TTL: %s", self.node_id, exc)


class Leadership:
    """A won election. `create_revision` is the fencing token of this term."""

    def __init__(
        self,
        kv: EtcdKV,
        key: str,
        node_id: str,
        ttl_s: int,
        lease_id: int,
        create_revision: int,
        on_lost: Callable[[], None] | None,
    ) -> None:
        self.node_id = node_id
        self.create_revision = create_revision
        self.ttl_s = ttl_s
        self._kv = kv
        self._key = key
        self._resigned = False
        self._keeper = _LeaseKeeper(
            kv,
            key,
            lambda: node_id,
            ttl_s,
            lease_id,
            regrant=False,
            what=f"leader {node_id}",
            on_lost=on_lost,
        )

    @property
    def lease_id(self) -> int:
        return self._keeper.lease_id

    def is_held(self) -> bool:
        """False once lost or resigned, or when the lease may have lapsed unseen (no refresh
        for a whole TTL). etcd still fences every write; this only says "stop acting"."""
        return (
            not self._resigned
            and not self._keeper.lost
            and self._keeper.seconds_since_refresh() < self.ttl_s
        )

    def resign(self) -> None:
        """Give up leadership now: another node can win at once (no TTL wait)."""
        self._resigned = True
        self._keeper.stop()
        try:
            self._kv.revoke(self.lease_id)  # deletes the leader key, which is on this lease
            log.info("leader %s resigned", self.node_id)
        except (ClusterUnavailableError, LeaseNotFoundError) as exc:
            log.warning("leader %s: resign incomplete, lease lapses by TTL: %s", self.node_id, exc)


class Watch:
    """A watch that outlives etcd restarts. The callback runs on this watch's own thread,
    one event at a time, in revision order; it may call the client (even create watches)."""

    def __init__(
        self,
        kv: EtcdKV,
        key: str,
        callback: Callable[[WatchEvent], None],
        *,
        prefix: bool,
        start_revision: int | None,
    ) -> None:
        self.key = key
        self._kv = kv
        self._range_end = keymod.prefix_end(key) if prefix else None
        self._callback = callback
        self._items: queue.Queue[tuple[int, WatchItem]] = queue.Queue()
        self._cancelled = threading.Event()
        self._stream = 0  # items of older streams are dropped
        self._watch_id = -1
        if start_revision is None:
            start_revision = kv.revision() + 1
        self._next_revision = start_revision
        self._open()  # the first creation is synchronous: a dead etcd raises here
        self._thread = threading.Thread(target=self._run, name=f"watch-{key}", daemon=True)
        self._thread.start()

    @property
    def next_revision(self) -> int:
        """The revision the watch would resume from (last delivered + 1)."""
        return self._next_revision

    def _open(self) -> None:
        self._stream += 1
        stream = self._stream

        def sink(item: WatchItem) -> None:
            self._items.put((stream, item))

        self._watch_id = self._kv.add_watch(self.key, self._range_end, self._next_revision, sink)

    def _run(self) -> None:
        broken: str | None = None
        backoff_s = _RETRY_MIN_S
        while not self._cancelled.is_set():
            if broken is not None:
                if self._cancelled.wait(backoff_s):
                    break
                try:
                    self._open()
                    log.info(
                        "watch %s re-created from revision %d after: %s",
                        self.key,
                        self._next_revision,
                        broken,
                    )
                    broken, backoff_s = None, _RETRY_MIN_S
                except ClusterUnavailableError:
                    backoff_s = min(backoff_s * 2, _RETRY_MAX_S)
                continue
            try:
                stream, item = self._items.get(timeout=0.5)
            except queue.Empty:
                continue
            if stream != self._stream or self._cancelled.is_set():
                continue
            if isinstance(item, WatchBatch):
                self._deliver(item)
            elif isinstance(item, WatchEnded):
                self._kv.cancel_watch(self._watch_id)
                if item.compact_revision:
                    log.warning(
                        "watch %s: revisions before %d were compacted; events lost, resync",
                        self.key,
                        item.compact_revision,
                    )
                    self._next_revision = item.compact_revision
                    self._safe_call(
                        WatchEvent(EventType.RESYNC, self.key, None, item.compact_revision)
                    )
                broken = item.reason

    def _deliver(self, batch: WatchBatch) -> None:
        floor = self._next_revision
        for event in batch.events:
            if event.mod_revision < floor:
                continue  # already delivered before a re-creation
            self._safe_call(event)
            self._next_revision = max(self._next_revision, event.mod_revision + 1)

    def _safe_call(self, event: WatchEvent) -> None:
        try:
            self._callback(event)
        except Exception:
            log.exception("watch %s: callback failed on %s", self.key, event)

    def cancel(self) -> None:
        self._cancelled.set()
        self._kv.cancel_watch(self._watch_id)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)


class ClusterClient:
    """One job's cluster state in etcd. Thread-safe; one instance per process is enough.

    `request_timeout_s` bounds every etcd call; past it the call raises
    `ClusterUnavailableError`.
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        job: str,
        *,
        request_timeout_s: float = 2.0,
    ) -> None:
        self.job = job
        self.keys = keymod.JobKeys(job)
        self._kv = EtcdKV(list(endpoints), request_timeout_s=request_timeout_s)
        self._lock = threading.Lock()
        self._owned: list[Registration | Leadership | Watch] = []
        # Values that could not be read (malformed, or written by a newer format) are skipped,
        # counted here and logged once per key: one bad value must not stop every agent.
        self.skipped_values = 0
        self._skipped_keys: set[str] = set()

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
        for obj in owned:
            if isinstance(obj, Watch):
                obj.cancel()
            elif isinstance(obj, Registration):
                obj.close(revoke=False)
            else:
                obj._keeper.stop()
        self._kv.close()

    def __enter__(self) -> ClusterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def revision(self) -> int:
        return self._kv.revision()

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

    def spec(self) -> str | None:
        kv = self._kv.get(self.keys.spec)
        return kv.value if kv else None

    # ------------------------------------------------------------------ membership
    def register(self, node_id: str, info: dict[str, Any], ttl_s: float = 5) -> Registration:
        """Put `nodes/<node_id>` under a new lease kept alive from a daemon thread."""
        key = self.keys.node(node_id)
        return self._own(Registration(self._kv, key, node_id, info, _check_ttl(ttl_s)))

    def skip_value(self, key: str, exc: Exception) -> None:
        """Count an unreadable value (and log it once per key)."""
        self.skipped_values += 1
        if key not in self._skipped_keys:
            self._skipped_keys.add(key)
            log.warning("etcd value of %s skipped: %s", key, exc)

    def _records(self, kvs: Iterable[Any], what: str) -> dict[str, dict[str, Any]]:
        """The readable records of `kvs` by last key segment; unreadable ones skipped."""
        out: dict[str, dict[str, Any]] = {}
        for kv in kvs:
            name = keymod.last_segment(kv.key)
            try:
                out[name] = loads(kv.value, f"{what} {name}")
            except ClusterDataError as exc:
                self.skip_value(kv.key, exc)
        return out

    def members(self) -> Members:
        kvs, revision = self._kv.get_prefix(self.keys.nodes_prefix)
        return Members(self._records(kvs, "member"), revision)

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
    ) -> Leadership | None:
        """Become leader if nobody is: create `leader` under a new lease. None if taken.

        `on_lost` is called (from the keep-alive thread) if the lease is lost later."""
        keymod.check_name("node_id", node_id)
        ttl = _check_ttl(ttl_s)
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
            self._kv, self.keys.leader, node_id, ttl, lease_id, revision, on_lost
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

    def leader(self) -> str | None:
        kv = self._kv.get(self.keys.leader)
        return kv.value if kv else None

    def watch_leader(
        self, callback: Callable[[WatchEvent], None], start_revision: int | None = None
    ) -> Watch:
        return self.watch(self.keys.leader, callback, start_revision=start_revision)

    # ------------------------------------------------------------------ generations
    def read_generation(self) -> tuple[GenerationRecord | None, int]:
        """The current generation record and its mod revision (0 if none yet)."""
        kv = self._kv.get(self.keys.generation)
        if kv is None:
            return None, 0
        return GenerationRecord.from_json(kv.value), kv.mod_revision

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
        value = record.to_json()
        ok, _, revision = self._kv.txn(
            compares,
            [
                Put(self.keys.generation, value),
                Put(self.keys.generation_history(record.generation), value),
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

    def generation_history(self) -> list[GenerationRecord]:
        kvs, _ = self._kv.get_prefix(self.keys.generations_prefix)
        return [GenerationRecord.from_json(kv.value) for kv in kvs]

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

    # ------------------------------------------------------------------ barriers
    def arrive(self, barrier: str, node_id: str, value: Any = None) -> None:
        self._kv.put(
            self.keys.barrier(barrier, node_id),
            dumps({"node_id": node_id, "value": value, "at": time.time()}),
        )

    def write_resume(self, generation: int, value: Any, leader: Leadership) -> bool:
        """Publish generation `generation`'s resume instruction (barrier `resume-<G>`, member
        `RESUME_MEMBER`) once, fenced by `leader`'s term.

        Whichever leader writes first wins; a later one (elected mid-transition) reads it
        instead of writing its own, so followers never wait on a record that names a
        leader they do not expect. False if one exists already or `leader` lost its term."""
        key = self.keys.barrier(f"resume-{generation}", RESUME_MEMBER)
        compares = [
            Compare(key, "create", 0),
            Compare(self.keys.leader, "value", leader.node_id),
            Compare(self.keys.leader, "create", leader.create_revision),
        ]
        record = dumps({"node_id": leader.node_id, "value": value, "at": time.time()})
        ok, _, _ = self._kv.txn(compares, [Put(key, record)])
        return ok

    def barrier_state(self, barrier: str) -> tuple[dict[str, Any], int]:
        """Who arrived (node id -> value) and the revision read."""
        kvs, revision = self._kv.get_prefix(self.keys.barrier_prefix(barrier))
        records = self._records(kvs, f"{barrier} arrival")
        return {node: r.get("value") for node, r in records.items()}, revision

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
                        self.skip_value(event.key, exc)
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

    # ------------------------------------------------------------------ commits
    def record_commit(
        self,
        generation: int,
        node_id: str,
        step: int,
        anchors: Sequence[int] = (),
        replicas: Mapping[str, Sequence[int]] | None = None,
    ) -> None:
        """Record `step` as this node's newest committed step in `generation` (-1: none), and
        the anchor steps of `generation` it holds: its own and, per origin, its replicas."""
        record = CommitRecord(
            node_id,
            generation,
            step,
            tuple(sorted(anchors, reverse=True)),
            {o: tuple(sorted(s, reverse=True)) for o, s in (replicas or {}).items()},
        )
        self._kv.put(
            self.keys.commit(generation, node_id), dumps({**record.to_dict(), "at": time.time()})
        )

    def commit_records(self, generation: int) -> dict[str, CommitRecord]:
        """The readable commit records of `generation` by node id; unreadable ones (malformed,
        a newer format, or naming another node or generation) are skipped and logged once."""
        kvs, _ = self._kv.get_prefix(self.keys.commits_of(generation))
        out: dict[str, CommitRecord] = {}
        for node, data in self._records(kvs, "commit record").items():
            key = self.keys.commit(generation, node)
            try:
                record = CommitRecord.from_dict(data)
                if (record.node_id, record.generation) != (node, generation):
                    raise ClusterDataError(
                        f"commit record under {node}/{generation} names "
                        f"{record.node_id}/{record.generation}"
                    )
            except ClusterDataError as exc:
                self.skip_value(key, exc)
                continue
            out[node] = record
        return out

    def commits(self, generation: int) -> dict[str, int]:
        kvs, _ = self._kv.get_prefix(self.keys.commits_of(generation))
        out: dict[str, int] = {}
        for node, record in self._records(kvs, "commit record").items():
            try:
                out[node] = int(record["step"])
            except (KeyError, TypeError, ValueError) as exc:
                self.skip_value(self.keys.commit(generation, node), exc)
        return out

    # ------------------------------------------------------------------ safe step
    def read_safe(self) -> tuple[SafeStep | None, int]:
        """The published safe step (None if none, or unreadable: skipped and logged once) and
        the key's mod revision (0 if absent), for `write_safe`."""
        kv = self._kv.get(self.keys.safe)
        if kv is None:
            return None, 0
        try:
            return SafeStep.from_dict(loads(kv.value, "safe step")), kv.mod_revision
        except ClusterDataError as exc:
            self.skip_value(self.keys.safe, exc)
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

    def clear_commits_before(self, generation: int) -> None:
        """Drop commit records of generations older than `generation` (housekeeping)."""
        kvs, _ = self._kv.get_prefix(self.keys.commits_prefix)
        old = {_gen_of(kv.key) for kv in kvs} - {-1}
        for gen in sorted(g for g in old if g < generation):
            self._kv.delete_prefix(self.keys.commits_of(gen))

    # ------------------------------------------------------------------ housekeeping
    def housekeep(self, generation: int, *, keep_history: int = HISTORY_KEPT) -> int:
        """Remove what a running `generation` no longer needs, so that etcd holds a bounded
        number of keys however long the job runs: the barriers of generations before the
        previous one, generation history and recovery timelines older than `keep_history`
        generations, and the commit records of all but the newest generation that has any
        (it keeps the job's "ever committed" mark). Idempotent; a watermark record makes
        each call cost only the generations since the last one. Returns keys deleted."""
        kv = self._kv.get(self.keys.housekeeping)
        marks = {"barriers_below": 1, "history_below": 1}
        if kv is not None:
            try:
                stored = loads(kv.value, "housekeeping")
                marks = {k: max(1, int(stored.get(k, 1))) for k in marks}
            except (ClusterDataError, TypeError, ValueError) as exc:
                self.skip_value(self.keys.housekeeping, exc)
        deleted = 0
        barriers_upto = generation - 1  # the current and the previous generation stay
        for g in range(marks["barriers_below"], barriers_upto):
            for name in ("stopped", "resume", "started", "failed"):
                deleted += self._kv.delete_prefix(self.keys.barrier_prefix(f"{name}-{g}"))
        history_upto = generation - keep_history
        for g in range(marks["history_below"], history_upto):
            deleted += int(self._kv.delete(self.keys.generation_history(g)))
            deleted += int(self._kv.delete(self.keys.barrier("timelines", f"gen-{g}")))
        kvs, _ = self._kv.get_prefix(self.keys.commits_prefix)
        with_commits = {_gen_of(kv.key) for kv in kvs} - {-1}
        if with_commits:
            newest = max(with_commits)
            for g in sorted(g for g in with_commits if g < newest):
                deleted += self._kv.delete_prefix(self.keys.commits_of(g))
        marks = {
            "barriers_below": max(marks["barriers_below"], barriers_upto),
            "history_below": max(marks["history_below"], history_upto),
        }
        self._kv.put(self.keys.housekeeping, dumps(marks))
        return deleted

    # ------------------------------------------------------------------ suspicion
    def report_suspect(self, node_id: str, by: str, reason: str) -> None:
        self._kv.put(
            self.keys.suspect(node_id),
            dumps({"node_id": node_id, "by": by, "reason": reason, "at": time.time()}),
        )
        log.info("node %s suspected by %s: %s", node_id, by, reason)

    def suspects(self) -> dict[str, dict[str, Any]]:
        kvs, _ = self._kv.get_prefix(self.keys.suspects_prefix)
        return self._records(kvs, "suspect")

    def clear_suspect(self, node_id: str) -> bool:
        return self._kv.delete(self.keys.suspect(node_id))

    def watch_suspects(
        self, callback: Callable[[WatchEvent], None], start_revision: int | None = None
    ) -> Watch:
        return self.watch(
            self.keys.suspects_prefix, callback, prefix=True, start_revision=start_revision
        )


def _gen_of(commit_key: str) -> int:
    try:
        return int(commit_key.rsplit("/", 2)[-2])
    except ValueError:
        return -1
