"""A node loss in a simulated cluster (bench/scalesim.py: the real agent with simulated
workers, one real etcd): every node reaches the new generation, the control plane's
invariants hold on etcd's history, and no record outgrows its bounds. No timing assertions:
the times depend on the machine."""

from __future__ import annotations

from pathlib import Path

from bench.scale import run_size

NODES = 64  # 256 takes minutes on a two-core machine (README, "Control plane at scale")


def test_a_node_loss_in_a_simulated_cluster_reaches_every_node_within_bounds(
    tmp_path: Path, no_orphans: None
) -> None:
    r = run_size(NODES, ["loss"], steady_s=1.0, slots=1, timeout_s=240.0, workdir=tmp_path)
    (loss,) = r["transitions"]
    assert loss["error"] is None
    assert loss["generation"] >= 2  # every live node held it and started (else run_size raises)
    assert loss["nodes"] == NODES
    assert r["violations"] == []
    assert r["history_events"] > NODES  # the checker read the whole history
    assert r["largest_value"] <= 64 * 1024
    assert r["largest_read"] <= 1024 * 1024
