"""A node loss in a simulated cluster (bench/scalesim.py: the real agent with simulated
workers, one real etcd): every node reaches the new generation, the control plane's
invariants hold on etcd's history, and no record outgrows its bounds. No timing assertions:
the times depend on the machine."""

from __future__ import annotations

from pathlib import Path

from bench.scale import run_size

NODES = 256  # 30 s on a two-core machine (docs/benchmarks.md, "Control plane at scale")


def test_a_node_loss_in_a_simulated_cluster_reaches_every_node_within_bounds(
    tmp_path: Path, no_orphans: None
) -> None:
    r = run_size(NODES, ["loss"], steady_s=1.0, slots=1, timeout_s=240.0, workdir=tmp_path)
    (loss,) = r["transitions"]
    assert loss["error"] is None
    assert loss["generation"] >= 2  # every live node held it and started (else run_size raises)
    assert loss["nodes"] == NODES
    window = loss["hold_window_cpu_s"]  # what the hold's window used, sampled from /proc
    assert set(window) == {"etcd", "processes", "cores"}
    assert window["etcd"] >= 0 and window["processes"] > 0 and window["cores"] > 0
    assert r["violations"] == []
    assert r["history_events"] > NODES  # the checker read the whole history
    assert r["largest_value"] <= 64 * 1024
    assert r["largest_read"] <= 1024 * 1024
    by_thread = r["steady"]["cpu_ms_per_node_s_by_thread"]
    assert "loops-#" in by_thread and "etcd-leases-#" in by_thread  # where the idle CPU goes


def test_a_join_and_a_sick_node_in_a_small_simulated_cluster_settle(
    tmp_path: Path, no_orphans: None
) -> None:
    """At 16 nodes the agents' loops keep their leases on a busy two-core machine, so one
    leader term sees the sick node's three failed generations and quarantines it."""
    r = run_size(16, ["join", "sick"], steady_s=0.5, slots=1, timeout_s=120.0, workdir=tmp_path)
    join, sick = r["transitions"]
    assert join["error"] is None and join["nodes"] == 16  # before the join
    assert sick["error"] is None
    assert sick["quarantined_s"] is not None
    *failed, last = sick["reasons"]
    assert failed and all(reason == f"worker failure on {sick['node']}" for reason in failed)
    assert last == f"quarantined node(s) {sick['node']}"
    assert r["violations"] == []
