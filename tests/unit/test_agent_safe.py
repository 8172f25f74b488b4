"""The agent's part of the replication guarantee, on a constructed agent over an in-memory
etcd (FakeCluster, its cache included): commit records report anchors, the leader publishes
the safe step only when it rises, and every agent takes the published step as its store's
floor."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from elasticpp.agent.follower.step import GenerationProgress
from elasticpp.agent.kernel.decide import Phase
from elasticpp.agent.kernel.limits import SAFE_EVERY_S
from elasticpp.agent.leader.step import leader_safe_check
from elasticpp.agent.node import Agent, AgentConfig
from elasticpp.cluster.records import CommitRecord, GenerationRecord, SafeStep, dumps
from elasticpp.plan import Plan
from tests.agents import SPEC
from tests.agents import observed as _observed
from tests.agents import pp_plan as _plan
from tests.fakes import FakeCluster
from tests.stores import commit_replica_step, commit_step


def _published(cluster: FakeCluster) -> list[SafeStep]:
    """Every safe step written, in order."""
    return [SafeStep.from_dict(value) for _, value in cluster.puts(cluster.keys.safe)]


def _put_safe(cluster: FakeCluster, safe: SafeStep) -> None:
    """A safe step on record that this agent did not write (another leader's)."""
    cluster.memory.put(cluster.keys.safe, dumps({"generation": safe.generation, "step": safe.step}))


def _agent(tmp_path: Path) -> tuple[Agent, FakeCluster, GenerationProgress]:
    cluster = FakeCluster(cached_for="n0")
    agent = Agent(
        AgentConfig("n0", ("127.0.0.1:1",), "127.0.0.1:0", 1, tmp_path), SPEC, cluster=cluster
    )
    record = GenerationRecord(3, _plan(3).to_dict(), "n0", time.time(), resume_step=0)
    gs = GenerationProgress(record=record, plan=Plan.from_dict(record.plan), phase=Phase.RUNNING)
    agent.follower.state.gen = gs
    agent.leader.begin_term(cluster.lead("n0"), None)  # this node leads
    agent.leader.state.at(3, 0.0).resume_written = True  # the leader's: generation 3 resumed
    return agent, cluster, gs


def test_a_commit_record_reports_the_anchors_of_its_generation(tmp_path: Path) -> None:
    agent, cluster, _ = _agent(tmp_path)
    assert agent.store.retention.anchor_every == SPEC.replication_every == 1
    for step in (4, 5):
        commit_step(agent.store, step, generation=3)
        commit_replica_step(agent.store, "n1", step, generation=3)
    commit_replica_step(agent.store, "n2", 9, generation=2)  # another generation: not listed
    agent.durability.state.last_commit_step = 5
    agent.durability.record_commit(3)
    assert agent.durability.flush_records(timeout_s=10)  # put off the loop, by one writer
    assert cluster.commits.commit_records(3)["n0"] == CommitRecord(
        "n0", 3, 5, (5, 4), {"n1": (5, 4)}
    )


def _lead_safe_step(agent: Agent, gs: GenerationProgress, now_s: float) -> None:
    """The leader's safe-step check at `now_s` (monotonic), its actions applied."""
    obs = replace(_observed(agent, gs), now_s=now_s)
    agent.execute(leader_safe_check(agent.leader.state, obs))


def test_the_leader_publishes_the_safe_step_only_when_it_rises(tmp_path: Path) -> None:
    agent, cluster, gs = _agent(tmp_path)
    now = 1000.0  # the monotonic clock, given: no call depends on how fast the test runs
    cluster.commits.record_commit(3, "n0", 8, [8, 7, 6], {"n1": [7, 6]})
    cluster.commits.record_commit(3, "n1", 8, [8, 7, 6], {"n0": [6]})
    _lead_safe_step(agent, gs, now)
    assert _published(cluster) == [SafeStep(3, 6)]
    cluster.commits.record_commit(3, "n1", 8, [8, 7, 6], {"n0": [8, 7, 6]})
    _lead_safe_step(agent, gs, now + SAFE_EVERY_S * 0.9)
    assert _published(cluster) == [SafeStep(3, 6)]  # computed at most every SAFE_EVERY_S
    _lead_safe_step(agent, gs, now + SAFE_EVERY_S)
    assert _published(cluster) == [SafeStep(3, 6), SafeStep(3, 7)]
    _lead_safe_step(agent, gs, now + 2 * SAFE_EVERY_S)
    assert _published(cluster) == [SafeStep(3, 6), SafeStep(3, 7)]  # the same step: no write
    _put_safe(cluster, SafeStep(4, 1))  # a newer generation's, read back: no lower write
    cluster.commits.record_commit(3, "n0", 9, [9, 8, 7], {"n1": [9, 8, 7]})
    cluster.commits.record_commit(3, "n1", 9, [9, 8, 7], {"n0": [9, 8, 7]})
    _lead_safe_step(agent, gs, now + 3 * SAFE_EVERY_S)
    assert _published(cluster) == [SafeStep(3, 6), SafeStep(3, 7), SafeStep(4, 1)]


def test_every_agent_takes_the_published_safe_step_as_its_floor(tmp_path: Path) -> None:
    agent, cluster, _ = _agent(tmp_path)
    for step in range(1, 6):
        commit_step(agent.store, step, generation=3)
    assert agent.store.committed_steps() == [1, 2, 3, 4, 5]  # no floor known: anchors stay
    _put_safe(cluster, SafeStep(3, 4))
    agent.refresh_view()
    assert agent.store.floor == (3, 4) and agent.store.committed_steps() == [4, 5]
    gauge = agent.metrics.registry.get_sample_value("elasticpp_safe_step", agent.metrics.labels)
    assert gauge == 4
    _put_safe(cluster, SafeStep(3, 2))  # an older value (a stale read): the floor stays
    agent.view.state.safe_read_s = 0.0
    agent.refresh_view()
    assert agent.store.floor == (3, 4)
