"""What an agent's exit code says, end to end, as the Helm chart's indexed Job reads it (its
podFailurePolicy): real etcd servers, real agent processes with `--on-job-end exit` and the
chart's `--unfinished-exit-code`, real workers. A finished job's agent exits 0 (the Job's index
completes), and so does one started after the end; a failed job's agents exit 3 and a halted
one's 4 (FailJob), including an agent started after the end; an agent stopped by SIGTERM
while the job goes on exits with the unfinished code (a replacement pod, not a completed
index) within its stop deadline."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elasticpp.agent.health.step import EXIT_FAILED, EXIT_HALTED
from elasticpp.agent.kernel.limits import AGENT_STOP_KILL_WAIT_S
from elasticpp.agent.localcluster import LocalCluster
from elasticpp.cluster.client import ClusterClient

UNFINISHED = 143  # what the chart's indexed Job gives --unfinished-exit-code
SPEC: dict[str, Any] = {
    "model": "tiny", "global_batch": 4, "micro_batch": 2, "seed": 0, "min_nodes": 1,
    "max_nodes": 1, "lease_ttl_s": 3, "replication_copies": 0, "stop_timeout_s": 10,
}  # fmt: skip
EXIT_ARGS = ["--on-job-end", "exit", "--unfinished-exit-code", str(UNFINISHED)]


@pytest.fixture
def clusters(tmp_path: Path, no_orphans: None) -> Iterator[dict[str, LocalCluster]]:
    # One etcd and one single-node job each; `no_orphans` (tests/conftest.py) fails the test
    # if any process outlives them.
    jobs = {
        "finished": {"steps": 4},
        "stopped": {"steps": 100_000},
        "failed": {"steps": 100_000},
        "halted": {"steps": 100_000},
    }
    made = {
        name: LocalCluster(
            tmp_path / name,
            {**SPEC, "name": name, **extra},
            nodes=1,
            slots=1,
            agent_args=EXIT_ARGS,
        )
        for name, extra in jobs.items()
    }
    try:
        yield made
    finally:
        for lc in made.values():
            lc.close()


def _end(lc: LocalCluster, status: str) -> None:
    with ClusterClient([lc.etcd.endpoint], str(lc.spec["name"])) as c:
        c.health.end_job(status, f"ended by the test ({status})", "test")


def _exit_code(lc: LocalCluster, timeout_s: float) -> int:
    proc = lc.nodes[0].proc
    assert proc is not None
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{lc.spec['name']}'s agent did not exit in {timeout_s:.0f} s")


def _log(lc: LocalCluster) -> str:
    path = lc.nodes[0].log_path
    return path.read_text(encoding="utf-8") if path is not None else ""


@pytest.mark.timeout(240)
def test_an_exit_mode_agent_says_finished_failed_halted_or_left_in_its_exit_code(
    clusters: dict[str, LocalCluster],
) -> None:
    for lc in clusters.values():
        lc.etcd.start()
    # Jobs that ended before this agent came (a replacement pod after the end): it reads
    # the end and exits with its code at once.
    _end(clusters["failed"], "failed")
    _end(clusters["halted"], "halted")
    for lc in clusters.values():
        lc.start_node("node-0")

    assert _exit_code(clusters["failed"], 120) == EXIT_FAILED, _log(clusters["failed"])[-3000:]
    assert _exit_code(clusters["halted"], 120) == EXIT_HALTED, _log(clusters["halted"])[-3000:]

    stopped = clusters["stopped"]
    stopped.wait_for(lambda: stopped.max_step() >= 0, 150, "the long job training")
    # SIGTERM while the job goes on: the agent leaves it, within its stop deadline.
    stop_s = float(SPEC["stop_timeout_s"]) + AGENT_STOP_KILL_WAIT_S
    proc = stopped.nodes[0].proc
    assert proc is not None
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=stop_s + 30)
    took_s = time.monotonic() - sent
    assert proc.returncode == UNFINISHED, _log(stopped)[-3000:]  # not 1: not cut short
    assert took_s <= stop_s, f"the agent took {took_s:.1f} s to exit after SIGTERM"

    finished = clusters["finished"]
    assert _exit_code(finished, 150) == 0, _log(finished)[-3000:]
    assert finished.max_step() == 3
    # An agent started after the job finished says finished too, not "left".
    finished.start_node("node-0")
    assert _exit_code(finished, 120) == 0, _log(finished)[-3000:]
