"""A real Prometheus (Debian's server, fetched into .venv/tools beside promtool) scrapes live
agents through a recovery, with deploy/prometheus's rules loaded: every query of the Grafana
dashboard (deploy/grafana) returns data, every rule evaluates cleanly, and no alert fires.

The agents run CPU slots, which have no peak to measure MFU against: the job spec declares
one (`peak_tflops`, the CPU preset's 0.03 TFLOP/s), as a user may, so the MFU panel has data;
the test checks that MFU is exactly the declared peak's share (tests/unit/test_flops.py checks
that a CPU slot without it reports no MFU)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from elasticpp.agent.localcluster import LocalCluster, free_ports

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = ROOT / ".venv" / "tools" / "prometheus"
RULES = ROOT / "deploy" / "prometheus" / "elasticpp-rules.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "elasticpp-job.json"
PEAK_TFLOPS = 0.03  # a slot's, declared in the job spec: CPU slots have no peak of their own


def _get(base: str, path: str, **params: str) -> Any:
    url = f"{base}{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
    with urllib.request.urlopen(url, timeout=10) as reply:
        return json.loads(reply.read())


def _query(base: str, expr: str) -> list[Any]:
    answer = _get(base, "/api/v1/query", query=expr)
    assert answer["status"] == "success", (expr, answer)
    return list(answer["data"]["result"])


def _dashboard_queries(job: str) -> list[tuple[str, str]]:
    board = json.loads(DASHBOARD.read_text())
    out = []
    for panel in board["panels"]:
        for target in panel["targets"]:
            expr = (
                target["expr"]
                .replace("$job", job)
                .replace("$__rate_interval", "10s")
                .replace("$__range", "5m")
            )
            out.append((f"{panel['title']} / {target['legendFormat']}", expr))
    return out


@pytest.mark.timeout(300)
def test_the_dashboard_and_rules_work_against_live_agents_through_a_recovery(
    tmp_path: Path,
) -> None:
    if not PROMETHEUS.is_file():
        pytest.fail(f"{PROMETHEUS} missing: run `bash tools/fetch_helm.sh` (Debian's prometheus)")
    spec = {
        "name": "promjob", "model": "tiny", "global_batch": 4, "micro_batch": 2,
        "steps": 100_000, "seed": 0, "min_nodes": 1, "max_nodes": 2, "lease_ttl_s": 3,
        "snapshot_every": 2, "replication_copies": 1, "peak_tflops": PEAK_TFLOPS,
    }  # fmt: skip
    lc = LocalCluster(tmp_path / "job", spec, nodes=2, slots=1)
    prometheus: subprocess.Popen[bytes] | None = None
    try:
        lc.start()
        (port,) = free_ports(1)
        base = f"http://127.0.0.1:{port}"
        config = tmp_path / "prometheus.yml"
        targets = [f"127.0.0.1:{n.metrics_port}" for n in lc.nodes]
        config.write_text(
            json.dumps(
                {
                    "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                    "rule_files": [str(RULES)],
                    "scrape_configs": [
                        {"job_name": "elasticpp", "static_configs": [{"targets": targets}]}
                    ],
                }
            )
        )  # JSON is YAML
        with (tmp_path / "prometheus.log").open("wb") as log:
            prometheus = subprocess.Popen(
                [
                    str(PROMETHEUS), f"--config.file={config}",
                    f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn",
                ],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

        def scraped(expr: str, at_least: float) -> bool:
            try:
                result = _query(base, expr)
            except OSError:
                return False  # not serving yet
            return bool(result) and float(result[0]["value"][1]) >= at_least

        lc.wait_for(lambda: lc.max_step() >= 4, 120, "step 4")
        lc.wait_for(lambda: scraped("max(elasticpp_step)", 3), 60, "Prometheus scraping")
        victim = lc.worker_pids("node-0") or lc.worker_pids("node-1")
        assert victim
        os.kill(victim[0], signal.SIGKILL)  # one recovery: its series need one
        lc.wait_for(
            lambda: scraped("sum(elasticpp_recoveries_total)", 1), 120, "a recovery scraped"
        )
        step = lc.max_step()
        lc.wait_for(lambda: scraped("max(elasticpp_step)", step + 3), 120, "steps after it")
        empty = [
            (what, expr) for what, expr in _dashboard_queries("promjob") if not _query(base, expr)
        ]
        assert empty == [], "dashboard queries without data"
        # MFU is TFLOP/s over the declared peak, on each node (one slot a node).
        peaks = _query(base, "elasticpp_model_tflops / elasticpp_mfu")
        assert peaks, "no node reports MFU"
        assert all(abs(float(p["value"][1]) - PEAK_TFLOPS) < 1e-9 for p in peaks), peaks
        assert all(float(p["value"][1]) > 0 for p in _query(base, "elasticpp_model_tflops"))
        rules = [
            r for g in _get(base, "/api/v1/rules")["data"]["groups"] for r in g["rules"]
        ]  # fmt: skip
        assert len(rules) >= 20
        broken = [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
        assert broken == [], broken
        firing = [
            a for a in _get(base, "/api/v1/alerts")["data"]["alerts"] if a["state"] == "firing"
        ]
        assert firing == [], firing
    finally:
        if prometheus is not None:
            os.killpg(prometheus.pid, signal.SIGKILL)
            prometheus.wait(timeout=10)
        lc.close()
