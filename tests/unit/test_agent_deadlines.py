"""Every wait of the agent has a deadline, a sick node is set aside, an ended job stays ended
(a constructed agent, fake worker handles and a fake of the cluster calls it makes)."""

from __future__ import annotations

import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from elasticpp.agent.follower.step import FetchOutcome, GenerationProgress
from elasticpp.agent.health.step import EXIT_FAILED, EXIT_HALTED
from elasticpp.agent.kernel.clock import Clock, ManualClock
from elasticpp.agent.kernel.decide import Phase, WorkerState
from elasticpp.agent.kernel.limits import STOPPED_WAIT_MARGIN_S
from elasticpp.agent.kernel.pool import Worker
from elasticpp.agent.node import Agent, AgentConfig
from elasticpp.cluster.health import JobEnd
from elasticpp.cluster.records import GenerationRecord
from elasticpp.plan import Plan
from elasticpp.store.resume import TransferProgress
from tests.agents import SPEC3 as SPEC
from tests.agents import RegisteredCluster as _Cluster
from tests.agents import SlowSpare as _SlowSpare
from tests.agents import StuckProc as _StuckProc
from tests.agents import lead_resume
from tests.agents import plan_over as _plan
from tests.fakes import FakeCluster


def _term(cluster: FakeCluster) -> Any:
    """This node's term as leader, won in the job's etcd (close the cluster at the end)."""
    term = cluster.campaign("n0", 30)
    assert term is not None
    return term


def _agent(tmp_path: Path, clock: Clock | None = None, **cfg: Any) -> tuple[Agent, _Cluster]:
    cluster = _Cluster()
    agent = Agent(
        AgentConfig("n0", ("127.0.0.1:1",), "127.0.0.1:0", 1, tmp_path, **cfg),
        SPEC,
        clock=clock,
        cluster=cluster,
    )
    return agent, cluster


def test_a_worker_that_survives_sigkill_never_blocks_the_loop_and_fails_the_node(
    tmp_path: Path,
) -> None:
    """Before, every tick called a kill that waited 10 s for the process, for ever."""
    agent, cluster = _agent(tmp_path)
    old = _StuckProc(100)
    agent.pool.add_worker(
        Worker(
            proc=old,  # type: ignore[arg-type]
            rank=0,
            generation=1,
            plan=_plan(1),
            state=WorkerState.RUNNING,
        )
    )
    record = GenerationRecord(2, _plan(2).to_dict(), "n0", time.time())
    gs = GenerationProgress(record=record, plan=Plan.from_dict(record.plan))  # a loss: stop at once
    agent.follower.state.gen = gs
    agent.follower.step()
    assert old.kills == [False]  # signalled, not waited for
    assert gs.phase is Phase.STOPPING and cluster.arrived() == []
    assert gs.killed_at_s is not None
    gs.killed_at_s -= SPEC.stop_timeout_s + 1  # the stop deadline passes
    agent.follower.step()
    assert gs.phase is Phase.FAILED
    [(barrier, node, report)] = cluster.arrived()
    assert (barrier, node) == ("failed-2", "n0")
    assert report["culprit"] and report["severe"]
    assert "still alive" in report["reason"] and "100" in report["reason"]


def test_a_spare_that_never_becomes_ready_is_replaced_and_fails_a_generation_that_needs_it(
    tmp_path: Path,
) -> None:
    agent, cluster = _agent(tmp_path)
    spare = _SlowSpare(200)
    start = time.monotonic()
    agent.pool.add_spare(spare, start)  # type: ignore[arg-type]
    agent.supervisor.spawn_warm = lambda: None  # type: ignore[method-assign]
    record = GenerationRecord(2, _plan(2).to_dict(), "n0", time.time())
    gs = GenerationProgress(record=record, plan=Plan.from_dict(record.plan), phase=Phase.MOVING)
    fetched: Future[FetchOutcome] = Future()
    fetched.set_result(FetchOutcome(done_at=time.time()))
    agent.follower.track_fetch(2, fetched, TransferProgress())
    agent.follower.state.gen = gs
    agent.view.state.barriers = {"resume-2": {"resume": {"step": 0, "fetches": {}}}}
    agent.executor.run(agent.supervisor.step())
    assert agent.pool.spares() == (spare,)  # within ready_timeout_s
    agent.follower.step()
    assert gs.phase is Phase.MOVING and cluster.arrived() == []  # waits for it
    agent.pool.drop_spare(spare)  # type: ignore[arg-type]
    agent.pool.add_spare(spare, start - SPEC.ready_timeout_s - 1)  # type: ignore[arg-type]
    agent.executor.run(agent.supervisor.step())
    assert spare.killed and agent.pool.spares() == ()
    agent.follower.step()
    assert gs.phase is Phase.FAILED
    [(barrier, _node, report)] = cluster.arrived()
    assert barrier == "failed-2" and report["culprit"] and report["severe"]
    assert "not ready within 7 s" in report["reason"]


def test_the_leader_sets_aside_a_node_that_never_arrives_and_plans_without_it(
    tmp_path: Path,
) -> None:
    """Before, the leader waited for every live node's `stopped-G` for ever (a wedged agent
    keeps its lease and answers probes)."""
    clock = ManualClock()
    agent, cluster = _agent(tmp_path, clock=clock)
    agent.leader.begin_term(_term(cluster), None)
    agent.view.state.leader = "n0"
    agent.view.state.members = {
        n: {"address": "127.0.0.1:1", "slots": 1, "incarnation": f"i{n}"}
        for n in ("n0", "n1", "n2")
    }
    plan = _plan(2, ("n0", "n1", "n2"))
    nodes = {n: "127.0.0.1:1" for n in ("n0", "n1", "n2")}
    record = GenerationRecord(2, plan.to_dict(), "n0", time.time(), extra={"nodes": nodes})
    agent.view.state.record = record
    gs = GenerationProgress(record=record, plan=Plan.from_dict(record.plan), phase=Phase.MOVING)
    agent.follower.state.gen = gs
    agent.liveness.confirm_dead = lambda nodes: None  # type: ignore[method-assign]  # n2 answers
    holdings = {"digest": {"format": 1, "address": "127.0.0.1:1", "held": []}}
    agent.view.state.barriers = {"stopped-2": {"n0": holdings, "n1": holdings}}
    lead_resume(agent, gs)
    lead_resume(agent, gs)
    assert (
        cluster.quarantines() == [] and not agent.leader.state.resume_written
    )  # within the deadline
    # The node's own report of workers that outlive SIGKILL (stop_timeout_s after its kill)
    # gets a margin to arrive first: it says why.
    clock.advance(SPEC.stop_timeout_s + 1)
    lead_resume(agent, gs)
    assert cluster.quarantines() == []
    clock.advance(STOPPED_WAIT_MARGIN_S)
    lead_resume(agent, gs)
    [q] = cluster.quarantines()
    assert q.node_id == "n2" and q.incarnation == "in2"
    assert "did not arrive at stopped-2 within 10 s" in q.reason
    assert not agent.leader.state.resume_written  # n2 is in the plan: the next plan goes without it
    view = agent.leader.cluster_view()
    assert view.quarantined == {"n2"}
    # Re-admitted (say by an operator), the same stale observation does not set it aside
    # again; a new incarnation's would.
    agent.health.state.quarantines = {}
    agent.leader.judge_health(agent.leader.cluster_view())
    assert len(cluster.quarantines()) == 1
    cluster.close()


def test_an_ended_job_stops_its_workers_and_exits_with_its_status(tmp_path: Path) -> None:
    for status, code in (("failed", EXIT_FAILED), ("halted", EXIT_HALTED)):
        agent, _ = _agent(tmp_path / status)
        spare = _SlowSpare(300)
        agent.pool.add_spare(spare)  # type: ignore[arg-type]
        agent.health.state.job_end = JobEnd(status, "why", "n1", time.time())
        agent.executor.run(agent.health.check_job_end())
        assert spare.killed and agent.pool.spares() == ()
        assert agent.exit_requested() == code
        assert any(f"job ended ({status}" in e[2] for e in agent.journal.log)


def test_an_ended_job_idles_healthy_with_on_job_end_idle(tmp_path: Path) -> None:
    agent, _ = _agent(tmp_path, on_job_end="idle")
    agent.health.state.job_end = JobEnd("failed", "failure budget spent", "n1", time.time())
    agent.executor.run(agent.health.check_job_end())
    assert agent.exit_requested() is None
    agent.supervisor.refill()
    assert agent.pool.spares() == ()  # no spares for a job that is over
    assert agent.status().phase == "ended"
    assert agent.status().ended == "failed: failure budget spent"


def test_a_halt_is_recorded_for_the_job_not_only_held_on_this_node(tmp_path: Path) -> None:
    agent, cluster = _agent(tmp_path)
    plan = _plan(1)
    record = GenerationRecord(1, plan.to_dict(), "n0", time.time())
    agent.follower.state.gen = GenerationProgress(
        record=record, plan=Plan.from_dict(record.plan), phase=Phase.RUNNING
    )

    class _P:
        pid = 100

        def alive(self) -> bool:
            return False

    w = Worker(proc=_P(), rank=0, generation=1, plan=plan, state=WorkerState.RUNNING)  # type: ignore[arg-type]
    agent.pool.add_worker(w)
    agent.pool.deliver(w.proc, {"event": "halted", "step": 3, "message": "loss nan"})  # type: ignore[arg-type]
    agent.supervisor.drain_events()
    agent.follower.step()
    end = cluster.health.job_end()
    assert end is not None and (end.status, end.reason) == ("halted", "loss nan")


def test_memory_for_steps_written_does_not_grow_with_steps(tmp_path: Path) -> None:
    agent, _ = _agent(tmp_path)
    plan = _plan(1)

    class _P:
        pid = 100

    w = Worker(proc=_P(), rank=0, generation=1, plan=plan, state=WorkerState.RUNNING)  # type: ignore[arg-type]
    for gen in range(1, 7):
        w.generation = gen
        for step in range(300):
            agent.executor.run(
                agent.durability.on_step(w, {"step": step, "loss": 1.0, "generation": gen})
            )
            agent.executor.run(
                agent.durability.on_step(w, {"step": step, "loss": 1.0, "generation": gen})
            )  # a dp twin
    assert len(agent.durability.state.written_steps) <= 4
    lines = agent.durability.config.metrics_path.read_text().splitlines()
    assert len(lines) == 6 * 300  # each step written once


def test_a_drain_is_a_request_the_loop_carries_out_also_for_an_idle_ended_job(
    tmp_path: Path,
) -> None:
    """The drain RPC runs on a gRPC thread: it queues the request and writes nothing of the
    agent's. An idle agent of an ended job leaves when drained (a pod's preStop hook)."""
    agent, _ = _agent(tmp_path, on_job_end="idle")
    agent.membership.take_lease()
    agent.health.state.job_end = JobEnd("failed", "failure budget spent", "n1", time.time())
    agent.executor.run(agent.health.check_job_end())
    accepted, _message = agent.control.request_drain(30.0)
    assert accepted and not agent.control.state.draining  # nothing written from the RPC's thread
    agent.control_turn()
    assert agent.control.state.draining and agent.exit_requested() == 0


def test_a_node_of_the_generation_that_answers_not_serving_is_set_aside(tmp_path: Path) -> None:
    """Before, a probe counted NOT_SERVING as alive, and a wedged agent stayed in every
    plan (the review's N2b)."""
    agent, cluster = _agent(tmp_path)
    agent.leader.begin_term(_term(cluster), None)
    agent.view.state.leader = "n0"
    agent.view.state.members = {
        n: {"address": "127.0.0.1:1", "slots": 1, "incarnation": f"i{n}"}
        for n in ("n0", "n1", "n2")
    }
    nodes = {n: "127.0.0.1:1" for n in ("n0", "n1", "n2")}
    record = GenerationRecord(
        2, _plan(2, ("n0", "n1", "n2")).to_dict(), "n0", time.time(), extra={"nodes": nodes}
    )
    agent.view.state.record = record
    agent.liveness.state.unhealthy = {"n2": "in2", "n9": "in9"}  # as a probe found them
    view = agent.leader.judge_health(agent.leader.cluster_view())
    [q] = cluster.quarantines()
    assert q.node_id == "n2" and "NOT_SERVING" in q.reason
    assert view.quarantined == {"n2"}
    # Re-admitted (say by an operator), the same stale observation does not set it aside
    # again; a new incarnation's would.
    agent.health.state.quarantines = {}
    agent.leader.judge_health(agent.leader.cluster_view())
    assert len(cluster.quarantines()) == 1
    cluster.close()
