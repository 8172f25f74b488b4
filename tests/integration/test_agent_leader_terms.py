"""A leader's terms against a real etcd, driven through the agent's own campaign step: a
deposed leader that wins again first resigns its old term (no keep-alive thread or lease
outlives its term)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from elasticpp.agent.node import Agent, AgentConfig
from elasticpp.cluster import ClusterClient, LeaseNotFoundError
from elasticpp.cluster.etcd_server import EtcdServer
from tests.unit.test_agent_done import SPEC


@pytest.fixture
def agent(tmp_path: Path, etcd: EtcdServer) -> Iterator[Agent]:
    """Node n0's agent, joined to etcd only for the calls the campaign step makes."""
    made = Agent(AgentConfig("n0", (etcd.endpoint,), "127.0.0.1:0", 2, tmp_path), SPEC)
    made.cluster = ClusterClient([etcd.endpoint], SPEC.name, request_timeout_s=1.0)
    made._torch_ready.set()
    made._start_rendezvous_store = lambda: None  # type: ignore[method-assign]  # no torch
    yield made
    made.shutdown()


def _leader_keepers() -> int:
    return sum(t.name == "lease-leader n0" and t.is_alive() for t in threading.enumerate())


@pytest.mark.timeout(30)
def test_a_deposed_leader_resigns_its_old_term_before_campaigning_again(
    agent: Agent, etcd: EtcdServer
) -> None:
    assert agent.cluster is not None
    agent._leader = None
    agent._maybe_campaign()
    first = agent._leadership
    assert first is not None and _leader_keepers() == 1
    with ClusterClient([etcd.endpoint], SPEC.name) as other:
        assert other.depose("n0")  # confirmed dead by a peer's probe, wrongly
    agent._leader = agent.cluster.leader()  # what the next refresh reads: no leader
    assert agent._leader is None
    for _ in range(2):  # lost the term; then campaigns and wins again
        agent._maybe_campaign()
    second = agent._leadership
    assert second is not None and second is not first and agent.cluster.leader() == "n0"
    assert _leader_keepers() == 1  # the old term's keep-alive ended
    with pytest.raises(LeaseNotFoundError):
        agent.cluster._kv.refresh(first.lease_id)  # and its lease was revoked
