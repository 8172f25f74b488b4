"""Keys under leases: a node's membership (`Registration`) and the leader's term
(`Leadership`). Every lease of one etcd client is kept alive by that client's one daemon
thread (`keepers.KeeperGroup`): the keep-alives due together are sent together and their answers
waited for together, so a slow answer holds back none sent beside it. A node keeps its two
leases on one thread; the simulated nodes of bench/scale.py that share a connection keep
theirs on one (a thread a lease was 2,048 threads, each waking for each keep-alive).

Invariants:
- A lease is renewed only while its owner's loop makes progress (`ProgressGate`): a loop
  stalled past its bound stops renewing, says so once, and the lease lapses, so the cluster
  goes on without the wedged node (or leader). Renewal resumes when the loop runs again.
- Self-fencing has a margin. A keep-alive is credited from the instant it was SENT (etcd
  restarts the TTL when it serves the request, which may be just after the send), also
  when its answer came after the request's timeout (an overloaded etcd or process), and
  `may_have_lapsed()` / `is_held()` turn true `fence_after_s(ttl, request timeout)` =
  `ttl - max(request timeout, ttl/3)` after the last successful send. A lease known lost
  (LeaseNotFound) fences at once.
- A registration whose lease was lost is re-granted and its key re-put by a transaction that
  requires the key to be absent or to hold this incarnation: another agent registered under
  the same node id is never overwritten; this one stops and reports the conflict instead.
- A leadership whose lease was lost is over, never renewed silently: the caller must
  campaign again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from elasticpp.cluster.errors import ClusterError, ClusterUnavailableError, LeaseNotFoundError
from elasticpp.cluster.etcd.kv import Compare, EtcdKV, Put
from elasticpp.cluster.keepers import KeeperGroup
from elasticpp.cluster.records import KeyValue, dumps
from elasticpp.errors import ConfigError

log = logging.getLogger("elasticpp.cluster.client")

MIN_LEASE_TTL_S = 2  # etcd grants no shorter lease
RETRY_MIN_S = 0.1
RETRY_MAX_S = 2.0
FAILING_RETRY_S = RETRY_MIN_S * 5  # keep-alive retry pace while etcd fails


def check_ttl(ttl_s: float) -> int:
    if int(ttl_s) != ttl_s or ttl_s < MIN_LEASE_TTL_S:
        raise ConfigError(f"ttl_s {ttl_s!r}: must be a whole number of seconds >= 2")
    return int(ttl_s)


def fence_after_s(ttl_s: float, request_timeout_s: float) -> float:
    """How long after a keep-alive's send its holder may still act: `ttl - max(request
    timeout, ttl/3)`. The margin covers a request that etcd served late in its timeout and
    the holder's own delays (GIL, scheduling), like Patroni's `loop_wait + 2 x retry_timeout
    <= ttl`. Refuses a TTL that leaves no time to act."""
    fence_s = ttl_s - max(request_timeout_s, ttl_s / 3.0)
    if fence_s <= 0:
        raise ConfigError(
            f"lease ttl_s {ttl_s:g}: must be longer than the etcd request timeout "
            f"({request_timeout_s:g} s), which is the self-fencing margin"
        )
    return fence_s


@dataclass(frozen=True)
class ProgressGate:
    """Renew a lease only while the owner's loop makes progress.

    `stuck_s()` is how long the loop has been in its current piece of work (0 while it
    waits to be woken: an idle loop is not stalled); past `stall_limit_s` the keeper stops
    renewing and the lease lapses one TTL later."""

    stuck_s: Callable[[], float]
    stall_limit_s: float

    def __post_init__(self) -> None:
        if not self.stall_limit_s > 0:
            raise ConfigError(f"stall_limit_s {self.stall_limit_s!r}: must be > 0")

    def stalled_s(self) -> float | None:
        """How long the loop has stalled, or None while it makes progress."""
        since_s = self.stuck_s()
        return since_s if since_s > self.stall_limit_s else None


def incarnation_of(value: str) -> str | None:
    """The `incarnation` field of a registration value, None if unreadable."""
    try:
        data = json.loads(value)
    except ValueError:
        return None
    found = data.get("incarnation") if isinstance(data, dict) else None
    return found if isinstance(found, str) else None


class LeaseKeeper:
    """Keeps one lease (and the key on it) alive; `step()` is one keep-alive attempt and
    returns the pause until the next, run from a daemon thread (or by a test).

    `regrant=True` (membership): a lost lease is replaced by a new one and the key re-put,
    unless another incarnation holds the key (then `conflict` says so and the keeper ends).
    `regrant=False` (leadership): a lost lease ends the keeper and marks it lost.
    """

    failing_retry_s = FAILING_RETRY_S  # the pace of a step that failed (KeeperGroup)

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
        kind: str,
        granted_at_s: float,
        incarnation: str | None = None,
        on_lost: Callable[[], None] | None = None,
        gate: ProgressGate | None = None,
        clock: Callable[[], float] = time.monotonic,
        start: bool = True,
    ) -> None:
        self._kv = kv
        self._key = key
        self._value = value
        self.ttl_s = ttl_s
        self.fence_s = fence_after_s(ttl_s, kv.request_timeout_s)
        # Three tries fit before the fence point: a reply up to two intervals late (a busy
        # etcd, a busy process) does not fence the holder.
        self.interval_s = self.fence_s / 3.0
        self._lease_id = lease_id
        self._regrant = regrant
        self._what = what
        self._kind = kind
        self._incarnation = incarnation
        self._on_lost = on_lost
        self._gate = gate
        self._clock = clock
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._sent_ok = granted_at_s  # send instant of the last keep-alive etcd answered
        self._lost = False
        self._conflict: str | None = None
        self._need_put = False
        self._granted_at_s = granted_at_s
        self._failing = False
        self._stalled = False
        self._group: KeeperGroup | None = None
        if start:
            self._group = KeeperGroup.join(self, time.monotonic() + self.interval_s)

    @property
    def lease_id(self) -> int:
        with self._lock:
            return self._lease_id

    @property
    def conflict(self) -> str | None:
        with self._lock:
            return self._conflict

    def may_have_lapsed(self) -> bool:
        """True when the holder must stop acting: the lease is known lost, or no keep-alive
        sent within the last `fence_s` was answered."""
        with self._lock:
            if self._lost or self._conflict is not None:
                return True
            return self._clock() - self._sent_ok >= self.fence_s

    def _credit(self, lease_id: int, sent_s: float) -> None:
        """etcd renewed `lease_id` at a keep-alive sent at `sent_s`: answered in time, or
        late (after its timeout, from the stream's reader); never a lease replaced since."""
        with self._lock:
            if lease_id == self._lease_id and not self._lost:
                self._sent_ok = max(self._sent_ok, sent_s)

    def step(self) -> float:
        """One keep-alive attempt (or a re-put); returns the pause before the next. (The
        client's `KeeperGroup` does the same for all its keepers, their keep-alives sent
        together.)"""
        delay_s = self.before_refresh()
        if delay_s is not None:
            return delay_s
        sent_s, lease_id = self._clock(), self.lease_id
        outcome: int | ClusterError
        try:
            outcome = self._kv.refresh(lease_id, on_late=self.on_late(lease_id, sent_s))
        except (LeaseNotFoundError, ClusterUnavailableError) as exc:
            outcome = exc
        return self.after_refresh(lease_id, sent_s, outcome)

    def on_late(self, lease_id: int, sent_s: float) -> Callable[[], None]:
        """What a keep-alive of `lease_id` sent at `sent_s` calls when answered late."""
        return lambda: self._credit(lease_id, sent_s)

    def before_refresh(self) -> float | None:
        """The part of a step before its keep-alive: the pause until the next step when no
        keep-alive is to be sent now (the loop stalled, or the key re-put instead), else
        None."""
        stalled_s = self._gate.stalled_s() if self._gate is not None else None
        if stalled_s is not None:
            if not self._stalled:
                self._stalled = True
                log.warning(
                    "%s: decision loop stalled %.0f s: %s lease not renewed",
                    self._what,
                    stalled_s,
                    self._kind,
                )
            return self.interval_s
        if self._stalled:
            self._stalled = False
            log.info("%s: decision loop running again: %s lease renewed", self._what, self._kind)
        if not self._need_put:
            return None
        outcome: int | ClusterError
        try:
            self._reput()
            outcome = 0
        except (LeaseNotFoundError, ClusterUnavailableError) as exc:
            outcome = exc
        return self._after(outcome)

    def after_refresh(self, lease_id: int, sent_s: float, outcome: int | ClusterError) -> float:
        """The part of a step after its keep-alive of `lease_id`, sent at `sent_s`: its
        outcome (the new TTL or the error); returns the pause until the next step."""
        if not isinstance(outcome, ClusterError):
            self._credit(lease_id, sent_s)
        return self._after(outcome)

    def _after(self, outcome: int | ClusterError) -> float:
        try:
            if isinstance(outcome, ClusterError):
                raise outcome
            if self._failing:
                log.info("%s: etcd reachable again, lease %x kept", self._what, self.lease_id)
            self._failing = False
        except LeaseNotFoundError:
            if self._stop.is_set():
                return self.interval_s  # revoked on purpose (resign/close)
            with self._lock:
                self._lost = True  # fences at once, until the key is re-put
            if not self._regrant:
                log.warning("%s: lease %x lost; giving up the key", self._what, self.lease_id)
                self._stop.set()
                if self._on_lost is not None:
                    self._on_lost()
                return self.interval_s
            self._need_put = True
            return self._grant()
        except ClusterUnavailableError as exc:
            if not self._failing:
                log.warning("%s: keep-alive failed, retrying: %s", self._what, exc)
            self._failing = True
            return FAILING_RETRY_S
        if self._conflict is not None or not self._need_put:
            return self.interval_s
        return FAILING_RETRY_S  # the re-put is retried soon, not after a whole interval

    def _grant(self) -> float:
        try:
            sent_s = self._clock()
            new_id = self._kv.grant(self.ttl_s)
        except ClusterUnavailableError:
            self._failing = True
            return FAILING_RETRY_S
        with self._lock:
            old, self._lease_id = self._lease_id, new_id
        self._granted_at_s = sent_s
        log.info("%s: lease %x lost; granted lease %x", self._what, old, new_id)
        return RETRY_MIN_S  # the key is re-put at the next step

    def _reput(self) -> None:
        """Put the key on the new lease only if it is absent or holds this incarnation."""
        lease_id = self.lease_id
        value = self._value()
        ok, found, _ = self._kv.txn(
            [Compare(self._key, "create", 0)], [Put(self._key, value, lease_id)], [self._key]
        )
        if not ok:
            held = found[0] if found else None
            if held is None:
                return  # deleted between compare and read: the next step tries again
            if held.lease_id != lease_id:  # else: put by an earlier try whose answer was lost
                if incarnation_of(held.value) != self._incarnation:
                    self._give_up(held)
                    return
                # Our own key on an older lease (a put whose answer was lost): take it over.
                ok, _, _ = self._kv.txn(
                    [Compare(self._key, "mod", held.mod_revision)],
                    [Put(self._key, value, lease_id)],
                )
                if not ok:
                    return
        with self._lock:
            self._lost = False
            self._sent_ok = self._granted_at_s
        self._need_put = False
        log.info("%s: key %s re-put on lease %x", self._what, self._key, lease_id)

    def _give_up(self, held: KeyValue) -> None:
        message = (
            f"another agent with the same node id is registered: {self._key} holds "
            f"incarnation {incarnation_of(held.value) or '?'}, this agent is "
            f"{self._incarnation or '?'}; not overwriting it, this agent stops"
        )
        log.error("%s: %s", self._what, message)
        with self._lock:
            self._conflict = message
        self._stop.set()
        with contextlib.suppress(ClusterUnavailableError, LeaseNotFoundError):
            self._kv.revoke(self.lease_id)  # our unused new lease

    def stop(self) -> None:
        """Stop keeping the lease; once this returns no step of it runs (unless called by
        its own step)."""
        if self._stop.is_set() and self._group is None:
            return
        self._stop.set()
        group, self._group = self._group, None
        if group is not None:
            group.leave(self)


class Registration:
    """A node's membership key under its own lease; `close()` revokes it (the node leaves).

    The value carries this agent's `incarnation` (from `info`, or a new one): a lost lease is
    re-put only over an absent key or this incarnation's, never over another agent's."""

    def __init__(
        self,
        kv: EtcdKV,
        key: str,
        node_id: str,
        info: dict[str, Any],
        ttl_s: int,
        *,
        gate: ProgressGate | None = None,
        clock: Callable[[], float] = time.monotonic,
        start: bool = True,
    ) -> None:
        self.node_id = node_id
        self.incarnation = str(info.get("incarnation") or uuid.uuid4().hex[:12])
        self._kv = kv
        self._key = key
        self._info_lock = threading.Lock()
        self._value = self._dump(info)
        fence_after_s(ttl_s, kv.request_timeout_s)  # refused before anything is written
        sent_s = clock()
        lease_id = kv.grant(ttl_s)
        # A newer agent started with this node id takes the key over: the one whose lease
        # lapsed (a partition, a stall) is the one that must go.
        kv.put(key, self._value, lease_id)
        self._keeper = LeaseKeeper(
            kv,
            key,
            self._current,
            ttl_s,
            lease_id,
            regrant=True,
            what=f"node {node_id}",
            kind="membership",
            granted_at_s=sent_s,
            incarnation=self.incarnation,
            gate=gate,
            clock=clock,
            start=start,
        )
        log.info("node %s registered (lease %x, ttl %d s)", node_id, lease_id, ttl_s)

    def _dump(self, info: dict[str, Any]) -> str:
        return dumps(
            {
                **info,
                "node_id": self.node_id,
                "incarnation": self.incarnation,
                "registered_at": time.time(),
            }
        )

    def _current(self) -> str:
        with self._info_lock:
            return self._value

    @property
    def lease_id(self) -> int:
        return self._keeper.lease_id

    @property
    def conflict(self) -> str | None:
        """Why this registration ended for good: another agent with the same node id holds
        the key. None otherwise."""
        return self._keeper.conflict

    def may_have_lapsed(self) -> bool:
        """True when this node cannot know that its membership still stands: no keep-alive
        sent in the last `ttl - max(request timeout, ttl/3)` was answered (etcd unreachable,
        this process or its loop stalled), or the lease is known lost and the key not re-put
        yet, or another agent holds the key. The agent fences itself meanwhile."""
        return self._keeper.may_have_lapsed()

    def update(self, info: dict[str, Any]) -> bool:
        """Replace the registered info, only while the key is on this registration's lease
        (never over another agent's key). False if not written now; the keeper writes the
        new info when it re-puts the key."""
        with self._info_lock:
            self._value = self._dump(info)
        lease_id = self.lease_id
        ok, _, _ = self._kv.txn(
            [Compare(self._key, "lease", lease_id)], [Put(self._key, self._current(), lease_id)]
        )
        if not ok:
            log.warning(
                "node %s: info not updated, key %s is not on lease %x",
                self.node_id,
                self._key,
                lease_id,
            )
        return ok

    def close(self, *, revoke: bool = True) -> None:
        """Stop the keep-alive; with `revoke` the key disappears at once (a clean leave)."""
        self._keeper.stop()
        if revoke and self.conflict is None:
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
        *,
        granted_at_s: float,
        gate: ProgressGate | None = None,
        clock: Callable[[], float] = time.monotonic,
        start: bool = True,
    ) -> None:
        self.node_id = node_id
        self.create_revision = create_revision
        self.ttl_s = ttl_s
        self._kv = kv
        self._key = key
        self._resigned = False
        self._keeper = LeaseKeeper(
            kv,
            key,
            lambda: node_id,
            ttl_s,
            lease_id,
            regrant=False,
            what=f"leader {node_id}",
            kind="leader",
            granted_at_s=granted_at_s,
            on_lost=on_lost,
            gate=gate,
            clock=clock,
            start=start,
        )

    @property
    def lease_id(self) -> int:
        return self._keeper.lease_id

    def is_held(self) -> bool:
        """False once lost or resigned, or when the lease may have lapsed unseen (no
        keep-alive sent in the last `ttl - max(request timeout, ttl/3)` was answered). etcd
        still fences every write; this only says "stop acting"."""
        return not self._resigned and not self._keeper.may_have_lapsed()

    def resign(self) -> None:
        """Give up leadership now: another node can win at once (no TTL wait)."""
        self._resigned = True
        self._keeper.stop()
        try:
            self._kv.revoke(self.lease_id)  # deletes the leader key, which is on this lease
            log.info("leader %s resigned", self.node_id)
        except (ClusterUnavailableError, LeaseNotFoundError) as exc:
            log.warning("leader %s: resign incomplete, lease lapses by TTL: %s", self.node_id, exc)
