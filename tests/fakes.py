"""Fakes shared by the unit tests, for the pure logic around the agent's ports (the real
things are tested against etcd and real processes in tests/integration)."""

from __future__ import annotations

from elasticpp.cluster.errors import ClusterUnavailableError


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
    `unreachable`: etcd does not take an update now (the keeper re-puts it later)."""

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
        return self.lapsed

    def update(self, info: dict[str, object]) -> bool:
        self.updates.append(dict(info))
        if self.unreachable:
            raise ClusterUnavailableError("etcd timed out")
        return True

    def close(self, *, revoke: bool = True) -> None:
        self.revoked = revoke


class Registrar:
    """The cluster port's `register`: it hands out `registration` (a test's fake), with the
    member record it was registered with as its first update."""

    def __init__(self, registration: FakeRegistration | None = None) -> None:
        self.registration = registration or FakeRegistration()

    def register(
        self, node_id: str, info: dict[str, object], ttl_s: float, gate: object
    ) -> FakeRegistration:
        self.registration.updates.append(dict(info))
        return self.registration
