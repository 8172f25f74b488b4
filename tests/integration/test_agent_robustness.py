"""The agent under sequences of faults: each test reproduces a defect that left a job
wedged or lost state, and checks the job now finishes on the uninterrupted run's curve."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from elasticpp.agent.localcluster import LocalCluster
from elasticpp.proctree import blocked_reading_stdin, descendants
from elasticpp.rpc.agent.v1 import agent_pb2, agent_pb2_grpc
from elasticpp.waiting import wait_until

STEPS = 12
SPEC: dict[str, Any] = {
    "name": "robust",
    "model": "tiny",
    "global_batch": 8,
    "micro_batch": 2,
    "steps": STEPS,
    "seed": 4,
    "min_nodes": 1,
    "max_nodes": 2,
    "lease_ttl_s": 3,
    "join_settle_s": 0.5,
    "hang_timeout_s": 20,
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    out = tmp_path_factory.mktemp("ref") / "ref.jsonl"
    subprocess.run(
        [
            sys.executable, "-m", "elasticpp.cli.main", "train", "--model", "tiny",
            "--global-batch", "8", "--micro-batch", "2", "--steps", str(STEPS), "--seed", "4",
            "--metrics", str(out),
        ],
        check=True,
        timeout=240,
    )  # fmt: skip
    return {int(r["step"]): float(r["loss"]) for r in map(json.loads, out.read_text().splitlines())}


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    lc = LocalCluster(tmp_path / "job", SPEC, nodes=2, slots=1)
    try:
        yield lc
    finally:
        lc.close()
        left = list(descendants(os.getpid()))
        assert not left, f"processes left behind: {left}"


def _training_pids(lc: LocalCluster, node_id: str) -> set[int]:
    with grpc.insecure_channel(lc.node(node_id).address) as ch:
        status = agent_pb2_grpc.AgentServiceStub(ch).GetStatus(
            agent_pb2.GetStatusRequest(), timeout=10
        )
    return {w.pid for w in status.workers if w.state in ("starting", "running")}


def _warm_spares(lc: LocalCluster, node_id: str) -> set[int]:
    # The node's worker processes that hold no rank and wait for one: its warm workers (not
    # its worker template, which forks them).
    training = _training_pids(lc, node_id)
    return {p for p in lc.worker_pids(node_id) if p not in training and blocked_reading_stdin(p)}


@pytest.mark.timeout(240)
def test_a_warm_spare_that_dies_is_replaced_so_the_next_recovery_can_start(
    cluster: LocalCluster, reference: dict[int, float]
) -> None:
    # One slot per node: after a worker crash the node can only run its rank again on its
    # warm spare. Kill the spare first (an OOM kill, a crash at import), then the worker.
    cluster.start()
    cluster.wait_for(lambda: cluster.max_step() >= 2, 120, "step 2")
    node = cluster.nodes[1].node_id
    found: set[int] = set()
    assert wait_until(lambda: bool(found.update(_warm_spares(cluster, node)) or found), 60)
    for pid in found:
        os.kill(pid, signal.SIGKILL)
    for pid in _training_pids(cluster, node):
        os.kill(pid, signal.SIGKILL)
    cluster.wait_finished(180)
    curve = cluster.curve()
    assert sorted(curve) == list(range(STEPS)), sorted(curve)
    for step, (loss, _gen) in curve.items():
        assert loss == pytest.approx(reference[step], rel=1e-4), step


def _health(address: str) -> str:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def _health_or_none(address: str) -> str | None:
    try:
        return _health(address)
    except grpc.RpcError:
        return None  # not listening yet


@pytest.mark.timeout(180)
def test_health_is_not_serving_until_the_agent_has_joined_the_job(cluster: LocalCluster) -> None:
    cluster.etcd.start()
    cluster.etcd.kill()  # etcd down: the agent serves gRPC but keeps retrying to join
    node = cluster.start_node(cluster.nodes[0].node_id)
    status: list[str | None] = [None]

    def listening() -> bool:
        status[0] = _health_or_none(node.address)
        return status[0] is not None

    assert wait_until(listening, 90)
    assert status[0] == "NOT_SERVING"
    cluster.etcd.restart()
    assert wait_until(lambda: _health_or_none(node.address) == "SERVING", 90)


def _skipped_values(port: int) -> float:
    """An agent's count of unreadable etcd values it skipped (0 until it serves metrics)."""
    from tests.recovery import scrape

    try:
        return scrape(port).get("elasticpp_etcd_values_skipped_total", 0.0)
    except OSError:
        return 0.0  # not serving yet


@pytest.mark.timeout(240)
def test_unreadable_etcd_values_are_skipped_and_counted_not_fatal(
    cluster: LocalCluster, reference: dict[int, float]
) -> None:
    from elasticpp.cluster.client import ClusterClient
    from elasticpp.cluster.etcd.kv import EtcdKV

    # The barrier values are there before the agents start: every agent reads them on every
    # refresh from its first on, so its counter is up long before the job can finish (and
    # its metrics go with it). A commit record, even an unreadable one, says the job
    # committed before (it would not start from scratch): that one comes once it trains.
    cluster.etcd.start()
    keys = ClusterClient([cluster.etcd.endpoint], SPEC["name"]).keys
    raw = EtcdKV([cluster.etcd.endpoint])
    try:
        raw.put(keys.barrier("done", "intruder"), "{not json")
        raw.put(keys.barrier("timelines", "intruder"), json.dumps({"format_version": 99}))
        raw.put(keys.suspect("intruder"), "[1, 2, 3]")
        cluster.start()
        cluster.wait_for(
            lambda: all(_skipped_values(n.metrics_port) > 0 for n in cluster.nodes),
            120,
            "every agent to count the values it skipped",
        )
        cluster.wait_for(lambda: cluster.max_step() >= 2, 120, "step 2")
        raw.put(keys.commit(1, "intruder"), json.dumps({"format_version": 1, "step": "x"}))
    finally:
        raw.close()
    cluster.wait_finished(180)  # raises if an agent died
    curve = cluster.curve()
    assert sorted(curve) == list(range(STEPS)), sorted(curve)
    for step, (loss, _gen) in curve.items():
        assert loss == pytest.approx(reference[step], rel=1e-4), step
    logs = "".join(n.log_path.read_text() for n in cluster.nodes)
    for key in (keys.barrier("done", "intruder"),):
        assert f"etcd value of {key} skipped" in logs, key


@pytest.mark.timeout(240)
def test_a_worker_failure_seen_while_etcd_is_down_is_reported_when_it_returns(
    cluster: LocalCluster, reference: dict[int, float]
) -> None:
    # Before: the failure report was sent once, dropped while etcd was down, and never
    # derived again: with every rank gone, the job stalled for good.
    cluster.start()
    cluster.wait_for(lambda: cluster.max_step() >= 2, 120, "step 2")
    cluster.etcd.stop()
    for pid in _training_pids(cluster, cluster.nodes[1].node_id):
        os.kill(pid, signal.SIGKILL)

    # The surviving rank's collective fails too: both agents see a failure during the outage.
    def failures_seen() -> bool:
        return all(
            n.log_path is not None and "failure in generation" in n.log_path.read_text()
            for n in cluster.nodes
        )

    assert wait_until(failures_seen, 60)

    # The outage lasts until every agent's report has failed past the etcd client's retries.
    def reports_held() -> bool:
        return all("held until etcd is back" in n.log_path.read_text() for n in cluster.nodes)

    assert wait_until(reports_held, 60)
    cluster.etcd.start()
    cluster.wait_finished(180)
    curve = cluster.curve()
    assert sorted(curve) == list(range(STEPS)), sorted(curve)
    for step, (loss, _gen) in curve.items():
        assert loss == pytest.approx(reference[step], rel=1e-4), step
