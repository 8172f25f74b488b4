"""bench/leader_turn.py measures what it says: its arrivals are ones the leader reads (none
skipped as unreadable, which would time the skip path), and a run gives every figure."""

from __future__ import annotations

from bench.leader_turn import _arrivals, measure
from elasticpp.cluster.barriers import check_arrival
from elasticpp.cluster.client import ClusterClient


def test_the_benchmarks_arrivals_are_all_readable() -> None:
    client = ClusterClient(["127.0.0.1:1"], "bench")
    try:
        kvs = _arrivals(client, 16)
        out = client.reads.values_once(
            kvs, "stopped-2 arrival", lambda n, r: check_arrival("stopped-2", n, r.get("value"))
        )
        assert len(out) == 16 and client.skipped_values == 0
    finally:
        client.close()


def test_a_small_run_gives_every_figure() -> None:
    figures = measure(16, repeats=1)
    kinds = {"arrivals_kept_ms", "arrivals_all_ms", "decide_kept_ms", "decide_all_ms"}
    assert set(figures) == kinds
    assert all(v > 0 for v in figures.values())
