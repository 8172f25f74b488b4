"""Fakes shared by the unit tests, for the pure logic around the agent's ports (the real
things are tested against etcd and real processes in tests/integration)."""

from __future__ import annotations


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
