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
from tests.jobcli import job as _job

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
        assert c.requests.stop_request() is None  # nothing was asked
        c.health.end_job("failed", "failure budget spent", "n0")
    ended = _job(lc, "stop")
    assert ended.returncode == 2 and "job llm is failed already" in ended.stderr


@pytest.mark.timeout(60)
def test_stop_if_running_of_a_job_with_nothing_to_stop_is_not_an_error(
    cluster: LocalCluster,
) -> None:
    """The teardown hook's form: nothing to stop is said, with exit 0 (a plain stop refuses
    each case with exit 2, above)."""
    lc = cluster
    lc.etcd.start()
    absent = _job(lc, "stop", "--if-running", "-o", "json")
    assert absent.returncode == 0, absent.stderr
    assert "no such job in etcd" in json.loads(absent.stdout)["message"]
    with ClusterClient([lc.etcd.endpoint], "llm") as c:
        c.put_spec_if_absent('{"name": "llm"}')
        nobody = _job(lc, "stop", "--if-running")
        assert nobody.returncode == 0 and "no agent is registered" in nobody.stdout
        assert c.requests.stop_request() is None  # nothing was asked
        c.health.end_job("failed", "failure budget spent", "n0")
    ended = _job(lc, "stop", "--if-running", "-o", "json")
    assert ended.returncode == 0 and json.loads(ended.stdout)["state"] == "failed"


@pytest.mark.timeout(300)
def test_helm_uninstall_of_a_running_job_stops_it_and_every_pod_goes_in_seconds(
    tmp_path: Path, no_orphans: None
) -> None:
    """The chart's teardown as Kubernetes runs it, against live agents of the StatefulSet
    mode (they idle once the job is over): the pre-delete hook's command, then each pod's
    preStop. The hook returns once the job stopped at one committed, persisted step; each
    preStop, with the default drain wait of 300 s, returns within seconds because the job is
    over (before, every pod of a release waited out its drain wait: no drain can hand off
    when every node drains at once)."""
    import os
    import shutil
    import tempfile
    import time

    from elasticpp.cli.main import build_parser
    from tests.charts import elasticpp_calls, hooks, one, render

    run_root = Path(tempfile.mkdtemp(prefix="ep-td-"))  # unix socket paths are short
    spec = {**SPEC, "persist_dir": str(tmp_path / "checkpoints")}
    lc = LocalCluster(
        tmp_path / "job", spec, nodes=2, slots=1,
        agent_args=["--control-socket", f"{run_root}/{{node}}.sock"],
    )  # fmt: skip
    try:
        lc.start()
        lc.wait_for(lambda: lc.max_step() >= 3, 150, "the job training")
        values = ["--set", f"etcd.endpoints={{{lc.etcd.endpoint}}}", "--set",
                  "etcd.tls.existingSecret=", "--set", "agent.insecure=true",
                  "--set", "etcd.prefix=/elasticpp", "--set", "jobSpec.name=llm"]  # fmt: skip
        (hook,) = hooks(*values)
        (container,) = hook["spec"]["template"]["spec"]["containers"]
        argv = container["command"][1:] + container["args"]
        build_parser()[0].parse_args(argv)  # the hook's command line is one elasticpp takes
        started = time.monotonic()
        stop = subprocess.run(
            [sys.executable, "-m", "elasticpp.cli.main", *argv, "-o", "json"],
            capture_output=True, text=True, timeout=250, check=False,
        )  # fmt: skip
        assert stop.returncode == 0, stop.stderr + _logs(lc)
        assert "end" in json.loads(stop.stdout), stop.stdout
        end = json.loads(stop.stdout)["end"]
        assert end["status"] == "stopped" and "helm uninstall of release rel" in end["reason"]
        assert find_latest_checkpoint(tmp_path / "checkpoints").step == end["step"]

        path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        for n in lc.nodes:
            docs = render(*values, "--set", f"agent.controlSocket={run_root}/{n.node_id}.sock")
            (agent,) = one(docs, "StatefulSet")["spec"]["template"]["spec"]["containers"]
            pre_stop = agent["lifecycle"]["preStop"]["exec"]["command"]
            assert any(c[:2] == ["ctl", "--agent"] and "--wait" in c and c[c.index("--wait") + 1]
                       == "300" for c in elasticpp_calls(pre_stop[2]))  # fmt: skip
            env = {**os.environ, "PATH": path}
            ran = subprocess.run(
                pre_stop, env=env, capture_output=True, text=True, timeout=120, check=False
            )
            assert ran.returncode == 0, ran.stdout + ran.stderr
            assert n.proc is not None and n.proc.wait(timeout=30) is not None
        took_s = time.monotonic() - started
        assert took_s < 120, f"teardown took {took_s:.0f} s"
        assert lc.max_step() == end["step"] - 1  # nothing trained past the stop
    finally:
        lc.close()
        shutil.rmtree(run_root, ignore_errors=True)
