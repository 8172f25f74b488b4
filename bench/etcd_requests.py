"""etcd requests per node per second while a job trains steadily, by method.

    python bench/etcd_requests.py [--nodes 3] [--window-s 20]

Starts a job on `LocalCluster` (a real etcd, N agent processes of 1 slot, the tiny model),
waits until every node trains, then reads each agent's `elasticpp_etcd_requests_total`
from its metrics endpoint at the start and at the end of a window of steady training (no
node joins or leaves), and prints the requests per node per second by method, the leader
apart. Every process it starts is killed on the way out.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from elasticpp.agent.localcluster import LocalCluster

SPEC = {
    "name": "reqs",
    "model": "tiny",
    "global_batch": 8,
    "micro_batch": 2,
    "steps": 100_000,
    "seed": 1,
    "lease_ttl_s": 5,
    "join_settle_s": 0.5,
}
_SAMPLE = re.compile(r"^elasticpp_etcd_requests_total\{([^}]*)\} ([0-9.e+]+)$")
_LEADER = re.compile(r"^elasticpp_is_leader\{[^}]*\} ([0-9.]+)$")


def scrape(port: int) -> tuple[dict[str, float], bool]:
    """(requests by method, is leader) from one agent's metrics endpoint."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    counts: dict[str, float] = {}
    leader = False
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            method = re.search(r'method="([^"]*)"', m.group(1))
            if method:
                counts[method.group(1)] = float(m.group(2))
        m = _LEADER.match(line)
        if m:
            leader = float(m.group(1)) == 1.0
    return counts, leader


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--window-s", type=float, default=20.0)
    args = ap.parse_args()
    spec = {**SPEC, "min_nodes": args.nodes, "max_nodes": args.nodes}
    with (
        tempfile.TemporaryDirectory(prefix="etcd-requests-") as tmp,
        LocalCluster(Path(tmp), spec, nodes=args.nodes, slots=1) as lc,
    ):
        lc.start()
        lc.wait_for(lambda: lc.max_step() >= 5, 180, "step 5")
        time.sleep(3.0)  # past the transition's barriers: the window is steady training
        ports = {n.node_id: n.metrics_port for n in lc.nodes}
        before = {node: scrape(port) for node, port in ports.items()}
        step0, t0 = lc.max_step(), time.monotonic()
        time.sleep(args.window_s)  # a measuring window, not a wait for a condition
        after = {node: scrape(port) for node, port in ports.items()}
        span_s, steps = time.monotonic() - t0, lc.max_step() - step0
    print(f"{args.nodes} nodes, {span_s:.1f} s, {steps} steps; etcd requests per second")
    methods = sorted({m for c, _ in after.values() for m in c})
    print(f"{'node':<10} {'role':<8} " + " ".join(f"{m:>14}" for m in methods) + f" {'all':>8}")
    for node in sorted(after):
        (a, leader), (b, _) = after[node], before[node]
        rates = [(a.get(m, 0.0) - b.get(m, 0.0)) / span_s for m in methods]
        role = "leader" if leader else "follower"
        cells = " ".join(f"{r:>14.2f}" for r in rates)
        print(f"{node:<10} {role:<8} {cells} {sum(rates):>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
