"""The agent's side of its leases (constructed agent, fakes of its registration and
leadership): renewal follows the decision loop's heartbeat, an agent whose node id another
agent took over exits with an error, and a leader plans only while it sees itself a member."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from elasticpp.agent.node import Agent, AgentConfig
from elasticpp.cluster.errors import NodeIdConflictError
from tests.unit.test_agent_done import SPEC


def _agent(tmp_path: Path) -> Agent:
    return Agent(AgentConfig("n0", ("127.0.0.1:1",), "127.0.0.1:0", 2, tmp_path), SPEC)


class _Registration:
    lease_id = 7  # the lease the member key is on

    def __init__(self, conflict: str | None = None, lapsed: bool = False) -> None:
        self.conflict = conflict
        self.lapsed = lapsed

    def may_have_lapsed(self) -> bool:
        return self.lapsed


class _Leadership:
    def is_held(self) -> bool:
        return True


def test_the_lease_gate_follows_the_decision_loops_heartbeat(tmp_path: Path) -> None:
    agent = _agent(tmp_path)
    gate = agent._lease_gate()
    agent._heartbeat_s = time.monotonic()
    assert gate.stalled_s() is None
    agent._heartbeat_s = time.monotonic() - 60.0  # the loop last ran a minute ago
    stalled_s = gate.stalled_s()
    assert stalled_s is not None and stalled_s >= 60.0


@pytest.mark.parametrize("how", ["lease lost, key taken", "key taken, lease alive"])
def test_an_agent_whose_node_id_another_agent_holds_exits_with_an_error(
    tmp_path: Path, how: str
) -> None:
    agent = _agent(tmp_path)
    agent._registration = _Registration()
    agent._vs.members = {"n0": {"incarnation": agent.incarnation}}
    ticks: list[int] = []

    def tick() -> None:
        ticks.append(1)
        if len(ticks) == 2 and how == "lease lost, key taken":
            agent._registration.conflict = "another agent with the same node id is registered"
        if len(ticks) == 2 and how == "key taken, lease alive":
            agent._vs.members = {"n0": {"incarnation": "f00d"}}  # what the members read found
        if len(ticks) > 5:
            agent._cs.exit_code = 0  # a bound, so that an agent that ignores it returns

    agent._tick = tick  # type: ignore[method-assign]
    with pytest.raises(NodeIdConflictError, match="another agent with the same node id"):
        agent.run()
    assert len(ticks) == 2
    assert any("another agent" in message for _, _, message, _ in agent._events)


def test_a_leader_whose_own_membership_is_lost_or_unseen_does_not_plan(tmp_path: Path) -> None:
    agent = _agent(tmp_path)
    agent._ls.leadership = _Leadership()
    agent._vs.leader = "n0"
    agent._registration = _Registration()
    agent._vs.members = {"n0": {"address": "a"}, "n1": {"address": "b"}}
    assert agent._is_leader()
    agent._registration.lapsed = True  # its lease is known lost, the key not re-put yet
    assert not agent._is_leader()
    agent._registration.lapsed = False
    agent._vs.members = {"n1": {"address": "b"}}  # re-put, but not yet seen in a members read
    assert not agent._is_leader()
