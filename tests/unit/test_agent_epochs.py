"""The agent across job epochs (pure logic: a constructed agent, a fake of the cluster calls
it makes here): a fresh etcd state does not make a job that holds state start over, and an
agent whose epoch is gone stops so that a restart joins the new one."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from elasticpp.agent.follower.step import GenerationProgress
from elasticpp.agent.kernel.decide import Phase
from elasticpp.agent.node import Agent, AgentConfig
from elasticpp.agent.view.step import EPOCH_ENDED_EXIT
from elasticpp.cluster.barriers import RESUME_MEMBER, RESUME_WAIT_MEMBER
from elasticpp.cluster.errors import ClusterUnavailableError
from elasticpp.cluster.records import GenerationRecord
from elasticpp.plan import Plan
from tests.agents import SPEC, lead_resume
from tests.agents import dp_plan as _plan
from tests.fakes import FakeCluster
from tests.stores import commit_step


def _fresh(epoch: int, by: str) -> FakeCluster:
    """etcd state that started afresh: no commit records, the job epoch `epoch` by `by`."""
    cluster = FakeCluster()
    cluster.epoch_if_absent(epoch, by)
    return cluster


def _resumes(cluster: FakeCluster, generation: int) -> list[Any]:
    """The resume instructions written for `generation`, in order."""
    key = cluster.keys.barrier(f"resume-{generation}", RESUME_MEMBER)
    return [v["value"] for k, v in cluster.puts(key) if k == key]


def _agent(tmp_path: Path, cluster: FakeCluster) -> Agent:
    agent = Agent(
        AgentConfig("n0", ("127.0.0.1:1",), "127.0.0.1:0", 2, tmp_path), SPEC, cluster=cluster
    )
    agent.view.state.members = {"n0": {"address": "127.0.0.1:1", "incarnation": agent.incarnation}}
    term = cluster.campaign("n0", 30)  # this node leads
    assert term is not None
    agent.leader.begin_term(term, None)
    return agent


def test_a_fresh_etcd_state_does_not_start_over_a_job_whose_nodes_hold_earlier_epochs(
    tmp_path: Path,
) -> None:
    cluster = _fresh(2, "n0")
    agent = _agent(tmp_path, cluster)
    agent.store.set_epoch(1)
    # The node holds step 40 of epoch 1, but not every unit of the model: no step resolves.
    commit_step(agent.store, 40, generation=7)
    agent.store.set_epoch(2)
    record = GenerationRecord(1, _plan(1).to_dict(), "n0", time.time())
    gs = GenerationProgress(record=record, plan=Plan.from_dict(record.plan), phase=Phase.MOVING)
    holdings = agent.store.holdings().to_dict()
    agent.view.state.barriers = {"stopped-1": {"n0": {"holdings": holdings, "next_step": 41}}}
    cluster.memory.down = True
    with pytest.raises(ClusterUnavailableError):
        lead_resume(agent, gs)
    assert (
        _resumes(cluster, 1) == [] and not agent.leader.state.resume_written
    )  # before: resumed at step 0
    assert "does not start over" in agent.leader.state.last_wait
    # The followers learn it from etcd (they wait instead of failing the generation): asked
    # again until etcd has it, then not again.
    cluster.memory.down = False
    lead_resume(agent, gs)
    lead_resume(agent, gs)
    [(_, wait)] = cluster.puts(cluster.keys.barrier("resume-1", RESUME_WAIT_MEMBER))
    assert "does not start over" in wait["value"]["why"]
    assert sum("cannot resume" in e[2] for e in agent.journal.log) == 1  # logged once
    # Nothing held anywhere, nothing committed in etcd: a fresh job starts at step 0.
    agent.view.state.barriers = {"stopped-1": {"n0": {"holdings": {**holdings, "steps": []}}}}
    lead_resume(agent, gs)
    assert [r["step"] for r in _resumes(cluster, 1)] == [0]
    cluster.close()


def test_an_agent_whose_job_epoch_is_gone_stops_with_the_epoch_exit_status(
    tmp_path: Path,
) -> None:
    cluster = _fresh(5, "n1")
    agent = _agent(tmp_path, cluster)
    agent.store.set_epoch(5)
    agent.view.epoch_changed.raise_()
    agent.view.check_epoch()
    assert agent.exit_requested() is None  # the same epoch: nothing to do
    assert not agent.view.epoch_changed.is_raised()
    cluster.memory.delete_prefix(cluster.keys.root)  # the job's prefix was deleted
    agent.view.check_epoch()
    assert agent.exit_requested() == EPOCH_ENDED_EXIT
    assert any("started afresh" in e[2] for e in agent.journal.log)
    cluster.close()
