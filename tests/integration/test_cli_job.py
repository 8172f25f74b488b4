"""`elasticpp job` against a real etcd: a job's state once its agents are gone; a failed job
reset so that it may run again; a job's keys deleted. (A finished job, with its agents
idling: tests/integration/test_job_end_metrics.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from elasticpp.cluster.client import ClusterClient
from elasticpp.cluster.etcd.server import EtcdServer


def _job(etcd: EtcdServer, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "elasticpp.cli.main", "job", *args, "--etcd", etcd.endpoint,
         "--name", "llm"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def test_a_failed_job_is_told_reset_to_run_again_and_deleted(etcd: EtcdServer) -> None:
    absent = _job(etcd, "status", "-o", "json")
    assert absent.returncode == 0 and json.loads(absent.stdout)["state"] == "absent"
    refused = _job(etcd, "reset")
    assert refused.returncode == 2 and "no such job in etcd" in refused.stderr
    with ClusterClient([etcd.endpoint], "llm") as c:
        c.put_spec_if_absent('{"name": "llm"}')
        c.epoch_if_absent(7, "n0")
        c.health.end_job("failed", "failure budget spent: 51 failed generations in 3600 s", "n0")
    status = json.loads(_job(etcd, "status", "-o", "json").stdout)
    assert status["state"] == "failed" and status["epoch"] == 7
    assert status["end"]["reason"].startswith("failure budget spent")
    table = _job(etcd, "status").stdout
    assert "state  " in table and "failed by n0: failure budget spent" in table
    reset = _job(etcd, "reset")
    assert reset.returncode == 0, reset.stderr
    assert json.loads(_job(etcd, "status", "-o", "json").stdout)["state"] == "waiting"
    again = _job(etcd, "reset")  # nothing to reset: refused, naming the state
    assert again.returncode == 2 and "job llm is waiting" in again.stderr
    deleted = _job(etcd, "delete")
    assert deleted.returncode == 0 and "key(s) deleted" in deleted.stdout
    assert json.loads(_job(etcd, "status", "-o", "json").stdout)["state"] == "absent"


def test_bad_flags_are_refused_with_exit_2(etcd: EtcdServer) -> None:
    bad = subprocess.run(
        [sys.executable, "-m", "elasticpp.cli.main", "job", "status", "--etcd", etcd.endpoint,
         "--name", "Bad Name"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert bad.returncode == 2 and "--name" in bad.stderr


def test_an_agent_of_another_version_than_the_jobs_leader_is_refused_naming_both(
    etcd: EtcdServer, tmp_path: Path
) -> None:
    import elasticpp

    spec = tmp_path / "job.yaml"
    spec.write_text(
        "name: llm\nmodel: tiny\nglobal_batch: 4\nmicro_batch: 2\nsteps: 2\nseed: 0\n"
        "min_nodes: 2\nmax_nodes: 2\n"
    )
    with ClusterClient([etcd.endpoint], "llm") as c:
        info = {"address": "127.0.0.1:1", "slots": 1, "incarnation": "x", "version": "0.0.9"}
        c.register("old-0", info, ttl_s=30)
        assert c.campaign("old-0", ttl_s=30) is not None
        agent = subprocess.run(
            [sys.executable, "-m", "elasticpp.cli.main", "agent", "--etcd", etcd.endpoint,
             "--job-spec", str(spec), "--node-id", "new-1", "--state-dir", str(tmp_path / "s"),
             "--device", "cpu", "--slots", "1", "--listen", "127.0.0.1:0"],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert agent.returncode == 2, agent.stderr[-2000:]
        assert "runs elasticpp 0.0.9 (its leader old-0)" in agent.stderr
        assert f"this agent is elasticpp {elasticpp.__version__}" in agent.stderr
        assert "new-1" not in c.members().nodes  # refused before it registered


def test_whatif_plans_the_spec_in_etcd_for_the_registered_agents_slots(
    etcd: EtcdServer, tmp_path: Path
) -> None:
    from elasticpp.agent.jobspec import load_job_spec
    from elasticpp.plan import ClusterSpec
    from elasticpp.plan.search import plan as plan_layout

    path = tmp_path / "job.yaml"
    path.write_text(
        "name: llm\nmodel: gpt-1.3b\nglobal_batch: 64\nmicro_batch: 2\nsteps: 10\nseed: 0\n"
        "min_nodes: 1\nmax_nodes: 8\ndevice: a100-80g\n"
    )
    spec = load_job_spec(path)
    absent = _job(etcd, "whatif", "--nodes", "3")
    assert absent.returncode == 2 and "no such job in etcd" in absent.stderr
    with ClusterClient([etcd.endpoint], "llm") as c:
        c.put_spec_if_absent(spec.to_json())
        for node in ("n0", "n1"):
            c.register(node, {"address": "127.0.0.1:1", "slots": 4, "incarnation": node}, ttl_s=30)
        run = _job(etcd, "whatif", "--nodes", "3", "-o", "json")
        assert run.returncode == 0, run.stderr
        got = json.loads(run.stdout)
        best = plan_layout(
            spec.model, ClusterSpec.uniform(3, 4, spec.device_spec()), 64, micro_batch=2, top_k=0
        ).candidates[0]
        assert got["slots_per_node"] == 4 and got["gpus"] == 12
        assert {k: got[k] for k in best.to_dict()} == best.to_dict()
        c.register("n2", {"address": "127.0.0.1:2", "slots": 8, "incarnation": "n2"}, ttl_s=30)
        mixed = _job(etcd, "whatif", "--nodes", "3")
        assert mixed.returncode == 2 and "--slots is needed" in mixed.stderr
        assert _job(etcd, "whatif", "--nodes", "3", "--slots", "8").returncode == 0


def test_status_as_yaml_is_the_json_status(etcd: EtcdServer) -> None:
    import yaml

    with ClusterClient([etcd.endpoint], "llm") as c:
        c.put_spec_if_absent('{"name": "llm"}')
    as_json = json.loads(_job(etcd, "status", "-o", "json").stdout)
    assert yaml.safe_load(_job(etcd, "status", "-o", "yaml").stdout) == as_json
    assert as_json["state"] == "waiting" and as_json["generation"] is None
