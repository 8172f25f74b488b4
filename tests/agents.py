"""What the agent's tests share: the jobs of constructed agents, their plans, worker handles
that never run a process, and the leader's steps applied as a turn applies them."""

from __future__ import annotations

from typing import Any

from elasticpp.agent.follower.step import GenerationProgress
from elasticpp.agent.jobspec import parse_job_spec
from elasticpp.agent.leader.step import (
    LeaderObservation,
    leader_resume_step,
    leader_timeline_step,
)
from elasticpp.agent.node import Agent
from elasticpp.cluster.records import QuarantineRecord
from elasticpp.plan import ClusterSpec, Layout, NodeSpec, Plan, build_plan, load_device_spec
from tests.fakes import FakeCluster, FakeRegistration

# One node, one tiny model: the job of every constructed agent here (and in the control
# tests on real gRPC).
SPEC_FIELDS: dict[str, Any] = {
    "name": "j",
    "model": "tiny",
    "global_batch": 4,
    "micro_batch": 2,
    "steps": 5,
    "seed": 0,
    "min_nodes": 1,
    "max_nodes": 1,
}
SPEC = parse_job_spec(SPEC_FIELDS)


def dp_plan(generation: int) -> Plan:
    """Two ranks (data parallel) on node n0."""
    cluster = ClusterSpec((NodeSpec("n0", 2),), load_device_spec("cpu"))
    return build_plan(
        SPEC.model, cluster, Layout(1, 1, 2), global_batch=4, micro_batch=2
    ).with_generation(generation)


def observed(agent: Agent, gs: GenerationProgress) -> LeaderObservation:
    """What the leader's step sees while this node's follower is in `gs`."""
    agent.follower.state.gen = gs
    return agent.leader.observation(agent.leader.cluster_view())


def lead_resume(agent: Agent, gs: GenerationProgress) -> None:
    """The leader's resume step for `gs` (elasticpp.agent.leader.step), its actions applied."""
    agent.executor.run(leader_resume_step(agent.leader.state, observed(agent, gs)))


def lead_timeline(agent: Agent, gs: GenerationProgress) -> None:
    """The leader's timeline step for `gs`, its actions applied."""
    agent.executor.run(leader_timeline_step(agent.leader.state, observed(agent, gs)))


class DeadProc:
    """A worker handle whose process has exited."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def alive(self) -> bool:
        return False


# Up to three nodes, short stop and readiness deadlines: the deadline tests' job.
SPEC3_FIELDS: dict[str, Any] = {
    "name": "j",
    "model": "tiny",
    "global_batch": 12,
    "micro_batch": 2,
    "steps": 5,
    "seed": 0,
    "min_nodes": 1,
    "max_nodes": 3,
    "stop_timeout_s": 5.0,
    "ready_timeout_s": 7.0,
}
SPEC3 = parse_job_spec(SPEC3_FIELDS)


def plan_over(generation: int, nodes: tuple[str, ...] = ("n0",)) -> Plan:
    """One rank on each of `nodes`, data parallel (SPEC3's batch)."""
    cluster = ClusterSpec(tuple(NodeSpec(n, 1) for n in nodes), load_device_spec("cpu"))
    return build_plan(
        SPEC3.model, cluster, Layout(1, 1, len(nodes)), global_batch=12, micro_batch=2
    ).with_generation(generation)


class StuckProc:
    """A worker handle whose process never goes away (uninterruptible sleep)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.kills: list[bool] = []

    def alive(self) -> bool:
        return True

    def kill(self, *, wait: bool = True) -> None:
        self.kills.append(wait)


class RegisteredCluster(FakeCluster):
    """The job's etcd in memory, this node's registration a fake (its lapse and its
    refusals are a test's to say)."""

    def __init__(self) -> None:
        super().__init__(registration=FakeRegistration())

    def quarantines(self) -> list[QuarantineRecord]:
        """The quarantines written, in order."""
        return [QuarantineRecord.from_dict(v) for _, v in self.puts(self.keys.quarantine_prefix)]


class SlowSpare:
    """A spare that never reports ready; killed when asked."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.killed = False

    def alive(self) -> bool:
        return not self.killed

    def kill(self, *, wait: bool = True) -> None:
        self.killed = True


def pp_plan(generation: int) -> Plan:
    """Two pipeline stages, on n0 and n1."""
    cluster = ClusterSpec((NodeSpec("n0", 1), NodeSpec("n1", 1)), load_device_spec("cpu"))
    return build_plan(
        SPEC.model, cluster, Layout(2, 1, 1), global_batch=4, micro_batch=2
    ).with_generation(generation)
