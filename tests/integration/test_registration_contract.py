"""The registration port's contract (membership.shell.RegistrationPort): the unit tests'
`FakeRegistration` and the real `Registration` on a real etcd answer alike in each state a
test puts the fake in: fresh, taken over by another agent with the same node id, and with
etcd unreachable. What the membership's unit tests learn from the fake holds for etcd as far
as these cases go."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from elasticpp.agent.membership.shell import RegistrationPort
from elasticpp.cluster.errors import ClusterUnavailableError
from elasticpp.cluster.etcd.kv import EtcdKV
from elasticpp.cluster.etcd.server import EtcdServer
from elasticpp.cluster.leases import Registration
from elasticpp.waiting import wait_until
from tests.fakes import FakeRegistration

KEY = "/contract/registration/members/n0"
TTL_S = 3  # the keeper's keep-alive every ~0.7 s with a 1 s request timeout


class _Subject:
    """One implementation, and how a case puts it in a state."""

    def __init__(self, port: RegistrationPort, *, take_over: Callable[[], None],
                 cut_off: Callable[[], None]) -> None:  # fmt: skip
        self.port = port
        self.take_over = take_over  # another agent with this node id holds the key now
        self.cut_off = cut_off  # etcd does not answer now


@pytest.fixture(params=["fake", "etcd"])
def subject(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[_Subject]:
    if request.param == "fake":
        fake = FakeRegistration()

        def take() -> None:
            fake.conflict = "another agent with the same node id is registered"

        def cut() -> None:
            fake.unreachable = True

        yield _Subject(fake, take_over=take, cut_off=cut)
        return
    server = EtcdServer(tmp_path / "etcd-data")
    server.start()
    kv = EtcdKV([server.endpoint], request_timeout_s=1.0)
    reg = Registration(kv, KEY, "n0", {"address": "a:1"}, TTL_S)

    def take_over() -> None:
        # This agent's lease lapses (revoked here, as a partition longer than the TTL
        # would), and a newer agent started with the same node id registers meanwhile.
        kv.revoke(reg.lease_id)
        other = kv.grant(30)
        kv.put(KEY, json.dumps({"node_id": "n0", "incarnation": "f00d"}), other)
        assert wait_until(lambda: reg.conflict is not None, 15), "the keeper saw no conflict"

    try:
        yield _Subject(reg, take_over=take_over, cut_off=server.stop)
    finally:
        reg.close(revoke=False)
        kv.close()
        server.close()


@pytest.mark.timeout(60)
def test_a_fresh_registration_is_held_and_takes_updates(subject: _Subject) -> None:
    reg = subject.port
    assert isinstance(reg.lease_id, int) and reg.lease_id != 0
    assert reg.conflict is None and not reg.may_have_lapsed()
    assert reg.update({"address": "a:1", "draining": True}) is True


@pytest.mark.timeout(60)
def test_a_key_taken_by_another_agent_fences_and_is_never_written_over(
    subject: _Subject,
) -> None:
    subject.take_over()
    reg = subject.port
    assert reg.conflict is not None and "same node id" in reg.conflict
    assert reg.may_have_lapsed()
    assert reg.update({"address": "a:1"}) is False


@pytest.mark.timeout(60)
def test_an_update_etcd_does_not_answer_raises_unavailable(subject: _Subject) -> None:
    subject.cut_off()
    with pytest.raises(ClusterUnavailableError):
        subject.port.update({"address": "a:1"})
