"""`elasticpp job cordon` and `uncordon`, end to end: a real etcd and three real agents with
real workers. A cordoned node is left at a step boundary (nothing recomputed) while its
agent stays up as a spare; uncordoned, it is planned in again. A cordon that names no node
of the job is refused with exit 2; doing either again is said, and not an error."""

from __future__ import annotations

import contextlib
import json
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elasticpp.agent.localcluster import LocalCluster
from tests.jobcli import job as _job

SPEC: dict[str, Any] = {
    "name": "llm", "model": "tiny", "global_batch": 6, "micro_batch": 1, "steps": 100_000,
    "seed": 0, "min_nodes": 2, "max_nodes": 3, "lease_ttl_s": 3, "replication_copies": 0,
    "stop_timeout_s": 10,
}  # fmt: skip


@pytest.fixture
def cluster(tmp_path: Path, no_orphans: None) -> Iterator[LocalCluster]:
    lc = LocalCluster(tmp_path / "job", SPEC, nodes=3, slots=1)
    try:
        yield lc
    finally:
        lc.close()


def _after(lc: LocalCluster, count: int, reason: str) -> dict[str, Any] | None:
    for t in lc.timelines()[count:]:
        if reason in str(t.get("reason")):
            return t
    return None


@pytest.mark.timeout(300)
def test_a_cordoned_node_is_left_at_a_step_boundary_and_planned_in_again_once_uncordoned(
    cluster: LocalCluster,
) -> None:
    lc = cluster
    lc.start()
    lc.wait_for(lambda: len(lc.timelines()) >= 1 and lc.max_step() >= 3, 150, "training")
    before = len(lc.timelines())

    unknown = _job(lc, "cordon", "--node", "node-9")
    assert unknown.returncode == 2 and "not a node of job llm" in unknown.stderr
    cordon = _job(lc, "cordon", "--node", "node-2", "--reason", "disk swap", "-o", "json")
    assert cordon.returncode == 0, cordon.stderr
    assert json.loads(cordon.stdout)["changed"] is True
    lc.wait_for(lambda: _after(lc, before, "cordon of node-2") is not None, 120, "the cordon")
    left = _after(lc, before, "cordon of node-2")
    assert left is not None and left["steps_recomputed"] == 0, left
    nodes = {n["node_id"]: n for n in json.loads(_job(lc, "nodes", "-o", "json").stdout)}
    assert nodes["node-2"]["cordoned"] == "disk swap" and not nodes["node-2"]["planned"]
    node2 = lc.node("node-2").proc
    assert node2 is not None and node2.poll() is None  # its agent stays, a spare
    again = _job(lc, "cordon", "--node", "node-2", "-o", "json")
    assert again.returncode == 0 and "cordoned already" in json.loads(again.stdout)["message"]

    # What happened, from etcd: the epoch, each generation and its recovery, the cordon.
    events = json.loads(_job(lc, "events", "-o", "json").stdout)
    kinds = [e["kind"] for e in events]
    assert kinds[0] == "epoch" and {"generation", "recovery", "cordon"} <= set(kinds), kinds
    assert [e["at"] for e in events] == sorted(e["at"] for e in events)
    (cordon_event,) = [e for e in events if e["kind"] == "cordon"]
    assert cordon_event["node"] == "node-2" and "disk swap" in cordon_event["message"]
    assert any(e["kind"] == "recovery" and "cordon of node-2" in e["message"]
               and "0 step(s) recomputed" in e["message"] for e in events)  # fmt: skip
    later = json.loads(_job(lc, "events", "--since", "2026-01-01T00:00:00", "-o", "json").stdout)
    assert later == events
    assert json.loads(_job(lc, "events", "--since", "0s", "-o", "json").stdout) == []
    bad = _job(lc, "events", "--since", "yesterday")
    assert bad.returncode == 2 and "--since" in bad.stderr

    follow = subprocess.Popen(
        [sys.executable, "-m", "elasticpp.cli.main", "job", "events", "--etcd", lc.etcd.endpoint,
         "--name", "llm", "--follow", "--since", "1h", "--every", "0.5", "-o", "json"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(
            target=lambda: [lines.put(x) for x in follow.stdout or ()], daemon=True
        ).start()
        # What it read first is what `events` printed; the uncordon comes after that read.
        assert [json.loads(lines.get(timeout=30)) for _ in events] == events
        count = len(lc.timelines())
        uncordon = _job(lc, "uncordon", "--node", "node-2")
        assert uncordon.returncode == 0 and "uncordoned" in uncordon.stdout, uncordon.stderr
        lc.wait_for(lambda: _after(lc, count, "join of node-2") is not None, 120, "the join")
        back = _after(lc, count, "join of node-2")
        assert back is not None and back["steps_recomputed"] == 0, back
        followed: list[dict[str, Any]] = []
        deadline = time.monotonic() + 60
        while not any(e["kind"] == "recovery" and "join of node-2" in e["message"]
                      for e in followed) and time.monotonic() < deadline:  # fmt: skip
            with contextlib.suppress(queue.Empty):
                followed.append(json.loads(lines.get(timeout=1)))
        kinds = [e["kind"] for e in followed]
        assert kinds[0] == "uncordoned" and followed[0]["node"] == "node-2", followed
        assert "generation" in kinds and "recovery" in kinds, followed  # each once
        assert len({(e["kind"], e["at"]) for e in followed}) == len(followed)
    finally:
        follow.terminate()
        follow.wait(timeout=10)
    status = json.loads(_job(lc, "status", "-o", "json").stdout)
    assert status["cordoned"] == {} and "node-2" in status["planned_nodes"]
    not_cordoned = _job(lc, "uncordon", "--node", "node-2")
    assert not_cordoned.returncode == 0 and "is not cordoned" in not_cordoned.stdout
