"""Lease keepers with a fake clock and a fake etcd (the `EtcdKV` calls they make): the
self-fencing margin, a known-lost lease, renewal tied to the loop's progress, and a re-put
that never overwrites another incarnation. The same rules against a real etcd are in
tests/integration/test_cluster_etcd.py."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

import pytest

from elasticpp.cluster.errors import ClusterUnavailableError, LeaseNotFoundError
from elasticpp.cluster.etcd.kv import Compare, Delete, Put
from elasticpp.cluster.leases import Leadership, ProgressGate, Registration, fence_after_s
from elasticpp.cluster.records import KeyValue
from elasticpp.errors import ConfigError

KEY = "/elasticpp/j/nodes/n1"


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


class FakeKV:
    """The lease and key calls of `EtcdKV`, in memory; a keep-alive takes `refresh_takes_s`
    of the fake clock; `grant_fails` grants answer "unavailable"."""

    def __init__(self, clock: FakeClock, request_timeout_s: float = 1.0) -> None:
        self.clock = clock
        self.request_timeout_s = request_timeout_s
        self.refresh_takes_s = 0.0
        self.grant_fails = 0
        self.refreshes = 0
        self.refresh_times_out = False
        self.late: list[Any] = []  # each timed-out keep-alive's `on_late`
        self.leases: set[int] = set()
        self.keys: dict[str, KeyValue] = {}
        self._next = 0x100
        self._revision = 1

    def grant(self, ttl_s: int) -> int:
        if self.grant_fails:
            self.grant_fails -= 1
            raise ClusterUnavailableError("etcd lease grant: timed out")
        self._next += 1
        self.leases.add(self._next)
        return self._next

    def refresh(self, lease_id: int, on_late: Any = None) -> int:
        self.refreshes += 1
        self.clock.advance(self.refresh_takes_s)
        if self.refresh_times_out:  # answered after the timeout, when the test calls `late`
            self.late.append(on_late)
            raise ClusterUnavailableError("etcd lease keep-alive: no answer within 1 s")
        if lease_id not in self.leases:
            raise LeaseNotFoundError(f"lease {lease_id:x} not found")
        return 2

    def revoke(self, lease_id: int) -> None:
        if lease_id not in self.leases:
            raise LeaseNotFoundError(f"lease {lease_id:x} not found")
        self.leases.discard(lease_id)
        self.keys = {k: v for k, v in self.keys.items() if v.lease_id != lease_id}

    def put(self, key: str, value: str, lease_id: int | None = None) -> int:
        if lease_id and lease_id not in self.leases:
            raise LeaseNotFoundError("requested lease not found")
        self._revision += 1
        old = self.keys.get(key)
        created = old.create_revision if old else self._revision
        self.keys[key] = KeyValue(key, value, self._revision, created, lease_id or 0)
        return self._revision

    def txn(
        self,
        compares: Sequence[Compare],
        success: Sequence[Put | Delete],
        failure_get: Sequence[str] = (),
    ) -> tuple[bool, list[KeyValue | None], int]:
        def holds(c: Compare) -> bool:
            kv = self.keys.get(c.key)
            field = {"create": "create_revision", "mod": "mod_revision", "lease": "lease_id"}
            if c.target == "value":
                return kv is not None and kv.value == c.value
            return (getattr(kv, field[c.target]) if kv else 0) == c.value

        if all(holds(c) for c in compares):
            for op in success:
                assert isinstance(op, Put)
                self.put(op.key, op.value, op.lease_id)
            return True, [], self._revision
        return False, [self.keys.get(k) for k in failure_get], self._revision


def _registration(kv: FakeKV, clock: FakeClock, **kwargs: Any) -> Registration:
    info = {"address": "x", "incarnation": "inc-a"}
    return Registration(kv, KEY, "n1", info, 2, clock=clock, start=False, **kwargs)  # type: ignore[arg-type]


def _incarnation(kv: FakeKV) -> str:
    return str(json.loads(kv.keys[KEY].value)["incarnation"])


def test_the_fence_point_is_the_ttl_less_the_larger_of_the_request_timeout_and_a_third() -> None:
    assert fence_after_s(5, 2.0) == 3.0
    assert fence_after_s(3, 2.0) == 1.0
    assert fence_after_s(30, 2.0) == 20.0  # ttl/3 is the larger margin
    assert fence_after_s(2, 1.0) == 1.0
    with pytest.raises(ConfigError, match="longer than the etcd request timeout"):
        fence_after_s(2, 2.0)  # no time left to act


def test_a_registration_is_fenced_from_the_fence_point_after_its_last_answered_send() -> None:
    clock = FakeClock()
    kv = FakeKV(clock)  # ttl 2, request timeout 1: fenced 1 s after a send
    reg = _registration(kv, clock)
    reg._keeper.step()
    clock.advance(0.99)
    assert not reg.may_have_lapsed()
    clock.advance(0.01)
    assert reg.may_have_lapsed()
    reg._keeper.step()
    assert not reg.may_have_lapsed()


def test_a_slow_keep_alive_reply_fences_before_etcd_could_expire_the_lease() -> None:
    clock = FakeClock()
    kv = FakeKV(clock)
    reg = _registration(kv, clock)
    sent_s = clock()
    kv.refresh_takes_s = 1.9  # the reply comes 1.9 s after the send; the TTL is 2 s
    reg._keeper.step()
    # etcd may have renewed the lease the instant it was sent: it may expire at sent + 2 s.
    assert clock() < sent_s + 2
    assert reg.may_have_lapsed()


def test_a_keep_alive_answered_after_its_timeout_counts_from_its_own_send() -> None:
    """An overloaded etcd or process answers late: the lease was renewed at that request,
    so the holder's fence counts from its send, not from the last answer in time."""
    clock = FakeClock()
    kv = FakeKV(clock)  # ttl 2, request timeout 1: fenced 1 s after a send
    reg = _registration(kv, clock)
    reg._keeper.step()  # answered in time at 1000.0
    clock.advance(0.5)
    kv.refresh_times_out = True
    reg._keeper.step()  # sent at 1000.5, no answer within the timeout
    clock.advance(0.6)
    assert reg.may_have_lapsed()  # 1.1 s after the last answered send
    (late,) = kv.late
    late()  # its answer comes now: etcd renewed the lease at (or after) 1000.5
    assert not reg.may_have_lapsed()
    clock.advance(0.4)
    assert reg.may_have_lapsed()  # 1 s after that send, as for an answer in time


def test_a_leadership_is_not_held_past_the_fence_point_of_its_last_answered_send() -> None:
    clock = FakeClock()
    kv = FakeKV(clock)
    lease_id = kv.grant(2)
    lead = Leadership(
        kv,  # type: ignore[arg-type]
        "/elasticpp/j/leader",
        "n1",
        2,
        lease_id,
        7,
        None,
        granted_at_s=clock(),
        clock=clock,
        start=False,
    )
    kv.refresh_takes_s = 1.9
    lead._keeper.step()
    assert not lead.is_held()


def test_a_lost_membership_lease_fences_at_once_until_the_key_is_re_put() -> None:
    clock = FakeClock()
    kv = FakeKV(clock)
    reg = _registration(kv, clock)
    kv.revoke(reg.lease_id)  # lost: its key is gone with it
    kv.grant_fails = 1  # and etcd does not answer the first new grant
    reg._keeper.step()
    assert reg.may_have_lapsed()  # no TTL wait: the lease is known lost
    reg._keeper.step()  # granted
    assert reg.may_have_lapsed()  # the key is not re-put yet
    reg._keeper.step()  # re-put
    assert not reg.may_have_lapsed()
    assert kv.keys[KEY].lease_id == reg.lease_id and _incarnation(kv) == "inc-a"


def test_a_lost_leader_lease_ends_the_term_at_once() -> None:
    clock = FakeClock()
    kv = FakeKV(clock)
    lost: list[bool] = []
    lead = Leadership(
        kv,  # type: ignore[arg-type]
        "/elasticpp/j/leader",
        "n1",
        2,
        kv.grant(2),
        7,
        lambda: lost.append(True),
        granted_at_s=clock(),
        clock=clock,
        start=False,
    )
    kv.revoke(lead.lease_id)
    lead._keeper.step()
    assert not lead.is_held() and lost == [True]


def test_a_re_put_never_overwrites_another_incarnations_key(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    kv = FakeKV(clock)
    reg = _registration(kv, clock)
    kv.revoke(reg.lease_id)
    other = kv.grant(2)
    kv.put(KEY, json.dumps({"node_id": "n1", "incarnation": "inc-b"}), other)
    with caplog.at_level(logging.ERROR, logger="elasticpp.cluster.client"):
        reg._keeper.step()  # lease lost: granted anew
        reg._keeper.step()  # the key is another agent's: not re-put
    assert _incarnation(kv) == "inc-b" and kv.keys[KEY].lease_id == other
    assert reg.conflict is not None and "another agent with the same node id" in reg.conflict
    assert reg.may_have_lapsed()
    assert any("another agent with the same node id" in r.message for r in caplog.records)
    assert not reg.update({"address": "y"})  # nor does an info update write over it
    assert _incarnation(kv) == "inc-b"


def test_a_re_put_whose_answer_was_lost_finds_its_own_key_and_holds() -> None:
    clock = FakeClock()
    kv = FakeKV(clock)
    reg = _registration(kv, clock)
    kv.revoke(reg.lease_id)
    reg._keeper.step()  # granted
    kv.put(KEY, reg._current(), reg.lease_id)  # applied by etcd, the answer lost on the way
    reg._keeper.step()  # the key already holds this incarnation on this lease
    assert reg.conflict is None and not reg.may_have_lapsed()


def test_a_keeper_whose_loop_stalls_stops_renewing_and_says_so_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    kv = FakeKV(clock)
    stalled_s = [0.0]
    reg = _registration(kv, clock, gate=ProgressGate(lambda: stalled_s[0], 5.0))
    reg._keeper.step()
    assert kv.refreshes == 1
    stalled_s[0] = 7.0
    with caplog.at_level(logging.WARNING, logger="elasticpp.cluster.client"):
        for _ in range(3):
            reg._keeper.step()
    assert kv.refreshes == 1  # not renewed while the loop stalls
    stall_lines = [r.message for r in caplog.records if "stalled" in r.message]
    assert stall_lines == ["node n1: decision loop stalled 7 s: membership lease not renewed"]
    clock.advance(1.0)
    assert reg.may_have_lapsed()
    stalled_s[0] = 0.0
    reg._keeper.step()
    assert kv.refreshes == 2 and not reg.may_have_lapsed()


def test_a_progress_gate_refuses_a_stall_limit_that_is_not_positive() -> None:
    with pytest.raises(ConfigError, match="stall_limit_s"):
        ProgressGate(lambda: 0.0, 0.0)
