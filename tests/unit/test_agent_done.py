"""The agent's own bookkeeping of a finished job, driven by worker events (pure logic: a
constructed agent, recorded events, a fake of the cluster's one call it makes here)."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import pytest

from elasticpp.agent.follower.step import GenerationProgress
from elasticpp.agent.jobspec import parse_job_spec
from elasticpp.agent.kernel.decide import Phase, WorkerState
from elasticpp.agent.kernel.pool import Worker
from elasticpp.agent.node import Agent, AgentConfig
from elasticpp.checkpoint.manifest import step_dirname
from elasticpp.cluster.barriers import RESUME_MEMBER
from elasticpp.cluster.records import GenerationRecord
from elasticpp.plan import ClusterSpec, Layout, NodeSpec, Plan, build_plan, load_device_spec
from elasticpp.store.holdings import DISK_SOURCE
from elasticpp.train.worker.procs import EXITED
from tests.agents import SPEC, SPEC_FIELDS, lead_resume, lead_timeline
from tests.agents import DeadProc as _Proc
from tests.agents import dp_plan as _plan
from tests.fakes import FakeCluster, FakeRegistration


def test_a_node_whose_workers_report_done_and_exit_in_one_tick_still_reports_done(
    tmp_path: Path,
) -> None:
    spec = SPEC
    cfg = AgentConfig("n0", ("127.0.0.1:1",), "127.0.0.1:0", 2, tmp_path)
    cluster = FakeCluster()
    agent = Agent(cfg, spec, cluster=cluster)
    plan = _plan(1)
    record = GenerationRecord(1, plan.to_dict(), "n0", time.time(), resume_step=0)
    agent.follower.state.gen = GenerationProgress(
        record=record, plan=Plan.from_dict(record.plan), phase=Phase.RUNNING
    )
    for rank in range(2):
        proc = _Proc(100 + rank)
        agent.pool.add_worker(
            Worker(
                proc=proc,  # type: ignore[arg-type]
                rank=rank,
                generation=1,
                plan=plan,
                state=WorkerState.RUNNING,
            )
        )
        # Both events of each worker arrive before the loop looks at the job's state.
        agent.pool.deliver(proc, {"event": "done", "step": 5})  # type: ignore[arg-type]
        agent.pool.deliver(proc, {"event": EXITED, "returncode": 0})  # type: ignore[arg-type]
    agent.supervisor.drain_events()
    agent.follower.step()
    agent.control_turn()
    assert [(b, n) for b, n, _ in cluster.arrived()] == [("done", "n0")]
    assert agent.exit_requested() == 0  # and the agent may exit


def test_a_leader_elected_later_does_not_overwrite_a_generations_timeline(
    tmp_path: Path,
) -> None:
    spec = SPEC
    cluster = FakeCluster()
    agent = Agent(
        AgentConfig("n0", ("127.0.0.1:1",), "127.0.0.1:0", 2, tmp_path), spec, cluster=cluster
    )
    term = cluster.campaign("n0", 30)
    assert term is not None
    agent.leader.begin_term(term, None)  # elected after n9, which wrote the timeline
    plan = _plan(2)
    record = GenerationRecord(2, plan.to_dict(), "n9", time.time(), resume_step=10)
    gs = GenerationProgress(record=record, plan=Plan.from_dict(record.plan), phase=Phase.RUNNING)
    agent.leader.state.at(2, time.monotonic()).resume_written = True
    agent.view.state.barriers = {
        "timelines": {"gen-2": {"generation": 2, "resume_step": 10}},
        "started-2": {"n0": {"at": time.time(), "moved_at": time.time()}},
        "resume-2": {RESUME_MEMBER: {"step": 10, "recomputed": 1}},
    }
    lead_timeline(agent, gs)
    assert cluster.arrived() == []  # n9's timeline of generation 2 stays
    del agent.view.state.barriers["timelines"]["gen-2"]
    agent.leader.state.timeline_written = False  # as a leader elected later knows it
    lead_timeline(
        agent,
        GenerationProgress(record=record, plan=Plan.from_dict(record.plan), phase=Phase.RUNNING),
    )
    [(barrier, key, timeline)] = cluster.arrived()
    assert (barrier, key) == ("timelines", "gen-2")
    assert timeline["resume_step"] == 10 and timeline["steps_recomputed"] == 1  # n9's resume
    cluster.close()


def test_a_follower_takes_the_resume_written_by_a_leader_other_than_the_records(
    tmp_path: Path,
) -> None:
    """Leadership moved mid-transition: the record names n9, the instruction came from the
    leader after it. Before, followers read only n9's and waited for good."""
    agent = Agent(AgentConfig("n0", ("127.0.0.1:1",), "127.0.0.1:0", 2, tmp_path), SPEC)
    record = GenerationRecord(2, _plan(2).to_dict(), "n9", time.time(), resume_step=0)
    gs = GenerationProgress(record=record, plan=Plan.from_dict(record.plan), phase=Phase.MOVING)
    agent.follower.state.gen = gs
    agent.view.state.barriers = {"resume-2": {RESUME_MEMBER: _resume_v2(step=0)}}
    agent.follower.step()
    fetch = agent.follower.fetch_in_flight()
    assert gs.resume == _resume_v2(step=0) and fetch is not None and fetch[0] == 2
    assert fetch[1].result(timeout=10).error is None


def test_a_leader_does_not_rewrite_a_resume_an_earlier_leader_wrote(tmp_path: Path) -> None:
    cluster = FakeCluster()
    agent = Agent(
        AgentConfig("n0", ("127.0.0.1:1",), "127.0.0.1:0", 2, tmp_path),
        SPEC,
        cluster=cluster,
    )
    record = GenerationRecord(2, _plan(2).to_dict(), "n9", time.time(), resume_step=0)
    gs = GenerationProgress(record=record, plan=Plan.from_dict(record.plan), phase=Phase.MOVING)
    agent.view.state.barriers = {"resume-2": {RESUME_MEMBER: {"step": 4, "fetches": {}}}}
    lead_resume(agent, gs)
    assert agent.leader.state.at(2, time.monotonic()).resume_written
    assert cluster.memory.writes == []


def _running_agent(tmp_path: Path, cluster: object = None) -> tuple[Agent, Plan]:
    """A constructed agent of node n0, running generation 1 of `_plan(1)`."""
    agent = Agent(
        AgentConfig("n0", ("127.0.0.1:1",), "127.0.0.1:0", 2, tmp_path),
        SPEC,
        cluster=cluster,  # type: ignore[arg-type]
    )
    plan = _plan(1)
    record = GenerationRecord(1, plan.to_dict(), "n0", time.time(), resume_step=0)
    agent.follower.state.gen = GenerationProgress(
        record=record, plan=Plan.from_dict(record.plan), phase=Phase.RUNNING
    )
    return agent, plan


def _worker_on(agent: Agent, plan: Plan, pid: int, rank: int) -> _Proc:
    proc = _Proc(pid)
    agent.pool.add_worker(
        Worker(
            proc=proc,  # type: ignore[arg-type]
            rank=rank,
            generation=1,
            plan=plan,
            state=WorkerState.RUNNING,
        )
    )
    return proc


def _errors(agent: Agent, source: str) -> float:
    value = agent.metrics.registry.get_sample_value(
        "elasticpp_agent_errors_total", {**agent.metrics.labels, "source": source}
    )
    return value or 0.0


def test_a_disk_error_on_a_worker_event_is_counted_and_the_next_events_still_count(
    tmp_path: Path,
) -> None:
    agent, plan = _running_agent(tmp_path)
    # Every append to metrics.jsonl now fails, as on a full disk.
    agent.durability.config.metrics_path.mkdir()
    proc = _worker_on(agent, plan, 100, 0)
    agent.pool.deliver(proc, {"event": "step", "step": 0, "loss": 2.5})  # type: ignore[arg-type]
    agent.pool.deliver(proc, {"event": "step", "step": 1})  # type: ignore[arg-type]  # malformed
    agent.pool.deliver(proc, {"event": "stopped", "step": 2})  # type: ignore[arg-type]
    agent.supervisor.drain_events()
    assert _errors(agent, "worker") == 2
    w = agent.pool.worker(100)
    assert w is not None and w.state is WorkerState.STOPPED  # the event after them counted


def test_the_loop_survives_an_error_from_a_tick_and_goes_on(tmp_path: Path) -> None:
    agent = Agent(AgentConfig("n0", ("127.0.0.1:1",), "127.0.0.1:0", 2, tmp_path), SPEC)
    ticks: list[int] = []

    def tick() -> None:
        ticks.append(1)
        if len(ticks) < 3:
            raise OSError(28, "No space left on device")
        agent.control.state.exit_code = 0

    agent.tick = tick  # type: ignore[method-assign]
    assert agent.run() == 0
    assert len(ticks) == 3 and _errors(agent, "internal") == 2


def test_a_follower_that_waits_past_its_phase_deadline_reports_the_generation_failed(
    tmp_path: Path,
) -> None:
    """The wedge: a node waiting for its ranks to start (or for a resume instruction) waited
    for good. Past the phase's deadline it now reports a failure, so the leader re-plans."""
    cluster = FakeCluster()
    agent = Agent(
        AgentConfig("n0", ("127.0.0.1:1",), "127.0.0.1:0", 2, tmp_path), SPEC, cluster=cluster
    )
    record = GenerationRecord(3, _plan(3).to_dict(), "n0", time.time(), resume_step=0)
    for phase in (Phase.MOVING, Phase.STARTING):
        gs = GenerationProgress(record=record, plan=Plan.from_dict(record.plan), phase=phase)
        agent.follower.state.gen = gs
        agent.follower.step()
        assert gs.phase is phase and cluster.arrived() == []  # within the deadline
        gs.phase_since_s -= 1000.0
        agent.follower.step()
        assert gs.phase is Phase.FAILED
        [(barrier, node, value)] = cluster.arrived()
        assert (barrier, node) == ("failed-3", "n0") and "waited" in value["reason"]
        cluster.memory.writes.clear()
        agent.follower.state.pending_failures.clear()


def test_an_agent_whose_lease_may_have_lapsed_commits_nothing_until_it_is_renewed(
    tmp_path: Path,
) -> None:
    import hashlib

    from elasticpp.checkpoint.manifest import step_dirname

    reg = FakeRegistration(lapsed=True)
    cluster = FakeCluster(registration=reg)
    agent, plan = _running_agent(tmp_path, cluster)
    agent.membership.take_lease()
    proc = _worker_on(agent, plan, 100, 0)

    def snapshot(step: int) -> dict[str, Any]:
        d = agent.store.snapshot_dir(1) / step_dirname(step)
        d.mkdir(parents=True)
        pieces = []
        for unit in plan.model.units:
            name = f"{unit}.tp0-1.safetensors"
            data = f"{name}{step}".encode()
            (d / name).write_bytes(data)
            pieces.append(
                {"name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            )
        return {"event": "snapshot", "step": step, "pieces": pieces}

    agent.pool.deliver(proc, snapshot(1))  # type: ignore[arg-type]
    agent.supervisor.drain_events()
    assert agent.store.committed_steps() == []  # fenced
    reg.lapsed = False
    agent.pool.deliver(proc, snapshot(2))  # type: ignore[arg-type]
    agent.supervisor.drain_events()
    assert agent.store.committed_steps() == [2]


def _resume_v2(**fields: Any) -> dict[str, Any]:
    empty = {"pieces": {}, "reshard": {}, "reshard_by_node": {}, "infos_by_node": {}}
    return {"format_version": 2, "step": 3, **empty, "nodes": [], "by_node": {}, **fields}


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        # A path as a piece name: piece names are built from the plan, never taken from etcd.
        ({"pieces": {"../secret.txt": "INFO"}, "nodes": [DISK_SOURCE]}, "no piece of unit"),
        # A path as a node name (an origin is a directory of the store): refused.
        ({"pieces": "ALL", "nodes": ["../ckpt"]}, "node '../ckpt': must be"),
    ],
)
def test_a_resume_that_names_a_path_instead_of_a_piece_is_refused_before_any_copy(
    tmp_path: Path, bad: dict[str, Any], error: str
) -> None:
    # The traversed source exists with the right checksum and size: only the name checks
    # stand between this resume and a file written outside the generation's resume dir.
    ckpt = tmp_path / "ckpt"
    (ckpt / step_dirname(3)).mkdir(parents=True)
    secret = ckpt / "secret.txt"
    secret.write_text("not state")
    data = secret.read_bytes()
    spec = parse_job_spec({**SPEC_FIELDS, "persist_dir": str(ckpt)})
    agent = Agent(AgentConfig("n0", ("127.0.0.1:1",), "127.0.0.1:0", 2, tmp_path / "a"), spec)
    record = GenerationRecord(2, _plan(2).to_dict(), "n9", time.time(), resume_step=3)
    gs = GenerationProgress(record=record, plan=Plan.from_dict(record.plan), phase=Phase.MOVING)
    before = {p for p in (tmp_path / "a").rglob("*")}
    info = [hashlib.sha256(data).hexdigest(), len(data)]
    names = {f"{u}.tp0-1.safetensors": info for u in SPEC.model.units}
    pieces = names if bad["pieces"] == "ALL" else {k: info for k in bad["pieces"]}
    runs = [[len(SPEC.model.units), 0]]
    value = _resume_v2(pieces=pieces, nodes=bad["nodes"], by_node={"n0": runs})
    outcome = agent.follower.fetch(gs, value)
    resume_dir = agent.follower.resume_dir(gs)
    assert resume_dir == tmp_path / "a" / "resume" / "gen-000002"
    new = {p for p in (tmp_path / "a").rglob("*")} - before
    outside = [
        p
        for p in new
        if p != resume_dir
        and resume_dir not in p.parents  # the resume dir and what is in it
        and not (p.is_dir() and p in resume_dir.parents)  # its parent, created with it
    ]
    assert not outside, outside
    assert not [p for p in new if p.is_file()], new  # refused before any copy
    assert outcome.error is not None and error in outcome.error


def test_old_resume_dirs_and_worker_logs_are_removed_and_metrics_rotate(tmp_path: Path) -> None:
    import os

    from elasticpp.agent.kernel.limits import METRICS_ROTATE_BYTES, WORKER_LOGS_KEPT

    agent = Agent(AgentConfig("n0", ("127.0.0.1:1",), "127.0.0.1:0", 2, tmp_path), SPEC)
    for g in (1, 2, 3):
        (tmp_path / "resume" / f"gen-{g:06d}").mkdir(parents=True)
    agent.supervisor.config.log_dir.mkdir(parents=True, exist_ok=True)
    for i in range(WORKER_LOGS_KEPT + 8):
        log_file = agent.supervisor.config.log_dir / f"n0-w{i:04d}.log"
        log_file.write_text("x")
        os.utime(log_file, (1000 + i, 1000 + i))
    agent.follower.clean_local(3)
    assert sorted(p.name for p in (tmp_path / "resume").iterdir()) == ["gen-000003"]
    logs = sorted(p.name for p in agent.supervisor.config.log_dir.iterdir())
    assert len(logs) == WORKER_LOGS_KEPT and logs[0] == "n0-w0008.log"  # the newest kept

    with agent.durability.config.metrics_path.open("wb") as f:
        f.truncate(METRICS_ROTATE_BYTES + 1)  # sparse: a file that grew for weeks
    plan = _plan(1)
    proc = _Proc(100)
    w = Worker(proc=proc, rank=0, generation=1, plan=plan, state=WorkerState.RUNNING)  # type: ignore[arg-type]
    agent.executor.run(agent.durability.on_step(w, {"step": 7, "loss": 1.5}))
    rotated = agent.durability.config.metrics_path.with_name("metrics.jsonl.1")
    assert rotated.stat().st_size == METRICS_ROTATE_BYTES + 1
    assert [
        json.loads(x)["step"] for x in agent.durability.config.metrics_path.read_text().splitlines()
    ] == [7]


def _sample(agent: Agent, name: str) -> float:
    return agent.metrics.registry.get_sample_value(name, agent.metrics.labels) or 0.0


def test_a_snapshot_that_failed_is_counted_and_the_next_one_commits(tmp_path: Path) -> None:
    agent, plan = _running_agent(tmp_path)
    procs = [_worker_on(agent, plan, 100 + r, r) for r in (0, 1)]
    writer = procs[0]  # dp twins on one node: only the lowest dp index writes
    agent.pool.deliver(
        writer, {"event": "snapshot_failed", "step": 1, "message": "OSError: ENOSPC"}
    )  # type: ignore[arg-type]
    agent.supervisor.drain_events()
    assert _sample(agent, "elasticpp_snapshot_failures_total") == 1
    assert not agent.follower.state.pending_failures  # a lost snapshot is no reason to re-plan
    assert all(w.state is WorkerState.RUNNING for w in agent.pool.workers())
    assert "could not write the snapshot of step 1" in agent.journal.log[-1][2]


def test_a_halted_worker_holds_the_generation_without_a_failure_report(tmp_path: Path) -> None:
    agent, plan = _running_agent(tmp_path)
    procs = [_worker_on(agent, plan, 100 + r, r) for r in (0, 1)]
    message = "step 3: loss nan / gradient norm nan is not finite"
    for p in procs:
        agent.pool.deliver(p, {"event": "halted", "step": 3, "message": message})  # type: ignore[arg-type]
        agent.pool.deliver(p, {"event": EXITED, "returncode": 0})  # type: ignore[arg-type]
    agent.supervisor.drain_events()
    agent.follower.step()  # the follower acts on the halt the supervisor saw
    assert agent.follower.state.gen is not None and agent.follower.state.gen.phase is Phase.HALTED
    assert not agent.follower.state.pending_failures
    assert _sample(agent, "elasticpp_halted") == 1
    halts = [e[2] for e in agent.journal.log if "training halted" in e[2]]
    assert len(halts) == 1 and message in halts[0]


def test_a_step_drained_after_the_next_generation_began_keeps_its_workers_layout(
    tmp_path: Path,
) -> None:
    """An old worker's last steps are drained once the node follows the next generation: the
    rows said the new generation's layout (a soak replaying its curve by layout trained
    steps 247-248 of a dp=2 generation in dp=3)."""
    agent, plan = _running_agent(tmp_path)
    old = Worker(proc=_Proc(100), rank=0, generation=1, plan=plan, state=WorkerState.STOPPED)  # type: ignore[arg-type]
    cluster = ClusterSpec((NodeSpec("n0", 1),), load_device_spec("cpu"))
    newer = build_plan(
        SPEC.model, cluster, Layout(1, 1, 1), global_batch=4, micro_batch=2
    ).with_generation(2)
    record = GenerationRecord(2, newer.to_dict(), "n0", time.time(), resume_step=0)
    agent.follower.state.gen = GenerationProgress(
        record=record, plan=Plan.from_dict(record.plan), phase=Phase.STOPPING
    )
    assert str(agent.follower.state.gen.plan.layout) == str(newer.layout)
    agent.executor.run(agent.durability.on_step(old, {"step": 7, "loss": 1.5, "generation": 1}))
    (row,) = [json.loads(x) for x in agent.durability.config.metrics_path.read_text().splitlines()]
    assert (row["generation"], row["layout"]) == (1, str(plan.layout))
    assert str(plan.layout) != str(newer.layout)


def test_a_commit_from_before_a_restart_is_persisted_when_asked(tmp_path: Path) -> None:
    """An agent restarted during a job stop or a checkpoint now holds commits its durability
    part never saw made; asked to persist one, it does (before: refused, "not submitted",
    because only a commit seen since the start named the model)."""
    from tests.stores import commit_step

    spec = parse_job_spec({**SPEC_FIELDS, "persist_dir": str(tmp_path / "ckpt")})
    agent = Agent(AgentConfig("n0", ("127.0.0.1:1",), "127.0.0.1:0", 2, tmp_path / "a"), spec)
    try:
        commit_step(agent.store, 4)  # left by the run before the restart
        assert agent.durability.state.last_commit_model is None
        assert not agent.durability.persist_now(5)  # no such commit: nothing submitted
        assert agent.durability.persist_outcome(4) == "unknown"
        assert agent.durability.persist_now(4)
        assert agent.durability.persist_outcome(4) != "unknown"  # submitted
    finally:
        agent.durability.close(flush=False)


def test_a_worker_that_failed_after_a_peer_went_away_is_reported_as_a_victim(
    tmp_path: Path,
) -> None:
    """The worker's error event says its collective broke because a peer went away; the
    failure report in etcd says so, and the leader reads it as a victim's report, blamed
    only when no other report names a cause (elasticpp.agent.sick.blame)."""
    from elasticpp.agent.health.step import report_of

    agent, plan = _running_agent(tmp_path)
    victim = _worker_on(agent, plan, 100, 0)
    closed = "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer"
    agent.pool.deliver(victim, {"event": "error", "message": closed, "peer": True})  # type: ignore[arg-type]
    agent.pool.deliver(victim, {"event": EXITED, "returncode": 1})  # type: ignore[arg-type]
    agent.supervisor.drain_events()
    # (etcd is unreachable here: the report waits for it, as it would during an outage)
    report = report_of("n0", agent.follower.state.pending_failures[1])
    assert report.followed_a_peer and "after a peer went away" in report.reason
    other = _running_agent(tmp_path / "other")[0]
    killed = _worker_on(other, plan, 200, 1)
    other.pool.deliver(killed, {"event": EXITED, "returncode": -9})  # type: ignore[arg-type]
    other.supervisor.drain_events()
    assert not report_of("n1", other.follower.state.pending_failures[1]).followed_a_peer
