"""A node that stays sick is set aside and the job trains on the others, end to end: a real
etcd, real agent processes, real worker processes, and real faults — a node whose spares
never become ready, an agent whose decision loop is wedged (it answers NOT_SERVING), and a
node whose state disk is too small for its share. Each run's loss curve must equal the
uninterrupted run's."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from elasticpp.agent.localcluster import LocalCluster
from elasticpp.cluster.client import ClusterClient
from elasticpp.rpc.agent.v1 import agent_pb2, agent_pb2_grpc
from tests.recovery import RECOVERY_SPEC, assert_same_curve

STEPS = 30
SPEC: dict[str, Any] = {
    **RECOVERY_SPEC,
    "name": "sick",
    "steps": STEPS,
    "stop_timeout_s": 8,
    # Healthy spares import torch in a few seconds, far longer on a loaded 2-core machine.
    "ready_timeout_s": 30,
    "quarantine_s": 600,  # set aside for the rest of the test
}
SICK = "node-2"


@pytest.fixture
def cluster(tmp_path: Path, no_orphans: None) -> Iterator[LocalCluster]:
    # `no_orphans` (tests/conftest.py) fails the test if any process outlives the cluster.
    lc = LocalCluster(tmp_path / "job", SPEC, nodes=3, slots=1)
    try:
        yield lc
    finally:
        lc.close()


@pytest.fixture
def reference(references: Callable[[int], dict[int, float]]) -> dict[int, float]:
    return references(STEPS)


def _client(lc: LocalCluster) -> ClusterClient:
    return ClusterClient([lc.etcd.endpoint], SPEC["name"])


def _quarantined(lc: LocalCluster) -> dict[str, Any]:
    with _client(lc) as c:
        return dict(c.health.quarantined())


def _status(address: str) -> agent_pb2.GetStatusResponse:
    with grpc.insecure_channel(address) as ch:
        return agent_pb2_grpc.AgentServiceStub(ch).GetStatus(
            agent_pb2.GetStatusRequest(), timeout=10
        )


def _finish_without(lc: LocalCluster, sick: str, timeout_s: float) -> None:
    """Every healthy agent finishes the job and exits 0; the sick one may still be stuck."""
    healthy = [n for n in lc.nodes if n.node_id != sick]
    lc.wait_for(
        lambda: all(n.proc is not None and n.proc.poll() is not None for n in healthy),
        timeout_s,
        "the healthy agents to finish the job",
    )
    assert [n.proc.returncode for n in healthy if n.proc] == [0] * len(healthy)


def _train_on_without(
    lc: LocalCluster, sick: str, reference: dict[int, float], steps: int = 10
) -> None:
    """The job trains `steps` more steps in a generation without `sick`, on the reference
    curve so far. For jobs kept long only so that the fault comes before their end: what
    comes after those steps (the job's end, its agents exiting 0) is what every test in
    test_agent_recovery.py checks, and training it out here cost a minute or more a test."""
    with _client(lc) as c:
        record, _ = c.read_generation()
    assert record is not None and sick not in set(record.planned_nodes)
    gen, since = record.generation, lc.max_step()
    lc.wait_for(
        lambda: (
            max((st for st, (_, g) in lc.curve().items() if g >= gen), default=-1) >= since + steps
        ),
        120,
        f"{steps} steps without {sick}",
    )
    curve = lc.curve()
    assert sorted(curve) == list(range(max(curve) + 1)), f"steps trained: {sorted(curve)}"
    for step, (loss, _gen) in curve.items():
        assert abs(loss - reference[step]) <= 1e-4 * abs(reference[step]), (
            f"step {step}: elastic loss {loss} vs uninterrupted {reference[step]}"
        )


def _leader(lc: LocalCluster) -> str | None:
    with _client(lc) as c:
        return c.leader()


def _start_sick_first(lc: LocalCluster, sitecustomize: str, hook: Path) -> None:
    """node-2 starts first, with `sitecustomize` loaded by each of its Python processes,
    and leads; then the others start. Every plan until node-2 is set aside has ranks on it,
    so no generation before that trains a step."""
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(sitecustomize)
    lc.etcd.start()
    lc.start_node(SICK, env={"PYTHONPATH": os.pathsep.join([str(hook), *sys.path])})
    lc.wait_for(lambda: _leader(lc) == SICK, 60, f"{SICK} to register and lead")
    for n in lc.nodes[:2]:
        lc.start_node(n.node_id)


def _last_plan_nodes(lc: LocalCluster) -> set[str]:
    with _client(lc) as c:
        record, _ = c.read_generation()
    assert record is not None
    return set(record.planned_nodes)


@pytest.mark.timeout(300)
def test_a_node_whose_spares_never_become_ready_is_quarantined_and_the_job_goes_on(
    cluster: LocalCluster, reference: dict[int, float], tmp_path: Path
) -> None:
    # node-2's workers hang before they report ready (a stuck driver initialisation, say):
    # Python imports sitecustomize at start-up, before the worker's own code runs.
    hang = (
        "import os, time\n"
        f"if os.environ.get('ELASTICPP_NODE_ID') == {SICK!r}:\n"
        "    time.sleep(3600)\n"
    )
    _start_sick_first(cluster, hang, tmp_path / "hook")
    cluster.wait_for(lambda: SICK in _quarantined(cluster), 150, f"{SICK} quarantined")
    reason = _quarantined(cluster)[SICK].reason
    assert "not ready within 30 s" in reason, reason
    # The node itself says so (its status is published by its loop, a moment later).
    cluster.wait_for(
        lambda: [q.node_id for q in _status(cluster.node(SICK).address).quarantined] == [SICK],
        30,
        f"{SICK}'s status to show its quarantine",
    )
    _finish_without(cluster, SICK, 180)
    assert_same_curve(cluster, reference)
    assert SICK not in _last_plan_nodes(cluster)


# Loaded by every Python process of the sick node (sitecustomize): once the trainer module
# is imported (in the worker template, before it forks, or in a worker), its training step
# exits the process at once, so no rank there ever completes a step.
DIE_IN_FIRST_STEP = """
import importlib.abc, importlib.machinery, os, sys

class _DieInFirstStep(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "elasticpp.train.engine.trainer":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.Trainer.train_step = lambda *a, **k: os._exit(1)

        spec.loader.exec_module = exec_module
        return spec

if os.environ.get("ELASTICPP_NODE_ID") == %r:
    sys.meta_path.insert(0, _DieInFirstStep())
"""


@pytest.mark.timeout(300)
def test_a_node_whose_workers_die_in_their_first_step_is_quarantined_and_the_job_goes_on(
    tmp_path: Path, reference: dict[int, float], no_orphans: None
) -> None:
    """Strikes were cleared when every rank of a generation started: a node whose workers
    die in their first step was struck, cleared at the next start, struck again, and never
    quarantined, while its failed generations spent the job's failure budget (7 failed
    generations with quarantine_after: 2 in the operations review). Now only a node whose
    ranks completed a step of a generation (`stepped-G`) has its strikes cleared."""
    spec = {**SPEC, "quarantine_after": 2}
    cluster = LocalCluster(tmp_path / "job", spec, nodes=3, slots=1)
    try:
        _start_sick_first(cluster, DIE_IN_FIRST_STEP % SICK, tmp_path / "hook")
        cluster.wait_for(lambda: SICK in _quarantined(cluster), 180, f"{SICK} quarantined")
        quarantined = _quarantined(cluster)
        assert set(quarantined) == {SICK}, quarantined  # its peers' failures followed its own
        assert "exited with code 1" in quarantined[SICK].reason, quarantined[SICK].reason
        cluster.wait_for(
            lambda: SICK not in _last_plan_nodes(cluster), 60, f"a generation without {SICK}"
        )
        _train_on_without(cluster, SICK, reference)
    finally:
        cluster.close()


@pytest.mark.timeout(300)
def test_a_leader_whose_loop_is_wedged_is_replaced_and_the_job_goes_on(
    tmp_path: Path, references: Callable[[int], dict[int, float]], no_orphans: None
) -> None:
    # node-2 leads, and its agent blocks for good the first time it records a step: its
    # metrics file is a FIFO nobody reads (a hung file system has the same effect). Its
    # gRPC threads still answer (NOT_SERVING once the loop has stalled) and its workers
    # train on: only a lease renewed by the loop's progress gives it away. The job must
    # outlast that (lease stall bound + TTL, ~8 s): 30 steps of the tiny model did not.
    steps = 200
    reference = references(steps)
    with LocalCluster(tmp_path / "job", {**SPEC, "steps": steps}, nodes=3, slots=1) as cluster:
        _wedged_leader_is_replaced(cluster, reference)


def _wedged_leader_is_replaced(cluster: LocalCluster, reference: dict[int, float]) -> None:
    sick = cluster.node(SICK)
    sick.state_dir.mkdir(parents=True)
    os.mkfifo(sick.state_dir / "metrics.jsonl")
    cluster.etcd.start()
    cluster.start_node(SICK)
    cluster.wait_for(lambda: _leader(cluster) == SICK, 60, f"{SICK} to lead")
    for n in cluster.nodes[:2]:
        cluster.start_node(n.node_id)
    cluster.wait_for(lambda: _leader(cluster) not in (None, SICK), 150, "a new leader")
    cluster.wait_for(
        lambda: SICK not in _last_plan_nodes(cluster), 60, f"a generation without {SICK}"
    )
    _train_on_without(cluster, SICK, reference)


def _tmpfs_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "mounting a small file system needs root"
    if shutil.which("mount") is None:
        return "no mount on PATH"
    return None


@pytest.mark.timeout(300)
@pytest.mark.skipif(_tmpfs_unavailable() is not None, reason=str(_tmpfs_unavailable()))
def test_a_node_whose_disk_cannot_hold_its_share_is_quarantined_and_the_job_goes_on(
    tmp_path: Path, references: Callable[[int], dict[int, float]], no_orphans: None
) -> None:
    # Long enough that the joining node (a cold start) is up before the job ends: it must
    # fetch its share from the others, which is what its disk cannot hold.
    steps = 120
    reference = references(steps)
    cluster = LocalCluster(tmp_path / "job", {**SPEC, "steps": steps}, nodes=3, slots=1)
    small = tmp_path / "small-disk"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(small)], check=True)
    try:
        # Room for logs, not for a copy of the model's state.
        filler = small / "filler"
        with filler.open("wb") as f:
            free = os.statvfs(small).f_bavail * os.statvfs(small).f_frsize
            f.write(b"\0" * max(0, free - (512 << 10)))
        cluster.etcd.start()
        for n in cluster.nodes[:2]:
            cluster.start_node(n.node_id)
        cluster.wait_for(lambda: cluster.max_step() >= 3, 120, "step 3")
        cluster.start_node(SICK, state_dir=small / "state")
        cluster.wait_for(lambda: SICK in _quarantined(cluster), 150, f"{SICK} quarantined")
        reason = _quarantined(cluster)[SICK].reason
        assert "No space left on device" in reason, reason
        cluster.wait_for(
            lambda: SICK not in _last_plan_nodes(cluster), 60, f"a generation without {SICK}"
        )
        _train_on_without(cluster, SICK, reference)
    finally:
        cluster.close()
        subprocess.run(["umount", "-l", str(small)], check=False)


HOLD_EXIT = Path(__file__).parents[2] / "tools" / "hold_exit.py"


def _ptrace_unavailable() -> str | None:
    if not sys.platform.startswith("linux"):
        return "holding a process at its exit needs Linux ptrace"
    scope = Path("/proc/sys/kernel/yama/ptrace_scope")
    if os.geteuid() != 0 and scope.is_file() and scope.read_text().strip() != "0":
        return "attaching to another process's child needs root or ptrace_scope 0"
    return None


@pytest.mark.timeout(300)
@pytest.mark.skipif(_ptrace_unavailable() is not None, reason=str(_ptrace_unavailable()))
def test_a_node_whose_old_worker_outlives_sigkill_is_quarantined_and_the_job_goes_on(
    cluster: LocalCluster, reference: dict[int, float]
) -> None:
    cluster.start()
    cluster.wait_for(lambda: cluster.max_step() >= 3, 120, "step 3")
    [pid] = [w.pid for w in _status(cluster.node(SICK).address).workers if w.state == "running"]
    # node-2's worker will not go for a minute once it starts to exit: a process that a
    # driver or file system hang keeps in uninterruptible sleep outlives SIGKILL that way.
    holder = subprocess.Popen(
        [sys.executable, str(HOLD_EXIT), str(pid), "60"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "attached"
        # A worker elsewhere dies: every node stops its workers at once, node-2 cannot.
        [victim] = [
            w.pid for w in _status(cluster.node("node-0").address).workers if w.state == "running"
        ]
        os.kill(victim, signal.SIGKILL)
        assert holder.stdout.readline().strip() == "held"  # node-2's agent killed it
        cluster.wait_for(lambda: SICK in _quarantined(cluster), 120, f"{SICK} quarantined")
        reason = _quarantined(cluster)[SICK].reason
        assert "still alive" in reason and str(pid) in reason, reason
        assert holder.poll() is None  # still held when the job went on without it
        _finish_without(cluster, SICK, 200)
        assert_same_curve(cluster, reference)
        assert SICK not in _last_plan_nodes(cluster)
    finally:
        holder.kill()  # lets the held worker go
        holder.wait()
