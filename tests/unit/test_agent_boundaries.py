"""One part's error never starves another, an out-of-order observation is ignored rather
than raised every tick, and ranks are handed to workers all or none (a constructed agent,
fake worker handles and a fake of the cluster calls it makes)."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import pytest

from elasticpp.agent.follower.step import GenerationProgress
from elasticpp.agent.kernel.decide import Phase
from elasticpp.agent.node import Agent, AgentConfig
from elasticpp.cluster.arrivals import Arrivals
from elasticpp.cluster.barriers import RESUME_MEMBER
from elasticpp.cluster.errors import ClusterUnavailableError
from elasticpp.cluster.reads import JobReads
from elasticpp.cluster.records import GenerationRecord
from elasticpp.errors import ConfigError
from elasticpp.plan import Plan
from elasticpp.train.worker.procs import WorkerError
from tests.agents import SPEC
from tests.agents import dp_plan as _plan
from tests.agents import plan_over as _plan_on
from tests.fakes import FakeCluster


class _RefusingArrivals(Arrivals):
    """etcd refuses the first write of one barrier (unreachable for a moment)."""

    def __init__(self, reads: JobReads, barrier: str) -> None:
        super().__init__(reads)
        self.refuse = barrier

    def arrive(
        self, barrier: str, node_id: str, value: Any = None, *, lease_id: int | None = None
    ) -> None:
        if barrier == self.refuse:
            self.refuse = ""
            raise ClusterUnavailableError("etcd: connection refused", fast=True)
        super().arrive(barrier, node_id, value, lease_id=lease_id)


class _RefusesOnce(FakeCluster):
    """etcd refuses the first write of one barrier (unreachable for a moment)."""

    def __init__(self, barrier: str) -> None:
        super().__init__()
        self.arrivals = _RefusingArrivals(self.reads, barrier)


def _agent(tmp_path: Path) -> tuple[Agent, FakeCluster]:
    return _agent_on(tmp_path, FakeCluster())


def _agent_on(tmp_path: Path, cluster: FakeCluster) -> tuple[Agent, FakeCluster]:
    agent = Agent(
        AgentConfig("n0", ("127.0.0.1:1",), "127.0.0.1:0", 2, tmp_path), SPEC, cluster=cluster
    )
    # A tick refills the warm pool: no real worker processes in a unit test (they outlived
    # it before, and a later test that counts the runner's children failed for them).
    agent.supervisor.spawn_warm = lambda: None  # type: ignore[method-assign]
    return agent, cluster


def _errors(agent: Agent, source: str) -> float:
    value = agent.metrics.registry.get_sample_value(
        "elasticpp_agent_errors_total", {**agent.metrics.labels, "source": source}
    )
    return value or 0.0


def test_an_error_in_one_part_does_not_starve_the_parts_after_it(tmp_path: Path) -> None:
    """Before, one exception ended the tick: a bad value that made the follower raise
    stopped the leader, the job's end and every drain, every tick, for good."""
    agent, _ = _agent(tmp_path)
    ran: list[str] = []
    agent.refresh_view = lambda: None  # type: ignore[method-assign]
    agent.health.read = lambda: None  # type: ignore[method-assign]
    agent.job_stop.read = lambda: None  # type: ignore[method-assign]
    agent.job_checkpoint.read = lambda: None  # type: ignore[method-assign]
    agent.view.reread.take()
    agent.view.state.last_refresh_s = time.monotonic()

    def broken() -> None:
        raise AttributeError("'NoneType' object has no attribute 'get'")

    agent.follower.step = broken  # type: ignore[method-assign]
    agent.lead = lambda: ran.append("leader")  # type: ignore[method-assign]
    agent.control_turn = lambda: ran.append("control")  # type: ignore[method-assign]
    for _ in range(3):
        agent.tick()
    assert ran == ["leader", "control"] * 3
    assert _errors(agent, "follower") == 3


def test_ranks_that_finish_after_their_node_reported_a_failure_still_finish_the_job(
    tmp_path: Path,
) -> None:
    """The review's A3: FAILED -> DONE raised TransitionError every tick; `done` was never
    written and no drain ever completed."""
    agent, cluster = _agent(tmp_path)
    record = GenerationRecord(1, _plan(1).to_dict(), "n0", time.time())
    gs = GenerationProgress(
        record=record, plan=Plan.from_dict(record.plan), phase=Phase.FAILED
    )  # the STARTING deadline fired
    for rank in (0, 1):
        agent.pool.rank_done(1, rank)  # then both ranks trained every step
    agent.follower.state.gen = gs
    agent.follower.step()
    assert gs.phase is Phase.DONE
    assert [(b, n) for b, n, _ in cluster.arrived()] == [("done", "n0")]


def test_an_observation_out_of_order_is_ignored_not_raised(tmp_path: Path) -> None:
    record = GenerationRecord(1, _plan(1).to_dict(), "n0", time.time())
    gs = GenerationProgress(record=record, plan=Plan.from_dict(record.plan), phase=Phase.DONE)
    assert not gs.enter(Phase.HALTED, time.monotonic())  # a late halt after the end
    assert gs.phase is Phase.DONE


def test_a_generation_whose_plan_this_build_cannot_read_is_not_followed(tmp_path: Path) -> None:
    """The review's A2: the agent switched to the new generation before parsing its plan,
    then raised on it every tick."""
    agent, cluster = _agent(tmp_path)
    current = GenerationRecord(2, _plan(2).to_dict(), "n0", time.time())
    agent.follower.state.gen = GenerationProgress(
        record=current, plan=Plan.from_dict(current.plan), phase=Phase.RUNNING
    )
    newer = GenerationRecord(3, {**_plan(3).to_dict(), "format_version": 99}, "n9", time.time())
    agent.view.state.record = newer
    agent.follower.step()
    assert agent.follower.generation == 2 and agent.follower.state.gen.phase is Phase.RUNNING
    assert cluster.skipped == [cluster.keys.generation]


class _Spare:
    def __init__(self, pid: int, *, dies: bool = False) -> None:
        self.pid = pid
        self.dies = dies
        self.assigned: list[dict[str, Any]] = []
        self.killed = False

    def alive(self) -> bool:
        return not (self.killed or self.dies)

    def assign(self, assignment: dict[str, Any]) -> None:
        if self.dies:
            raise WorkerError(f"worker {self.pid}: cannot write: [Errno 32] Broken pipe")
        self.assigned.append(assignment)

    def kill(self, *, wait: bool = True) -> None:
        self.killed = True


def test_ranks_are_handed_to_workers_all_or_none(tmp_path: Path) -> None:
    """The review's N7: a spare that died between `ready` and its assignment left rank 0
    running, the other spare orphaned, and the next tick assigned rank 0 again."""
    agent, cluster = _agent(tmp_path)
    record = GenerationRecord(2, _plan(2).to_dict(), "n0", time.time(), store_address="h:1234")
    gs = GenerationProgress(record=record, plan=Plan.from_dict(record.plan), phase=Phase.MOVING)
    agent.follower.state.gen = gs
    first, dead = _Spare(100), _Spare(101, dies=True)
    mine = gs.plan.ranks_on("n0")
    try:
        agent.follower.assign(gs, {"step": 0, "fetches": {}}, mine, [first, dead])  # type: ignore[list-item]
    except WorkerError:
        pass
    else:
        raise AssertionError("the assignment must fail")
    assert first.killed and agent.pool.workers() == ()  # no rank of this generation runs
    assert agent.pool.spares() == ()  # the dead spare does not go back to the pool

    untouched = _Spare(102)
    record = GenerationRecord(2, _plan(2).to_dict(), "n0", time.time(), store_address=None)
    gs = GenerationProgress(record=record, plan=Plan.from_dict(record.plan), phase=Phase.MOVING)
    try:
        agent.follower.assign(gs, {"step": 0, "fetches": {}}, mine, [untouched, _Spare(103)])  # type: ignore[list-item]
    except ConfigError as exc:
        assert "no rendezvous store address" in str(exc)
    else:
        raise AssertionError("a record without a store address cannot be followed")
    assert [p.pid for p in agent.pool.spares()] == [102, 103]  # handed back, never assigned
    assert not untouched.assigned and cluster.arrived() == []


def test_a_resume_step_past_the_jobs_end_is_refused_before_any_rank_is_sent(
    tmp_path: Path,
) -> None:
    """A resume instruction comes from etcd: one whose step the job cannot start from is
    refused by the typed assignment on the agent, naming the field, and no worker is sent
    it (before, a literal dict went to every worker, each failed on it alone)."""
    agent, _ = _agent(tmp_path)
    record = GenerationRecord(2, _plan(2).to_dict(), "n0", time.time(), store_address="h:1234")
    gs = GenerationProgress(record=record, plan=Plan.from_dict(record.plan), phase=Phase.MOVING)
    agent.follower.state.gen = gs
    spares = [_Spare(200), _Spare(201)]
    past = agent.spec.steps + 1
    with pytest.raises(ConfigError, match="start_step"):
        agent.follower.assign(gs, {"step": past}, gs.plan.ranks_on("n0"), spares)  # type: ignore[arg-type]
    assert [p.pid for p in agent.pool.spares()] == [200, 201]  # handed back, never assigned
    assert not any(p.assigned for p in spares) and agent.pool.workers() == ()


def _follow_through_a_refused_write(agent: Agent) -> None:
    try:
        agent.follower.step()
    except ClusterUnavailableError:
        pass  # the loop's boundary takes it (etcd down); the next tick follows again
    else:
        raise AssertionError("the write must have been refused")
    agent.follower.step()


def test_a_spare_whose_started_write_etcd_refused_writes_it_again(tmp_path: Path) -> None:
    """Before, a spare entered IDLE before it wrote `started-G`: a write refused by etcd
    was never made again, and the leader waited for the spare's arrival for good (no
    timeline, no reset of the re-plan budget)."""
    agent, cluster = _agent_on(tmp_path, _RefusesOnce("started-2"))
    record = GenerationRecord(2, _plan_on(2, ("n1",)).to_dict(), "n1", time.time())
    agent.follower.state.gen = gs = GenerationProgress(
        record=record, plan=Plan.from_dict(record.plan), phase=Phase.MOVING
    )
    agent.view.state.barriers = {"resume-2": {RESUME_MEMBER: {"step": 0, "fetches": {}}}}
    _follow_through_a_refused_write(agent)
    assert gs.phase is Phase.IDLE
    assert [(b, n) for b, n, _ in cluster.arrived()] == [("started-2", "n0")]


def test_a_finish_whose_done_write_etcd_refused_writes_it_again(tmp_path: Path) -> None:
    """Before, the node entered DONE before it wrote `done`: a write refused by etcd was
    never made again, and the job's end waited on it."""
    agent, cluster = _agent_on(tmp_path, _RefusesOnce("done"))
    record = GenerationRecord(1, _plan(1).to_dict(), "n0", time.time())
    agent.follower.state.gen = gs = GenerationProgress(
        record=record, plan=Plan.from_dict(record.plan), phase=Phase.RUNNING
    )
    for rank in (0, 1):
        agent.pool.rank_done(1, rank)
    _follow_through_a_refused_write(agent)
    assert gs.phase is Phase.DONE
    assert [(b, n) for b, n, _ in cluster.arrived()] == [("done", "n0")]


def test_holdings_refused_by_etcd_are_reported_again_before_moving(tmp_path: Path) -> None:
    agent, cluster = _agent_on(tmp_path, _RefusesOnce("stopped-2"))
    record = GenerationRecord(2, _plan(2).to_dict(), "n0", time.time())
    agent.follower.state.gen = gs = GenerationProgress(
        record=record, plan=Plan.from_dict(record.plan)
    )
    with contextlib.suppress(ClusterUnavailableError):
        agent.follower.step()
    assert gs.phase is Phase.STOPPING and cluster.arrived() == []  # not reported: stays
    agent.follower.step()
    assert gs.phase is Phase.MOVING
    assert [(b, n) for b, n, _ in cluster.arrived()] == [("stopped-2", "n0")]
