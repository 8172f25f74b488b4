"""`elasticpp job checkpoint`, end to end: a real etcd, two real agents with real workers.
The command persists the newest step both nodes hold into the job's persist_dir while the
job trains on: the checkpoint is complete (its manifest written) at that step, and every
node says its pieces are persisted. A job that cannot be checkpointed is refused (exit 2)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elasticpp.agent.jobspec import parse_job_spec
from elasticpp.agent.localcluster import LocalCluster
from elasticpp.cluster.client import ClusterClient
from elasticpp.store.checkpoints import find_latest_checkpoint
from tests.jobcli import job as _job

SPEC: dict[str, Any] = {
    "name": "llm", "model": "tiny", "global_batch": 4, "micro_batch": 2, "steps": 100_000,
    "seed": 0, "min_nodes": 2, "max_nodes": 2, "lease_ttl_s": 3, "replication_copies": 0,
    "stop_timeout_s": 10, "snapshot_every_s": 2, "persist_every": 100_000,
}  # fmt: skip


@pytest.fixture
def cluster(tmp_path: Path, no_orphans: None) -> Iterator[LocalCluster]:
    spec = {**SPEC, "persist_dir": str(tmp_path / "checkpoints")}
    lc = LocalCluster(tmp_path / "job", spec, nodes=2, slots=1)
    try:
        yield lc
    finally:
        lc.close()


def _committed_everywhere(lc: LocalCluster) -> bool:
    """Every node of the running generation has a commit on record."""
    with ClusterClient([lc.etcd.endpoint], "llm") as c:
        record, _ = c.read_generation()
        if record is None:
            return False
        records = c.commits.commit_records(record.generation)
        return all(n in records and records[n].step >= 0 for n in record.planned_set)


@pytest.mark.timeout(300)
def test_a_checkpoint_now_persists_the_newest_step_every_node_holds_while_training_goes_on(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    lc = cluster
    lc.start()
    lc.wait_for(lambda: _committed_everywhere(lc), 150, "a commit on every node")
    assert not (tmp_path / "checkpoints").exists()  # no periodic checkpoint here
    ckpt = _job(lc, "checkpoint", "--reason", "before the upgrade", "--wait", "120", "-o",
                "json", timeout_s=150)  # fmt: skip
    assert ckpt.returncode == 0, ckpt.stdout + ckpt.stderr
    out = json.loads(ckpt.stdout)
    step = out["step"]
    assert out["nodes"] == {"node-0": "persisted", "node-1": "persisted"}, out
    latest = find_latest_checkpoint(tmp_path / "checkpoints")
    assert latest is not None and latest.step == step  # complete: its manifest is written
    trained = lc.max_step()
    lc.wait_for(lambda: lc.max_step() > trained, 60, "training going on")
    events = "\n".join(n.log_path.read_text(encoding="utf-8") for n in lc.nodes)
    assert "checkpoint asked by" in events and "before the upgrade" in events


def test_a_job_that_cannot_be_checkpointed_is_refused(cluster: LocalCluster) -> None:
    lc = cluster
    lc.etcd.start()
    absent = _job(lc, "checkpoint")
    assert absent.returncode == 2 and "no such job in etcd" in absent.stderr
    plain = parse_job_spec(
        {k: v for k, v in SPEC.items() if k != "persist_every"}
    )  # no persist_dir
    with ClusterClient([lc.etcd.endpoint], "llm") as c:
        c.put_spec_if_absent(plain.to_json())
        nowhere = _job(lc, "checkpoint")
        assert nowhere.returncode == 2 and "has no persist_dir" in nowhere.stderr
        c.health.end_job("failed", "failure budget spent", "n0")
    ended = _job(lc, "checkpoint")
    assert ended.returncode == 2 and "nothing to checkpoint" in ended.stderr
