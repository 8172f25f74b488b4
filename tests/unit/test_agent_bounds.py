"""Bounded disk, memory and etcd waits of the agent over many steps and generations (a
constructed agent, fake worker handles and fakes of the cluster calls it makes): the commit
record has one writer off the loop, failed generations' resume directories go, a fenced
node keeps a few uncommitted snapshots, and per-generation bookkeeping does not grow; the
commit record's pace on a fake clock."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from elasticpp.agent.durability.latest import LatestWriter, Pacing
from elasticpp.agent.durability.step import CommitValue, anchors_ran_ahead
from elasticpp.agent.follower.step import FetchOutcome, GenerationProgress
from elasticpp.agent.jobspec import parse_job_spec
from elasticpp.agent.kernel.decide import Phase, WorkerState
from elasticpp.agent.kernel.limits import COMMIT_RECORD_EVERY_S, FENCED_SNAPSHOTS_KEPT
from elasticpp.agent.kernel.pool import Worker
from elasticpp.agent.leader.shell import RendezvousStore
from elasticpp.agent.node import Agent, AgentConfig
from elasticpp.cluster.arrivals import Arrivals
from elasticpp.cluster.barriers import RESUME_MEMBER
from elasticpp.cluster.commits import Commits
from elasticpp.cluster.errors import ClusterUnavailableError
from elasticpp.cluster.reads import JobReads
from elasticpp.cluster.records import GenerationRecord
from elasticpp.plan import Plan
from elasticpp.store.resume import TransferProgress
from elasticpp.store.retention import ANCHORS_ABOVE_FLOOR
from tests.agents import SPEC_FIELDS, lead_timeline
from tests.agents import DeadProc as _Proc
from tests.agents import dp_plan as _plan
from tests.fakes import FakeCluster, FakeRegistration
from tests.stores import write_step


class _SlowCommits(Commits):
    """A slow etcd: every commit record put takes `put_s`."""

    def __init__(self, reads: JobReads, put_s: float) -> None:
        super().__init__(reads)
        self.put_s = put_s
        self.records: list[tuple[int, int, float]] = []  # (generation, step, when)

    def record_commit(
        self, generation: int, node_id: str, step: int, *args: Any, **kw: Any
    ) -> None:
        time.sleep(self.put_s)  # the latency being modelled, not a wait for a condition
        super().record_commit(generation, node_id, step, *args, **kw)
        self.records.append((generation, step, time.monotonic()))


class _SlowCluster(FakeCluster):
    """A slow etcd: every commit record put takes `put_s` (0.2 s)."""

    def __init__(self, put_s: float = 0.2) -> None:
        super().__init__(registration=FakeRegistration())
        self.commits = self.slow = _SlowCommits(self.reads, put_s)

    @property
    def records(self) -> list[tuple[int, int, float]]:
        return self.slow.records


# One node: no replication rounds (its ring has no peer).
UNREPLICATED = parse_job_spec({**SPEC_FIELDS, "replication_copies": 0})


def _running_agent(tmp_path: Path, cluster: Any, generation: int = 1) -> tuple[Agent, _Proc]:
    agent = Agent(
        AgentConfig("n0", ("127.0.0.1:1",), "127.0.0.1:0", 2, tmp_path),
        UNREPLICATED,
        cluster=cluster,
    )
    plan = _plan(generation)
    record = GenerationRecord(generation, plan.to_dict(), "n0", time.time(), resume_step=0)
    agent.follower.state.gen = GenerationProgress(
        record=record, plan=Plan.from_dict(record.plan), phase=Phase.RUNNING
    )
    writer = _Proc(100)  # rank 0 writes the node's snapshot (data-parallel twins)
    agent.pool.add_worker(
        Worker(
            proc=writer,  # type: ignore[arg-type]
            rank=0,
            generation=generation,
            plan=plan,
            state=WorkerState.RUNNING,
        )
    )
    return agent, writer


def test_a_slow_etcd_does_not_hold_the_loop_and_the_newest_commit_record_lands_last(
    tmp_path: Path,
) -> None:
    cluster = _SlowCluster()
    agent, writer = _running_agent(tmp_path, cluster)
    steps = 20
    fed = threading.Event()

    def feed() -> None:
        for step in range(1, steps + 1):
            agent.pool.deliver(writer, {"event": "snapshot", "step": step, "pieces": []})  # type: ignore[arg-type]
            fed.wait(0.1)  # a step every 0.1 s: faster than a put
        fed.set()

    feeder = threading.Thread(target=feed, daemon=True)
    started = time.monotonic()
    feeder.start()
    drains: list[float] = []
    while not fed.is_set() and time.monotonic() - started < 30:
        t0 = time.monotonic()
        agent.supervisor.drain_events()
        drains.append(time.monotonic() - t0)
        fed.wait(0.02)  # the loop's cadence
    feeder.join(5)
    agent.supervisor.drain_events()
    assert max(drains) < 0.5, f"a drain took {max(drains):.2f} s: the loop waits on etcd"
    assert agent.store.committed_steps()[-1] == steps
    assert agent.durability.flush_records(timeout_s=10)
    written = [step for _, step, _ in cluster.records]
    assert written == sorted(written), f"a commit record went back: {written}"
    assert written[-1] == steps  # the newest is what stays
    # Paced: one put at once, then at most one a COMMIT_RECORD_EVERY_S (the flush aside).
    assert len(written) < steps / 2


def test_the_writer_keeps_only_the_newest_value_and_retries_a_failed_put(tmp_path: Path) -> None:
    puts: list[tuple[int, int]] = []
    fail = threading.Event()
    gate = threading.Event()

    def put(key: int, value: int) -> None:
        gate.wait(10)  # the first put is held until the test has offered more
        if fail.is_set():
            fail.clear()
            raise OSError("etcd unavailable")
        puts.append((key, value))

    writer: LatestWriter[int] = LatestWriter(put, every_s=0.0, name="record")
    writer.offer(1, lambda: 1)  # taken at once, held at the gate
    deadline = time.monotonic() + 10
    while writer.pending() and time.monotonic() < deadline:
        gate.wait(0.01)
    for value in range(2, 50):
        writer.offer(1, lambda v=value: v)
    writer.offer(2, lambda: 7)
    assert writer.pending() == {1: 49, 2: 7}  # one slot per key: the newest
    gate.set()
    assert writer.flush(timeout_s=10)
    assert puts == [(1, 1), (1, 49), (2, 7)]
    fail.set()
    writer.offer(2, lambda: 8)
    assert writer.flush(timeout_s=10)  # failed once, retried
    assert puts[-1] == (2, 8)
    for key in range(3, 20):
        writer.offer(key, lambda k=key: k)
    assert len(writer.pending()) <= 4
    writer.close(timeout_s=10)
    assert puts[-1] == (19, 19)


def _paced_puts(
    pacing: Pacing[tuple[int, int]], values: list[tuple[float, tuple[int, int]]]
) -> list[tuple[float, tuple[int, int]]]:
    """The writer's rounds on a fake clock: each value offered at its time, a round taken
    whenever one waits and the pace allows it (the writer thread's rule)."""
    puts: list[tuple[float, tuple[int, int]]] = []
    for now, value in values:
        pacing.offer(1, value)
        if pacing.pending and pacing.wait_s(now) <= 0:
            puts += [(now, v) for _, v in pacing.take(now)]
    return puts


def test_a_commit_record_is_put_at_most_every_5_s_and_only_when_it_changed() -> None:
    pacing: Pacing[tuple[int, int]] = Pacing(COMMIT_RECORD_EVERY_S)
    # 60 s of training, a commit every 0.1 s: the first record at once, then one a 5 s.
    training = [(i / 10, (i, i // 4)) for i in range(600)]
    puts = _paced_puts(pacing, training)
    assert [t for t, _ in puts] == [float(t) for t in range(0, 60, 5)]
    assert all(value == (round(t * 10), round(t * 10) // 4) for t, value in puts)  # the newest
    # Steady: nothing changes any more. The newest value, still waiting, lands once; then
    # nothing is written however long the node runs.
    last = training[-1][1]
    still = _paced_puts(pacing, [(60 + i / 10, last) for i in range(1200)])
    assert still == [(60.0, last)]
    # A put that failed is not "written": the same value offered again waits to be retried.
    pacing.offer(1, (700, 1))
    batch = pacing.take(200.0)
    pacing.failed(batch)
    assert pacing.failing and pacing.wait_s(200.0, urgent=True) == COMMIT_RECORD_EVERY_S
    pacing.offer(1, (700, 1))
    assert pacing.pending == {1: (700, 1)}


def test_a_commit_record_whose_anchors_ran_ahead_does_not_wait_for_the_pace() -> None:
    """At fast steps, 5 s of anchors outnumber what a store keeps above the safe step: the
    record is put once half of that many anchors are newer than the one in etcd."""
    half = ANCHORS_ABOVE_FLOOR // 2
    pacing: Pacing[CommitValue] = Pacing(COMMIT_RECORD_EVERY_S, anchors_ran_ahead)
    puts = []
    for i in range(100):  # an anchor every 0.1 s, 10 s
        now = i / 10
        value: CommitValue = (i, tuple(range(i, max(-1, i - 16), -1)), {"n1": (max(0, i - 1),)})
        pacing.offer(1, value)
        if pacing.pending and pacing.wait_s(now) <= 0:
            puts += [round(now, 1) for _ in pacing.take(now)]
    assert puts == [round(k * half / 10, 1) for k in range(100 // half + 1)]
    # Replicas count per origin; a record with nothing new does not hurry.
    written: CommitValue = (5, (5, 4), {"n1": (3,)})
    assert anchors_ran_ahead(written, (6, (5, 4), {"n1": tuple(range(3, 3 + half + 1))}))
    assert not anchors_ran_ahead(written, (6, (6, 5, 4), {"n1": (4, 3)}))
    assert not anchors_ran_ahead(None, written)  # the first is put at once anyway


def test_a_fenced_node_keeps_only_the_newest_few_uncommitted_snapshots(tmp_path: Path) -> None:
    cluster = _SlowCluster(put_s=0.0)
    cluster.registration = FakeRegistration(lapsed=True)  # the node is fenced
    agent, writer = _running_agent(tmp_path, cluster)
    agent.membership.take_lease()
    for step in range(1, 101):
        report = write_step(agent.store, step, generation=1)
        w = agent.pool.worker(writer.pid)
        assert w is not None
        agent.executor.run(agent.durability.on_snapshot(w, {"step": step, "pieces": report}))
    steps = sorted(step for _, _, step, _ in agent.store.layout.step_dirs("n0"))
    assert steps == [98, 99, 100]  # FENCED_SNAPSHOTS_KEPT, nothing committed
    assert sorted(agent.durability.state.snap_reports) == [(1, 98), (1, 99), (1, 100)]
    assert len(agent.store.reported_steps()) == FENCED_SNAPSHOTS_KEPT
    assert agent.store.committed_steps() == []


def _resume_dirs(agent: Agent) -> list[str]:
    return sorted(d.name for d in (agent.cfg.state_dir / "resume").iterdir())


def _fetched(agent: Agent, gs: GenerationProgress) -> None:
    """What a fetch leaves: the generation's resume directory with a piece in it."""
    d = agent.follower.resume_dir(gs)
    d.mkdir(parents=True, exist_ok=True)
    (d / "embed.tp0-1.safetensors").write_bytes(b"x" * 4096)


def test_failed_generations_leave_no_resume_directories_behind(tmp_path: Path) -> None:
    agent, _ = _running_agent(tmp_path, _SlowCluster(put_s=0.0))
    agent.pool.forget(100)  # the generation before is over here
    for generation in range(2, 6):
        record = GenerationRecord(
            generation, _plan(generation).to_dict(), "n0", time.time(), resume_step=3
        )
        gs = agent.follower.state.gen = GenerationProgress(
            record=record, plan=Plan.from_dict(record.plan)
        )
        agent.follower.step()  # no old workers: holdings reported, MOVING
        assert gs.phase is Phase.MOVING
        _fetched(agent, gs)
        gs.enter(
            Phase.FAILED, time.monotonic()
        )  # e.g. a peer's transfer failed: the leader re-plans
    assert _resume_dirs(agent) == ["gen-000005"]  # only the newest generation's


def test_a_failed_fetch_leaves_no_resume_directory(tmp_path: Path) -> None:
    agent, _ = _running_agent(tmp_path, _SlowCluster(put_s=0.0))
    record = GenerationRecord(2, _plan(2).to_dict(), "n0", time.time(), resume_step=3)
    gs = agent.follower.state.gen = GenerationProgress(
        record=record, plan=Plan.from_dict(record.plan), phase=Phase.MOVING
    )
    agent.view.state.barriers = {"resume-2": {RESUME_MEMBER: {"step": 3, "fetches": {}}}}
    _fetched(agent, gs)
    failed: Future[FetchOutcome] = Future()
    failed.set_result(FetchOutcome(error="StateUnavailableError: a peer went away"))
    agent.follower.track_fetch(gs.generation, failed, TransferProgress())
    agent.follower.step()
    assert gs.phase is Phase.FAILED
    assert _resume_dirs(agent) == []


def test_resume_directories_compare_generations_as_numbers(tmp_path: Path) -> None:
    agent, _ = _running_agent(tmp_path, _SlowCluster(put_s=0.0))
    for generation in (999_999, 1_000_000, 1_000_001):
        record = GenerationRecord(generation, _plan(1).to_dict(), "n0", time.time())
        _fetched(agent, GenerationProgress(record=record, plan=Plan.from_dict(record.plan)))
    agent.follower.clean_local(1_000_001)
    assert _resume_dirs(agent) == ["gen-1000001"]


def _record(generation: int) -> GenerationRecord:
    return GenerationRecord(generation, _plan(1).to_dict(), "n9", time.time(), resume_step=0)


def test_a_follower_forgets_the_detection_times_of_generations_it_entered(tmp_path: Path) -> None:
    agent, _ = _running_agent(tmp_path, _SlowCluster(put_s=0.0))
    for generation in range(2, 202):
        agent.follower.report_failure(generation - 1, "worker rank 0 exited with code 1")
        agent.view.state.record = _record(generation)
        agent.follower.step()
    assert len(agent.follower.state.detected) <= 1  # only the leader deleted them before


class _UnreachableArrivals(Arrivals):
    def arrive(
        self, barrier: str, node_id: str, value: Any = None, *, lease_id: int | None = None
    ) -> None:
        raise ClusterUnavailableError("etcd: connection refused", fast=True)


class _Unreachable(_SlowCluster):
    """etcd refuses every arrival."""

    def __init__(self) -> None:
        super().__init__()
        self.arrivals = _UnreachableArrivals(self.reads)


def test_failure_reports_replaced_by_a_newer_plan_are_not_remembered(tmp_path: Path) -> None:
    agent, _ = _running_agent(tmp_path, _Unreachable())
    for generation in range(1, 201):
        agent.follower.state.gen = GenerationProgress(
            record=_record(generation), plan=Plan.from_dict(_record(generation).plan)
        )
        agent.follower.report_failure(generation, "worker rank 0 exited with code 1")  # held
    agent.follower.state.gen = GenerationProgress(
        record=_record(201), plan=Plan.from_dict(_record(201).plan)
    )
    agent.follower.publish_failures()
    assert agent.follower.state.pending_failures == {}
    assert agent.follower.state.failures_held == set()


def test_the_leaders_rendezvous_store_keeps_only_the_running_generations_keys(
    tmp_path: Path,
) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    cluster = _SlowCluster(put_s=0.0)
    agent, _ = _running_agent(tmp_path, cluster)
    store = dist.TCPStore(  # what the leader starts for its term (real, loopback)
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )
    term = cluster.campaign("n0", 30)
    assert term is not None
    agent.leader.begin_term(term, RendezvousStore(store, f"127.0.0.1:{store.port}"))
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=30))
    for generation in range(1, 51):
        ranks = dist.PrefixStore(f"gen{generation}", client)  # what each worker does
        for rank in range(4):
            ranks.set(f"rank{rank}", "127.0.0.1:29500")
            ranks.add("arrived", 1)
        now = time.time()
        agent.view.state.barriers = {
            f"started-{generation}": {"n0": {"at": now, "moved_at": now}},
            f"resume-{generation}": {RESUME_MEMBER: {"step": 0}},
        }
        gs = GenerationProgress(
            record=_record(generation),
            plan=Plan.from_dict(_record(generation).plan),
            phase=Phase.RUNNING,
        )
        agent.leader.state.at(generation, time.monotonic()).resume_written = True
        lead_timeline(agent, gs)  # the generation runs on every node
        assert agent.leader.state.timeline_written
    assert sorted(store.list_keys()) == [
        "gen50/arrived",
        "gen50/rank0",
        "gen50/rank1",
        "gen50/rank2",
        "gen50/rank3",
    ]
    cluster.close()
