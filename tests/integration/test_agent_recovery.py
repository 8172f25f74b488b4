"""The node agent end to end: a real etcd, real agent processes, real worker processes.

Every test compares the elastic run's loss curve with an uninterrupted single-worker run of
the same job (`elasticpp train`, layout 1,1,1): invariant 1 says they are the same curve up
to floating-point summation order.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from elasticpp.agent.localcluster import LocalCluster
from elasticpp.cluster.client import ClusterClient
from elasticpp.proctree import descendants
from tests.recovery import RECOVERY_SPEC as SPEC
from tests.recovery import assert_same_curve, scrape


@pytest.fixture
def cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[LocalCluster]:
    spec = {**SPEC, **getattr(request, "param", {})}
    lc = LocalCluster(tmp_path / "job", spec, nodes=3, slots=2)
    try:
        yield lc
    finally:
        lc.close()
        left = [p for p in descendants(os.getpid())]
        assert not left, f"processes left behind: {left}"


def leader_of(lc: LocalCluster) -> str | None:
    with ClusterClient([lc.etcd.endpoint], SPEC["name"]) as c:
        return c.leader()


# Every step committed (the step rule; the default time rule commits a step every 2 s):
# then at most the step in flight is recomputed.
@pytest.mark.parametrize("cluster", [{"snapshot_every": 1}], indirect=True)
@pytest.mark.timeout(240)
def test_kill_9_of_a_node_recovers_with_the_same_loss_curve(
    cluster: LocalCluster, reference: dict[int, float]
) -> None:
    cluster.start()
    cluster.wait_for(lambda: cluster.max_step() >= 3, 120, "step 3")
    victim = next(n.node_id for n in cluster.nodes if n.node_id != leader_of(cluster))
    cluster.kill_node(victim)
    survivor = next(n for n in cluster.nodes if n.node_id != victim)
    cluster.wait_for(
        lambda: scrape(survivor.metrics_port).get("elasticpp_generation", 0) >= 2,
        120,
        "the survivors' metrics to show the new generation",
    )
    status = subprocess.run(
        [
            sys.executable,
            "-m",
            "elasticpp.cli.main",
            "ctl",
            "--agent",
            survivor.address,
            "status",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 0, status.stderr
    reply = json.loads(status.stdout)
    assert int(reply["generation"]) >= 2 and reply["layout"], reply
    cluster.wait_finished(180)
    assert_same_curve(cluster, reference)
    timelines = cluster.timelines()
    recovery = [t for t in timelines if victim in str(t["reason"]) or "failure" in str(t["reason"])]
    assert recovery, f"no recovery recorded: {timelines}"
    assert all(int(t["steps_recomputed"]) <= 1 for t in recovery)


@pytest.mark.timeout(240)
def test_killing_the_leaders_node_recovers_too(
    cluster: LocalCluster, reference: dict[int, float]
) -> None:
    cluster.start()
    cluster.wait_for(lambda: cluster.max_step() >= 3, 120, "step 3")
    leader = leader_of(cluster)
    assert leader is not None
    cluster.kill_node(leader)
    cluster.wait_for(lambda: leader_of(cluster) not in (None, leader), 60, "a new leader")
    cluster.wait_finished(180)
    assert_same_curve(cluster, reference)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("cluster", [{"min_nodes": 2, "steps": 40}], indirect=True)
def test_a_joining_node_switches_at_a_step_boundary_with_nothing_recomputed(
    cluster: LocalCluster, references: Callable[[int], dict[int, float]]
) -> None:
    # Long enough that the joining agent (a cold start) is up before the job ends.
    reference = references(40)
    cluster.etcd.start()
    for n in cluster.nodes[:2]:
        cluster.start_node(n.node_id)
    cluster.wait_for(lambda: cluster.max_step() >= 3, 120, "step 3")
    cluster.start_node(cluster.nodes[2].node_id)
    cluster.wait_finished(180)
    assert_same_curve(cluster, reference)
    joins = [t for t in cluster.timelines() if "join" in str(t["reason"])]
    assert joins, f"no join recorded: {cluster.timelines()}"
    assert all(int(t["steps_recomputed"]) == 0 for t in joins), joins
    gens = {gen for _loss, gen in cluster.curve().values()}
    assert len(gens) >= 2, "the new layout never trained a step"


@pytest.mark.timeout(240)
def test_a_hung_worker_is_detected_and_the_job_recovers(
    cluster: LocalCluster, reference: dict[int, float]
) -> None:
    cluster.start()
    cluster.wait_for(lambda: cluster.max_step() >= 3, 120, "step 3")
    from elasticpp.rpc.agent.v1 import agent_pb2, agent_pb2_grpc

    node = cluster.nodes[1]
    with grpc.insecure_channel(node.address) as ch:
        status = agent_pb2_grpc.AgentServiceStub(ch).GetStatus(
            agent_pb2.GetStatusRequest(), timeout=10
        )
    training = [w.pid for w in status.workers if w.state == "running"]
    assert training, status
    # A training worker (not a warm spare) stops making progress but does not exit.
    os.kill(training[0], signal.SIGSTOP)
    cluster.wait_finished(200)
    assert_same_curve(cluster, reference)
    assert any(
        "hung" in str(t["reason"]) or "failure" in str(t["reason"]) for t in cluster.timelines()
    ), cluster.timelines()


@pytest.mark.timeout(240)
def test_training_finishes_through_an_etcd_restart(
    cluster: LocalCluster, reference: dict[int, float]
) -> None:
    cluster.start()
    cluster.wait_for(lambda: cluster.max_step() >= 3, 120, "step 3")
    before = cluster.max_step()
    cluster.etcd.stop()
    # Training does not need etcd: steps keep coming while it is down.
    cluster.wait_for(lambda: cluster.max_step() >= before + 2, 60, "steps while etcd is down")
    cluster.etcd.start()
    cluster.wait_finished(180)
    assert_same_curve(cluster, reference)


@pytest.mark.timeout(240)
def test_a_stale_agent_of_an_old_generation_is_fenced(
    cluster: LocalCluster, reference: dict[int, float]
) -> None:
    from elasticpp.rpc.agent.v1 import agent_pb2, agent_pb2_grpc
    from elasticpp.rpc.state.v1 import state_pb2, state_pb2_grpc

    cluster.start()
    cluster.wait_for(lambda: cluster.max_step() >= 3, 120, "step 3")
    stale = next(n for n in cluster.nodes if n.node_id != leader_of(cluster))
    frozen = [stale.proc.pid, *descendants(stale.proc.pid)]  # type: ignore[union-attr]
    with ClusterClient([cluster.etcd.endpoint], SPEC["name"]) as c:
        old_gen = c.read_generation()[0].generation  # type: ignore[union-attr]
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    try:
        # Its lease lapses; the others move on to a newer generation without it.
        def moved_on() -> bool:
            with ClusterClient([cluster.etcd.endpoint], SPEC["name"]) as c:
                rec = c.read_generation()[0]
            return (
                rec is not None
                and rec.generation > old_gen
                and stale.node_id not in rec.planned_nodes
            )

        cluster.wait_for(moved_on, 90, "a generation without the frozen node")
        live = next(n for n in cluster.nodes if n is not stale)

        def live_agent_generation() -> int:
            with grpc.insecure_channel(live.address) as ch:
                stub = agent_pb2_grpc.AgentServiceStub(ch)
                return int(stub.GetStatus(agent_pb2.GetStatusRequest(), timeout=5).generation)

        cluster.wait_for(lambda: live_agent_generation() > old_gen, 30, "the live agent to move on")
        with grpc.insecure_channel(live.address) as ch:
            stub = state_pb2_grpc.StateServiceStub(ch)
            with pytest.raises(grpc.RpcError) as err:
                stub.ListSteps(state_pb2.ListStepsRequest(generation=old_gen), timeout=5)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
    cluster.wait_finished(180)
    assert_same_curve(cluster, reference)


@pytest.mark.timeout(120)
def test_an_agent_with_a_different_job_spec_is_refused(cluster: LocalCluster) -> None:
    cluster.etcd.start()
    cluster.start_node("node-0")

    def spec_stored() -> bool:
        with ClusterClient([cluster.etcd.endpoint], SPEC["name"]) as c:
            return c.spec() is not None

    cluster.wait_for(spec_stored, 60, "the first agent to store the spec")
    other = cluster.workdir / "other.yaml"
    other.write_text(json.dumps({**SPEC, "global_batch": 24, "seed": 4}))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "elasticpp.cli.main",
            "agent",
            "--etcd",
            cluster.etcd.endpoint,
            "--job-spec",
            str(other),
            "--node-id",
            "node-9",
            "--slots",
            "1",
            "--listen",
            "127.0.0.1:0",
            "--state-dir",
            str(cluster.workdir / "node-9"),
            "--metrics-port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "global_batch" in last and "seed" in last, last


@pytest.mark.timeout(240)
@pytest.mark.parametrize("cluster", [{"steps": 40}], indirect=True)
def test_a_drained_node_hands_off_at_a_step_boundary_and_exits_0(
    cluster: LocalCluster, references: Callable[[int], dict[int, float]]
) -> None:
    reference = references(40)  # long enough that the hand-off happens before the end
    cluster.start()
    cluster.wait_for(lambda: cluster.max_step() >= 3, 120, "step 3")
    leaving = cluster.nodes[1]
    ctl = subprocess.run(
        [
            sys.executable,
            "-m",
            "elasticpp.cli.main",
            "ctl",
            "--agent",
            leaving.address,
            "drain",
            "--wait",
            "120",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ctl.returncode == 0, ctl.stdout + ctl.stderr
    assert leaving.proc is not None
    assert leaving.proc.wait(timeout=120) == 0
    cluster.wait_finished(180)
    assert_same_curve(cluster, reference)
    drains = [t for t in cluster.timelines() if "drain" in str(t["reason"])]
    assert drains, cluster.timelines()
    assert all(int(t["steps_recomputed"]) == 0 for t in drains), drains
    assert all(leaving.node_id not in str(t["layout_after"]) for t in drains)


@pytest.mark.timeout(300)
def test_after_losing_every_node_the_job_resumes_from_the_persistent_checkpoint(
    tmp_path: Path, reference: dict[int, float]
) -> None:
    import shutil

    ckpt = tmp_path / "checkpoints"
    spec = {**SPEC, "persist_dir": str(ckpt), "persist_every": 4}
    lc = LocalCluster(tmp_path / "job", spec, nodes=3, slots=2)
    try:
        lc.start()
        lc.wait_for(lambda: any(ckpt.glob("step-*/manifest.json")), 150, "a checkpoint")
        saved = max(int(p.parent.name.split("-")[1]) for p in ckpt.glob("step-*/manifest.json"))
        for n in lc.nodes:
            lc.kill_node(n.node_id)
        before = lc.curve()
        for n in lc.nodes:
            shutil.rmtree(n.state_dir)  # the machines are gone, with everything they held
        for n in lc.nodes:
            lc.start_node(n.node_id)
        lc.wait_finished(200)
        assert_same_curve(lc, reference, earlier=before)
        resumed = [t for t in lc.timelines() if int(t["resume_step"]) > 0]
        assert resumed and int(resumed[-1]["resume_step"]) >= saved, lc.timelines()
    finally:
        lc.close()
    assert not descendants(os.getpid())
