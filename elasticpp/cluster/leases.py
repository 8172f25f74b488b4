"""Keys under leases: a node's membership (`Registration`) and the leader's term
(`Leadership`), each kept alive by one daemon thread (refresh every ttl/3).

Invariants: a registration whose lease was lost (expired while etcd was down, revoked) is
re-granted and re-put; a leadership whose lease was lost is over, never renewed silently —
the caller must campaign again. `may_have_lapsed` is what self-fencing reads: no keep-alive
succeeded for a whole TTL.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from elasticpp.cluster.errors import ClusterUnavailableError, LeaseNotFoundError
from elasticpp.cluster.etcd_client import EtcdKV
from elasticpp.cluster.records import dumps
from elasticpp.errors import ConfigError

log = logging.getLogger("elasticpp.cluster.client")

MIN_LEASE_TTL_S = 2  # etcd grants no shorter lease
RETRY_MIN_S = 0.1
RETRY_MAX_S = 2.0


def check_ttl(ttl_s: float) -> int:
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
        while not self._stop.wait(RETRY_MIN_S * 5 if failing else interval_s):
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
