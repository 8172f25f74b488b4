"""A job whose etcd state is wiped mid-run: real etcd, real agents, real workers.

The agents see their job epoch go and stop (EPOCH_ENDED_EXIT); started again, they create a
new, larger epoch, resume from the newest step the nodes hold from the old one, and finish
the job. By invariant 1 a step trained in both epochs has the same loss in both.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elasticpp.agent.localcluster import LocalCluster
from elasticpp.agent.view.step import EPOCH_ENDED_EXIT
from elasticpp.cluster.client import ClusterClient
from elasticpp.cluster.etcd.kv import EtcdKV
from elasticpp.waiting import wait_until

STEPS = 10
SPEC: dict[str, Any] = {
    "name": "etest",
    "model": "tiny",
    "global_batch": 8,
    "micro_batch": 2,
    "steps": STEPS,
    "seed": 5,
    "min_nodes": 2,
    "max_nodes": 2,
    "lease_ttl_s": 3,
    "join_settle_s": 0.5,
    "hang_timeout_s": 20,
    # Every step committed, so what the nodes hold at the wipe is the step they stopped at
    # (under the default time rule a 10-step job may commit nothing before its end).
    "snapshot_every": 1,
}


@pytest.fixture
def cluster(tmp_path: Path, no_orphans: None) -> Iterator[LocalCluster]:
    # `no_orphans` (tests/conftest.py) fails the test if any process outlives the cluster.
    lc = LocalCluster(tmp_path / "job", SPEC, nodes=2, slots=1)
    try:
        yield lc
    finally:
        lc.close()


def _epoch(lc: LocalCluster) -> int | None:
    with ClusterClient([lc.etcd.endpoint], SPEC["name"]) as c:
        current = c.epoch()
    return None if current is None else current.epoch


@pytest.mark.timeout(180)
def test_a_job_whose_etcd_state_is_wiped_resumes_from_what_its_nodes_hold(
    cluster: LocalCluster,
) -> None:
    cluster.start()
    cluster.wait_for(lambda: cluster.max_step() >= 4, 120, "step 4")
    first = _epoch(cluster)
    assert first is not None
    kv = EtcdKV([cluster.etcd.endpoint])
    try:
        kv.delete_prefix(f"/elasticpp/{SPEC['name']}/")  # an operator's wipe
    finally:
        kv.close()

    def all_stopped() -> bool:
        return all(n.proc is not None and n.proc.poll() is not None for n in cluster.nodes)

    assert wait_until(all_stopped, 60), "the agents did not stop when their epoch went"
    assert [n.proc.returncode for n in cluster.nodes] == [EPOCH_ENDED_EXIT] * 2  # type: ignore[union-attr]
    before = cluster.max_step()  # every step trained was committed (snapshot_every: 1)
    for n in cluster.nodes:
        cluster.start_node(n.node_id)
    cluster.wait_finished(120)
    second = _epoch(cluster)
    assert second is not None and second > first
    timelines = cluster.timelines()
    first_gen = next(t for t in timelines if int(t["generation"]) == 1)
    # Resumed from the pre-wipe state (at most the step in flight recomputed), not step 0.
    assert before - 1 <= int(first_gen["resume_step"]) <= before + 1, (before, first_gen)
    losses: dict[int, list[float]] = {}
    for r in cluster.metrics():
        losses.setdefault(int(r["step"]), []).append(float(r["loss"]))
    assert sorted(losses) == list(range(STEPS))
    for step, seen in losses.items():
        assert max(seen) - min(seen) <= 1e-4 * abs(seen[0]), (step, seen)
    for n in cluster.nodes:  # every commit of the new epoch sits in its own epoch directory
        manifests = list((n.state_dir / "store" / "own").glob("epoch-*/gen-*/step-*/manifest.json"))
        assert {json.loads(m.read_text())["epoch"] for m in manifests} <= {first, second}
        assert any(json.loads(m.read_text())["epoch"] == second for m in manifests)
