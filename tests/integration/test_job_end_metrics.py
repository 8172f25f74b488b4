"""A finished job, as Prometheus sees a live agent that idles after it (the chart's
`onJobEnd: idle`): it says finished, so the alerts of deploy/prometheus stay quiet (their
promtool tests replay these series across every rule's `for:` window); `elasticpp job` reads
the same from etcd."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from elasticpp.agent.localcluster import LocalCluster


def _scrape(port: int) -> dict[tuple[str, str], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    return {
        (s.name, s.labels.get("status") or s.labels.get("state") or ""): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
    }


@pytest.mark.timeout(180)
def test_an_idle_agent_after_a_finished_job_exports_finished_and_no_failure(
    tmp_path: Path,
) -> None:
    spec = {
        "name": "endjob", "model": "tiny", "global_batch": 4, "micro_batch": 2, "steps": 6,
        "seed": 0, "min_nodes": 1, "max_nodes": 1, "lease_ttl_s": 3, "snapshot_every": 2,
        "replication_copies": 0,
    }  # fmt: skip
    lc = LocalCluster(tmp_path / "job", spec, nodes=1, slots=1, agent_args=["--on-job-end", "idle"])
    try:
        lc.start()
        node = lc.nodes[0]
        assert node.log_path is not None
        lc.wait_for(
            lambda: "job finished: this agent idles" in node.log_path.read_text(),
            150,
            "the finished job's agent idling",
        )
        # The worker gauges follow at the agent's next view refresh.
        lc.wait_for(
            lambda: _scrape(node.metrics_port)[("elasticpp_workers", "running")] == 0,
            30,
            "no running worker in the metrics",
        )
        values = _scrape(node.metrics_port)
        assert values[("elasticpp_job_finished", "")] == 1
        assert values[("elasticpp_job_ended", "finished")] == 1
        assert ("elasticpp_job_ended", "failed") not in values
        assert values[("elasticpp_target_steps", "")] == 6
        assert values[("elasticpp_step", "")] == 5
        assert values[("elasticpp_workers", "running")] == 0
        # And as etcd tells it, to `elasticpp job`: finished, every step trained; neither reset
        # (it trained every step) nor deleted while its agent is registered.
        import json
        import subprocess
        import sys

        job = [sys.executable, "-m", "elasticpp.cli.main", "job"]
        where = ["--etcd", lc.etcd.endpoint, "--name", "endjob"]

        def run(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([*job, *args, *where], capture_output=True, text=True,
                                  timeout=60, check=False)  # fmt: skip

        status = json.loads(run("status", "-o", "json").stdout)
        assert status["state"] == "finished" and status["trained_steps"] == 6
        assert status["members"] == ["node-0"] and status["generation"] == 1
        reset = run("reset")
        assert reset.returncode == 2 and "job endjob is finished" in reset.stderr
        delete = run("delete")
        assert delete.returncode == 2 and "agents are registered (node-0)" in delete.stderr
        [node] = json.loads(run("nodes", "-o", "json").stdout)
        assert node["node_id"] == "node-0" and node["address"] == lc.nodes[0].address
        assert node["slots"] == 1 and node["ranks"] == 1 and node["planned"]
        assert node["version"] == __import__("elasticpp").__version__
        table = run("nodes").stdout.splitlines()
        assert table[0].split() == ["NODE", "ADDRESS", "SLOTS", "RANKS", "STATE", "VERSION"]
        assert table[1].split()[0] == "node-0" and "planned" in table[1]
    finally:
        lc.close()
