"""The agent's side of its leases (constructed agent, fakes of its registration and
leadership): renewal follows the decision loop's heartbeat, an agent whose node id another
agent took over exits with an error, and a leader plans only while it sees itself a member."""

from __future__ import annotations

from pathlib import Path

import pytest

from elasticpp.agent.kernel.clock import LoopHeartbeat
from elasticpp.agent.kernel.limits import LEASE_STALL_S, LOOP_STALL_S, QUIET_TICK_S
from elasticpp.agent.membership.shell import Membership, MembershipPorts
from elasticpp.agent.node import Agent, AgentConfig
from elasticpp.cluster.errors import NodeIdConflictError
from elasticpp.cluster.leases import ProgressGate
from tests.agents import SPEC
from tests.fakes import FakeCluster, FakeRegistration, Term


def _agent(tmp_path: Path) -> tuple[Agent, FakeRegistration]:
    """An agent whose registration is a fake: taken, not yet its lease's answers."""
    registration = FakeRegistration()
    agent = Agent(
        AgentConfig("n0", ("127.0.0.1:1",), "127.0.0.1:0", 2, tmp_path),
        SPEC,
        cluster=FakeCluster(registration=registration),
    )
    agent.membership.take_lease()
    return agent, registration


def test_the_lease_gate_follows_the_decision_loops_heartbeat() -> None:
    now = [1000.0]
    heartbeat = LoopHeartbeat(lambda: now[0])
    cluster = FakeCluster()
    membership = Membership(
        "n0",
        "inc",
        SPEC,
        cluster=cluster,
        heartbeat=heartbeat,
        ports=MembershipPorts(
            newest_epoch=lambda: 0,
            set_epoch=lambda _: None,
            spawn_warm=lambda: None,
            address=lambda: "127.0.0.1:1",
            slots=lambda: 1,
            draining=lambda: False,
            members=dict,
            on_watch=lambda _: None,
        ),
    )
    membership.take_lease()
    assert cluster.member_records(["n0"])["n0"]["incarnation"] == "inc"
    gate = membership.lease_gate()
    heartbeat.busy()
    now[0] += 1.0
    assert gate.stalled_s() is None
    now[0] += 59.0  # the loop began a tick a minute ago and is still in it
    assert gate.stalled_s() == 60.0
    heartbeat.idle()
    assert gate.stalled_s() is None
    membership.close()
    assert cluster.member_records(["n0"]) == {}  # revoked: the key went with it
    cluster.close()


def test_a_loop_that_waits_for_work_is_not_stalled_however_long_it_waits() -> None:
    """A quiet follower sleeps up to QUIET_TICK_S between ticks, and longer than
    LEASE_STALL_S: only time inside a tick counts (its leases would lapse otherwise)."""
    now = [1000.0]
    heartbeat = LoopHeartbeat(lambda: now[0])
    gate = ProgressGate(heartbeat.stuck_s, LEASE_STALL_S)
    heartbeat.busy()
    now[0] += 0.01
    heartbeat.idle()  # the tick ended; the loop waits
    now[0] += 10 * max(QUIET_TICK_S, LEASE_STALL_S)
    assert heartbeat.stuck_s() == 0.0 and gate.stalled_s() is None
    heartbeat.busy()  # woken: a tick begins, and blocks
    now[0] += LEASE_STALL_S + 1.0
    assert gate.stalled_s() == LEASE_STALL_S + 1.0
    assert LOOP_STALL_S > LEASE_STALL_S  # the node stops renewing before it says NOT_SERVING


def test_a_starting_loop_counts_as_busy() -> None:
    """From construction to its first wait the loop is at work (joining, starting)."""
    now = [1000.0]
    heartbeat = LoopHeartbeat(lambda: now[0])
    now[0] += 7.0
    assert heartbeat.stuck_s() == 7.0


@pytest.mark.parametrize("how", ["lease lost, key taken", "key taken, lease alive"])
def test_an_agent_whose_node_id_another_agent_holds_exits_with_an_error(
    tmp_path: Path, how: str
) -> None:
    agent, registration = _agent(tmp_path)
    agent.view.state.members = {"n0": {"incarnation": agent.incarnation}}
    ticks: list[int] = []

    def tick() -> None:
        ticks.append(1)
        if len(ticks) == 2 and how == "lease lost, key taken":
            registration.conflict = "another agent with the same node id is registered"
        if len(ticks) == 2 and how == "key taken, lease alive":
            agent.view.state.members = {
                "n0": {"incarnation": "f00d"}
            }  # what the members read found
        if len(ticks) > 5:
            agent.control.state.exit_code = 0  # a bound, so that an agent that ignores it returns

    agent.tick = tick  # type: ignore[method-assign]
    with pytest.raises(NodeIdConflictError, match="another agent with the same node id"):
        agent.run()
    assert len(ticks) == 2
    assert any("another agent" in message for _, _, message, _ in agent.journal.log)


def test_a_leader_whose_own_membership_is_lost_or_unseen_does_not_plan(tmp_path: Path) -> None:
    agent, registration = _agent(tmp_path)
    agent.leader.begin_term(Term(), None)
    agent.view.state.leader = "n0"
    agent.view.state.members = {"n0": {"address": "a"}, "n1": {"address": "b"}}
    assert agent.leader.acting()
    registration.lapsed = True  # its lease is known lost, the key not re-put yet
    assert not agent.leader.acting()
    registration.lapsed = False
    agent.view.state.members = {
        "n1": {"address": "b"}
    }  # re-put, but not yet seen in a members read
    assert not agent.leader.acting()
