"""The agents' etcd traffic in steady training: real etcd, real agents, real workers.

Every agent follows etcd through its watch-fed cache: over a window of steps with no change
of membership no agent sends etcd a range read (a follower read what it follows about eight
times a second before, the leader thirteen, with every node's commit record twice a second).
Counted by the agents' own request counters, not timed.
"""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elasticpp.agent.localcluster import LocalCluster

SPEC: dict[str, Any] = {
    "name": "rtest",
    "model": "tiny",
    "global_batch": 8,
    "micro_batch": 2,
    # Never ends inside the window: the window waits for a follower's commit record (at most
    # every 5 s) to reach the leader and its safe step to come back, and a job that finished
    # first took the agents' metrics endpoints with it (200 steps did, ~17 steps/s here).
    "steps": 100_000,
    "seed": 3,
    "min_nodes": 2,
    "max_nodes": 2,
    "lease_ttl_s": 5,
    "join_settle_s": 0.5,
}


@pytest.fixture
def cluster(tmp_path: Path, no_orphans: None) -> Iterator[LocalCluster]:
    lc = LocalCluster(tmp_path / "job", SPEC, nodes=2, slots=1)
    try:
        yield lc
    finally:
        lc.close()


def _scrape(port: int) -> tuple[dict[str, float], bool]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    counts: dict[str, float] = {}
    leader = False
    for line in text.splitlines():
        m = re.match(r'^elasticpp_etcd_requests_total\{.*method="([^"]+)".*\} (\S+)$', line)
        if m:
            counts[m.group(1)] = float(m.group(2))
        if line.startswith("elasticpp_is_leader{") and line.endswith(" 1.0"):
            leader = True
    return counts, leader


@pytest.mark.timeout(240)
def test_no_agent_sends_etcd_a_range_read_in_steady_training(cluster: LocalCluster) -> None:
    cluster.start()
    # Steady: the generation's timeline is written (the leader's last step of a transition).
    cluster.wait_for(lambda: cluster.max_step() >= 6 and bool(cluster.timelines()), 180, "step 6")
    ports = {n.node_id: n.metrics_port for n in cluster.nodes}
    before = {node: _scrape(port) for node, port in ports.items()}
    start = cluster.max_step()
    generation = cluster.curve()[start][1]
    after: dict[str, tuple[dict[str, float], bool]] = {}

    def window_done() -> bool:
        # The window is at least 8 steps, and long enough that every agent has talked to etcd
        # (keep-alives, and watch events: the followers' commit records on the leader, the safe
        # step it publishes on the followers), whatever the machine's step time.
        if cluster.max_step() < start + 8:
            return False
        after.update({node: _scrape(port) for node, port in ports.items()})
        return all(
            after[node][0].get(method, 0) > before[node][0].get(method, 0)
            for node in ports
            for method in ("LeaseKeepAlive", "WatchEvent")
        )

    cluster.wait_for(window_done, 120, "8 steps with keep-alives and watch events on every agent")
    end = cluster.max_step()
    assert cluster.curve()[end][1] == generation, "membership changed in the window"
    assert sorted(leader for _, leader in after.values()) == [False, True], after
    for node, (counts, _) in after.items():
        old = before[node][0]
        assert counts.get("Range", 0) == old.get("Range", 0), (node, old, counts)
