"""Deadlines that grow with the job (elasticpp.agent.leader.deadlines, train.config): a 2,048-node
transition gets longer than a 4-node one, a small job keeps its old deadlines."""

from __future__ import annotations

from elasticpp.agent.kernel.limits import PULL_DEADLINE_S, STOPPED_WAIT_MARGIN_S
from elasticpp.agent.leader.deadlines import pull_deadline_s, stop_wait_s
from elasticpp.agent.leader.resume import stop_wait_step
from elasticpp.agent.leader.state import LeaderState
from elasticpp.agent.sick import SickNodes, SickPolicy
from elasticpp.train.config import rendezvous_timeout_s


def test_a_small_job_keeps_its_deadlines_and_a_large_one_gets_more() -> None:
    assert stop_wait_s(30.0, 4) - (30.0 + STOPPED_WAIT_MARGIN_S) < 0.01
    assert stop_wait_s(30.0, 2048) - stop_wait_s(30.0, 4) > 4.0
    assert pull_deadline_s(4) - PULL_DEADLINE_S < 0.1
    assert pull_deadline_s(2048) >= PULL_DEADLINE_S + 20.0
    assert rendezvous_timeout_s(60.0, 8) < 61.0
    assert rendezvous_timeout_s(60.0, 16384) >= 60.0 + 160.0


def _passed_at(nodes: int, after_s: float) -> bool:
    state = LeaderState(sick=SickNodes(SickPolicy()))
    stop_wait_step(state, 3, ["n9"], {}, now_s=0.0, wall_s=0.0, stop_timeout_s=10.0, nodes=nodes)
    passed, _ = stop_wait_step(
        state, 3, ["n9"], {}, now_s=after_s, wall_s=after_s, stop_timeout_s=10.0, nodes=nodes
    )
    return passed


def test_the_stopped_wait_of_2048_nodes_outlasts_that_of_4() -> None:
    after_s = 10.0 + STOPPED_WAIT_MARGIN_S + 1.0
    assert _passed_at(4, after_s)
    assert not _passed_at(2048, after_s)
    assert _passed_at(2048, after_s + 4.0)
