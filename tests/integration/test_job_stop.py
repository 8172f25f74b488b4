"""`elasticpp job stop`, end to end: a real etcd, two real agents with real workers training a
job that would run for hours. The stop ends it at one step boundary: every node commits that
step, its pieces are persisted into the job's checkpoint directory before the job's end is on
record, the agents exit 0 (the Kubernetes Job completes), `job status` says `stopped`, a
second stop is told so; `job reset` lets agents started again train on from exactly that
step, recomputing nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elasticpp.agent.localcluster import LocalCluster
from elasticpp.cluster.client import ClusterClient
from elasticpp.store.checkpoints import find_latest_checkpoint

SPEC: dict[str, Any] = {
    "name": "llm", "model": "tiny", "global_batch": 4, "micro_batch": 2, "steps": 100_000,
    "seed": 0, "min_nodes": 2, "max_nodes": 2, "lease_ttl_s": 3, "replication_copies": 0,
    "stop_timeout_s": 10, "persist_every": 100_000,
}  # fmt: skip


@pytest.fixture
def cluster(tmp_path: Path, no_orphans: None) -> Iterator[LocalCluster]:
    spec = {**SPEC, "persist_dir": str(tmp_path / "checkpoints")}
    lc = LocalCluster(tmp_path / "job", spec, nodes=2, slots=1, agent_args=["--on-job-end", "exit"])
    try:
        yield lc
    finally:
        lc.close()


def _job(lc: LocalCluster, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "elasticpp.cli.main", "job", *args, "--etcd", lc.etcd.endpoint,
         "--name", "llm"],
        capture_output=True, text=True, timeout=timeout_s, check=False,
    )  # fmt: skip


def _logs(lc: LocalCluster) -> str:
    return "\n".join(n.log_path.read_text(encoding="utf-8")[-3000:] for n in lc.nodes if n.log_path)


@pytest.mark.timeout(300)
def test_a_stopped_job_ends_at_one_committed_persisted_step_and_resumes_there_after_reset(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    lc = cluster
    lc.start()
    lc.wait_for(lambda: lc.max_step() >= 3, 150, "the job training")

    stop = _job(lc, "stop", "--reason", "maintenance window", "--wait", "120", "-o", "json",
                timeout_s=150)  # fmt: skip
    assert stop.returncode == 0, stop.stderr + _logs(lc)
    end = json.loads(stop.stdout)["end"]
    assert end["status"] == "stopped" and "maintenance window" in end["reason"]
    step = end["step"]
    assert step >= 3 and "checkpoint persisted" in end["reason"], end

    # Every agent exits 0: the job is over, not left (the unfinished code would say so).
    for n in lc.nodes:
        assert n.proc is not None
        assert n.proc.wait(timeout=60) == 0, _logs(lc)
    # The step every node committed is the one persisted, complete (its manifest is written
    # last), and no node trained past it.
    assert find_latest_checkpoint(tmp_path / "checkpoints").step == step
    assert lc.max_step() == step - 1
    with ClusterClient([lc.etcd.endpoint], "llm") as c:
        arrivals, _ = c.arrivals.barrier_state("stop")
    assert {n: v["step"] for n, v in arrivals.items()} == {"node-0": step, "node-1": step}

    status = json.loads(_job(lc, "status", "-o", "json").stdout)
    assert status["state"] == "stopped" and status["end"]["step"] == step
    again = _job(lc, "stop", "-o", "json")
    assert again.returncode == 0 and "stopped already" in json.loads(again.stdout)["message"]

    before = len(lc.timelines())
    reset = _job(lc, "reset")
    assert reset.returncode == 0, reset.stderr
    assert json.loads(_job(lc, "status", "-o", "json").stdout)["state"] == "waiting"
    for n in lc.nodes:
        lc.start_node(n.node_id)
    lc.wait_for(lambda: len(lc.timelines()) > before, 150, "the job training on after the reset")
    timeline = lc.timelines()[-1]
    assert timeline["resume_step"] == step and timeline["steps_recomputed"] == 0, timeline


def test_a_job_with_no_agent_or_one_that_ended_is_not_stopped(cluster: LocalCluster) -> None:
    lc = cluster
    lc.etcd.start()
    absent = _job(lc, "stop")
    assert absent.returncode == 2 and "no such job in etcd" in absent.stderr
    with ClusterClient([lc.etcd.endpoint], "llm") as c:
        c.put_spec_if_absent('{"name": "llm"}')
        nobody = _job(lc, "stop")
        assert nobody.returncode == 2 and "no agent is registered" in nobody.stderr
        assert c.health.stop_request() is None  # nothing was asked
        c.health.end_job("failed", "failure budget spent", "n0")
    ended = _job(lc, "stop")
    assert ended.returncode == 2 and "job llm is failed already" in ended.stderr
