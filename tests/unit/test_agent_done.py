"""The agent's own bookkeeping of a finished job, driven by worker events (pure logic: a
constructed agent, recorded events, a fake of the cluster's one call it makes here)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from elasticpp.agent.decide import WorkerState
from elasticpp.agent.jobspec import parse_job_spec
from elasticpp.agent.node import Agent, AgentConfig, _GenState, _Worker
from elasticpp.cluster.records import GenerationRecord
from elasticpp.plan import ClusterSpec, Layout, NodeSpec, Plan, build_plan, load_device_spec
from elasticpp.train.procs import EXITED

SPEC = parse_job_spec(
    {
        "name": "j",
        "model": "tiny",
        "global_batch": 4,
        "micro_batch": 2,
        "steps": 5,
        "seed": 0,
        "min_nodes": 1,
        "max_nodes": 1,
    }
)


def _plan(generation: int) -> Plan:
    """Two ranks (data parallel) on node n0."""
    cluster = ClusterSpec((NodeSpec("n0", 2),), load_device_spec("cpu"))
    return build_plan(
        SPEC.model, cluster, Layout(1, 1, 2), global_batch=4, micro_batch=2
    ).with_generation(generation)


class _Proc:
    def __init__(self, pid: int) -> None:
        self.pid = pid

    def alive(self) -> bool:
        return False


class _Cluster:
    def __init__(self) -> None:
        self.arrivals: list[tuple[str, str, Any]] = []

    def arrive(self, barrier: str, node_id: str, value: Any = None) -> None:
        self.arrivals.append((barrier, node_id, value))


def test_a_node_whose_workers_report_done_and_exit_in_one_tick_still_reports_done(
    tmp_path: Path,
) -> None:
    spec = SPEC
    cfg = AgentConfig("n0", ("127.0.0.1:1",), "127.0.0.1:0", 2, tmp_path)
    agent = Agent(cfg, spec)
    plan = _plan(1)
    record = GenerationRecord(1, plan.to_dict(), "n0", time.time(), resume_step=0)
    agent._gen = _GenState(record=record, phase="running")
    cluster = _Cluster()
    agent.cluster = cluster  # type: ignore[assignment]
    for rank in range(2):
        proc = _Proc(100 + rank)
        agent._workers[proc.pid] = _Worker(
            proc=proc,  # type: ignore[arg-type]
            rank=rank,
            generation=1,
            plan=plan,
            state=WorkerState.RUNNING,
        )
        # Both events of each worker arrive before the loop looks at the job's state.
        agent._wq.put((proc, {"event": "done", "step": 5}))  # type: ignore[arg-type]
        agent._wq.put((proc, {"event": EXITED, "returncode": 0}))  # type: ignore[arg-type]
    agent._drain_worker_events()
    agent._check_done()
    assert [(b, n) for b, n, _ in cluster.arrivals] == [("done", "n0")]
    assert agent._done  # and the agent may exit


def test_a_leader_elected_later_does_not_overwrite_a_generations_timeline(
    tmp_path: Path,
) -> None:
    spec = SPEC
    agent = Agent(AgentConfig("n0", ("127.0.0.1:1",), "127.0.0.1:0", 2, tmp_path), spec)
    plan = _plan(2)
    record = GenerationRecord(2, plan.to_dict(), "n9", time.time(), resume_step=10)
    gs = _GenState(record=record, phase="running", resume_written=True)
    cluster = _Cluster()
    agent.cluster = cluster  # type: ignore[assignment]
    agent._barriers = {
        "timelines": {"gen-2": {"generation": 2, "resume_step": 10}},
        "started-2": {"n0": {"at": time.time(), "moved_at": time.time()}},
        "resume-2": {"n9": {"step": 10, "recomputed": 1}},
    }
    agent._lead_timeline(gs)
    assert cluster.arrivals == []  # n9's timeline of generation 2 stays
    del agent._barriers["timelines"]["gen-2"]
    agent._lead_timeline(_GenState(record=record, phase="running", resume_written=True))
    [(barrier, key, timeline)] = cluster.arrivals
    assert (barrier, key) == ("timelines", "gen-2")
    assert timeline["resume_step"] == 10 and timeline["steps_recomputed"] == 1  # n9's resume
