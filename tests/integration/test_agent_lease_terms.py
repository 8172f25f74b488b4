"""An agent's terms against a real etcd: a deposed leader that wins again first resigns its
old term (no keep-alive thread or lease outlives its term), driven through the agent's own
campaign step; and a real agent that comes back after its membership lapsed, to find another
agent registered under its node id, exits 2 saying so and leaves the other's key alone."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from elasticpp.agent.kernel.clock import ManualClock
from elasticpp.agent.leader.shell import RendezvousStore
from elasticpp.agent.leader.state import CAMPAIGN_SPREAD_MAX_S, campaign_spread_s
from elasticpp.agent.localcluster import LocalCluster, kill_tree
from elasticpp.agent.node import Agent, AgentConfig
from elasticpp.cluster.client import ClusterClient
from elasticpp.cluster.errors import LeaseNotFoundError
from elasticpp.cluster.etcd.server import EtcdServer
from elasticpp.cluster.keepers import kept
from elasticpp.cluster.records import GenerationRecord
from elasticpp.waiting import wait_until
from tests.agents import SPEC, SPEC_FIELDS


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def agent(tmp_path: Path, etcd: EtcdServer, request: pytest.FixtureRequest) -> Iterator[Agent]:
    """Node n0's agent, joined to etcd only for the calls the campaign step makes; on the
    test's `clock` if it asks for one."""
    made = Agent(
        AgentConfig("n0", (etcd.endpoint,), "127.0.0.1:0", 2, tmp_path),
        SPEC,
        cluster=ClusterClient([etcd.endpoint], SPEC.name, request_timeout_s=1.0),
        clock=request.getfixturevalue("clock") if "clock" in request.fixturenames else None,
    )
    made.torch_ready.set()  # as `start` sets it once torch is imported
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(RendezvousStore, "start", classmethod(lambda cls, host: None))  # no torch
        yield made
    made.shutdown()
    made.cluster.close()  # the agent leaves only a client it joined with (`start`)


def _leader_keepers(agent: Agent) -> int:
    """The leadership leases the agent's client keeps alive now."""
    assert agent.cluster is not None
    return kept(agent.cluster.reads.kv).count("leader n0 leader")


def _campaigns_until_won(agent: Agent) -> bool:
    """The campaign step, as the loop takes it while no leader is known (every busy tick),
    until this node leads: it campaigns after a draw within the spread for its job's size."""

    def won() -> bool:
        agent.leader.campaign()
        return agent.leader.leadership is not None

    return wait_until(won, CAMPAIGN_SPREAD_MAX_S + 5.0, interval_s=0.005)


@pytest.mark.timeout(30)
def test_a_node_that_lost_a_campaign_waits_a_spread_before_the_next(
    agent: Agent, etcd: EtcdServer, clock: ManualClock
) -> None:
    """Another node won; until this node's view reads the new leader's key, its busy ticks
    must not campaign again (each try grants a lease, tries the key and revokes the lease:
    every node of a 2,048-node job doing so 20 times a second was a storm of requests).
    On a clock the test moves: a spread of one node is 4 ms, less than a loaded machine
    takes for the ticks below."""
    assert agent.cluster is not None
    tries = []
    campaign = agent.cluster.campaign

    def counted(*args: object, **kwargs: object) -> object:
        tries.append(1)
        return campaign(*args, **kwargs)  # type: ignore[arg-type]

    agent.cluster.campaign = counted  # type: ignore[method-assign]
    with ClusterClient([etcd.endpoint], SPEC.name) as other:
        held = other.campaign("n9", ttl_s=SPEC.lease_ttl_s)
        assert held is not None
        try:
            agent.view.state.leader = None  # the view has not read n9's key yet
            spread_s = campaign_spread_s(1)
            agent.leader.campaign()  # draws its turn within the spread
            clock.advance(spread_s)
            agent.leader.campaign()
            assert len(tries) == 1 and agent.leader.leadership is None  # lost to n9
            for _ in range(40):  # busy ticks within the spread that follows
                clock.advance(spread_s / 50)
                agent.leader.campaign()
            assert len(tries) == 1
            clock.advance(spread_s)  # a spread later, still no leader seen: it tries again
            agent.leader.campaign()
            assert len(tries) == 2
        finally:
            held.resign()


@pytest.mark.timeout(30)
def test_a_deposed_leader_resigns_its_old_term_before_campaigning_again(
    agent: Agent, etcd: EtcdServer
) -> None:
    assert agent.cluster is not None
    agent.view.state.leader = None
    assert _campaigns_until_won(agent)
    first = agent.leader.leadership
    assert first is not None and _leader_keepers(agent) == 1
    with ClusterClient([etcd.endpoint], SPEC.name) as other:
        assert other.depose("n0")  # confirmed dead by a peer's probe, wrongly
    agent.view.state.leader = agent.cluster.leader()  # what the next refresh reads: no leader
    assert agent.view.state.leader is None
    agent.leader.campaign()  # lost the term
    assert agent.leader.leadership is None
    assert _campaigns_until_won(agent)  # then campaigns (after its draw) and wins again
    second = agent.leader.leadership
    assert second is not None and second is not first and agent.cluster.leader() == "n0"
    assert _leader_keepers(agent) == 1  # the old term's keep-alive ended
    with pytest.raises(LeaseNotFoundError):
        agent.cluster.reads.kv.refresh(first.lease_id)  # and its lease was revoked


@pytest.mark.timeout(240)
def test_an_agent_back_from_a_lapse_finds_its_node_id_taken_and_exits_2(
    tmp_path: Path, no_orphans: None
) -> None:
    spec = {**SPEC_FIELDS, "name": "ids", "steps": 100000, "lease_ttl_s": 3, "max_nodes": 2}
    lc = LocalCluster(tmp_path / "job", spec, nodes=1, slots=1)
    first = None
    try:
        lc.start()
        with ClusterClient([lc.etcd.endpoint], "ids") as c:

            def incarnation() -> str | None:
                node = c.members().nodes.get("node-0")
                return None if node is None else str(node["incarnation"])

            lc.wait_for(lambda: incarnation() is not None, 120, "node-0 registered")
            old = incarnation()
            first = lc.node("node-0").proc
            assert first is not None
            kill_tree(first.pid, signal.SIGSTOP)  # cut off: its lease lapses
            assert wait_until(lambda: incarnation() is None, 30)
            # A replacement started with the same node id (its own state dir) registers.
            lc.node("node-0").state_dir = tmp_path / "job" / "node-0-replacement"
            lc.start_node("node-0")
            assert wait_until(lambda: incarnation() not in (None, old), 120)
            new = incarnation()
            kill_tree(first.pid, signal.SIGCONT)  # the old agent comes back
            assert first.wait(timeout=60) == 2
            assert incarnation() == new  # the replacement's key was never overwritten
        log = lc.node("node-0").log_path.read_text()
        assert "another agent with the same node id is registered" in log
    finally:
        if first is not None and first.poll() is None:
            kill_tree(first.pid, signal.SIGCONT)
            kill_tree(first.pid)
            first.wait(timeout=10)
        lc.close()


@pytest.mark.timeout(30)
def test_a_new_term_starts_from_the_strikes_the_newest_record_carried(agent: Agent) -> None:
    agent.view.state.record = GenerationRecord(
        4, {}, "n9", time.time(), extra={"strikes": {"n5": 2}}
    )
    agent.view.state.leader = None
    assert _campaigns_until_won(agent)
    assert agent.leader.state.sick.strikes == {"n5": 2}
