"""The agent across job epochs (pure logic: a constructed agent, a fake of the cluster calls
it makes here): a fresh etcd state does not make a job that holds state start over, and an
agent whose epoch is gone stops so that a restart joins the new one."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from elasticpp.agent.decide import Phase
from elasticpp.agent.follower.step import _GenState
from elasticpp.agent.node import Agent, AgentConfig
from elasticpp.agent.view.step import EPOCH_ENDED_EXIT
from elasticpp.cluster.errors import ClusterUnavailableError
from elasticpp.cluster.records import GenerationRecord, JobEpoch
from elasticpp.plan import Plan
from tests.fakes import Term
from tests.unit.test_agent_done import SPEC, _plan, lead_resume
from tests.unit.test_store_local import commit_step


class _FreshCluster:
    """etcd state that started afresh: no commit records, a job epoch as given."""

    def __init__(self, epoch: JobEpoch | None) -> None:
        self.resumes: list[Any] = []
        self.waits: list[tuple[int, str]] = []
        self.down = False  # etcd unreachable: the wait cannot be published
        self.stored_epoch = epoch

    def ever_committed(self) -> bool:
        return False

    def write_resume(self, generation: int, value: Any, leader: Any) -> bool:
        self.resumes.append(value)
        return True

    def write_resume_wait(self, generation: int, why: str, leader: Any) -> bool:
        if self.down:
            raise ClusterUnavailableError("etcd down")
        self.waits.append((generation, why))
        return True

    def epoch(self) -> JobEpoch | None:
        return self.stored_epoch


def _agent(tmp_path: Path, cluster: Any = None) -> Agent:
    agent = Agent(
        AgentConfig("n0", ("127.0.0.1:1",), "127.0.0.1:0", 2, tmp_path), SPEC, cluster=cluster
    )
    agent.view.state.members = {"n0": {"address": "127.0.0.1:1", "incarnation": agent.incarnation}}
    agent.leader.begin_term(Term(), None)  # this node leads
    return agent


def test_a_fresh_etcd_state_does_not_start_over_a_job_whose_nodes_hold_earlier_epochs(
    tmp_path: Path,
) -> None:
    cluster = _FreshCluster(JobEpoch(2, "n0", time.time()))
    agent = _agent(tmp_path, cluster)
    agent.store.set_epoch(1)
    # The node holds step 40 of epoch 1, but not every unit of the model: no step resolves.
    commit_step(agent.store, 40, generation=7)
    agent.store.set_epoch(2)
    record = GenerationRecord(1, _plan(1).to_dict(), "n0", time.time())
    gs = _GenState(record=record, plan=Plan.from_dict(record.plan), phase=Phase.MOVING)
    holdings = agent.store.holdings().to_dict()
    agent.view.state.barriers = {"stopped-1": {"n0": {"holdings": holdings, "next_step": 41}}}
    cluster.down = True
    with pytest.raises(ClusterUnavailableError):
        lead_resume(agent, gs)
    assert (
        cluster.resumes == [] and not agent.leader.state.resume_written
    )  # before: resumed at step 0
    assert "does not start over" in agent.leader.state.last_wait
    # The followers learn it from etcd (they wait instead of failing the generation): asked
    # again until etcd has it, then not again.
    cluster.down = False
    lead_resume(agent, gs)
    lead_resume(agent, gs)
    [(generation, why)] = cluster.waits
    assert generation == 1 and "does not start over" in why
    assert sum("cannot resume" in e[2] for e in agent.journal.log) == 1  # logged once
    # Nothing held anywhere, nothing committed in etcd: a fresh job starts at step 0.
    agent.view.state.barriers = {"stopped-1": {"n0": {"holdings": {**holdings, "steps": []}}}}
    lead_resume(agent, gs)
    assert [r["step"] for r in cluster.resumes] == [0]


def test_an_agent_whose_job_epoch_is_gone_stops_with_the_epoch_exit_status(
    tmp_path: Path,
) -> None:
    cluster = _FreshCluster(JobEpoch(5, "n1", time.time()))
    agent = _agent(tmp_path, cluster)
    agent.store.set_epoch(5)
    agent.view.epoch_changed.raise_()
    agent.view.check_epoch()
    assert agent._exit_requested() is None  # the same epoch: nothing to do
    assert not agent.view.epoch_changed.is_raised()
    cluster.stored_epoch = None  # the job's prefix was deleted
    agent.view.check_epoch()
    assert agent._exit_requested() == EPOCH_ENDED_EXIT
    assert any("started afresh" in e[2] for e in agent.journal.log)
